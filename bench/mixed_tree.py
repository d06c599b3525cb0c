"""Tokens per step of mixed-draft trees of ONE fixed size (no per-step size choice) on MT-Bench first turns, against
plain greedy; the command and what it measures: bench/mixed_tree/README.md, docs/modules.md."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from medusa_jax.model.sharding import MeshConfig
from medusa_jax.heads.draft_merge import DraftSizes
from medusa_jax.inference.draft_size import forced_sizes
from medusa_jax.inference.loaded_model import load_model
from medusa_jax.inference.mixed_decoding import make_members, parse_mix
from medusa_jax.inference.sharded import ShardedModel
from medusa_jax.bench import mixed_drafts
from medusa_jax.bench.bench_inputs import mtbench_questions
from medusa_jax.trees.policy.calibration import machine_description

MEMBERS = {"hydra": "default", "recycle": "recycle", "lookup": "lookup", "mix": "default+recycle+lookup"}


def fixed_size(mix, nodes: int) -> DraftSizes:
    """Every step verifies the mix's best `nodes` nodes (one size, so the choice is fixed)."""
    return forced_sizes((nodes,), mix.depth)[0]


def build(loaded, names, sizes) -> dict:
    """label -> (ShardedModel, DraftSizes) for each method name of MEMBERS at each size (NAME@N: at N only);
    plain first."""
    models = {"plain": (ShardedModel(loaded.base, None, MeshConfig()), None)}
    for entry in names:
        name, _, only = entry.partition("@")
        untrained, trained = parse_mix(MEMBERS[name])
        for n in ((int(only),) if only else sizes):
            mix = make_members(loaded.base, untrained, loaded.heads if trained else None, n)
            models[f"{name}@{n}"] = (ShardedModel(loaded.base, mix, MeshConfig()), fixed_size(mix, n))
    return models


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="16,64", help="fixed node counts, comma-separated")
    p.add_argument("--methods", default="hydra,recycle,lookup,mix",
                   help=f"of {', '.join(MEMBERS)}, each at every size or NAME@N at N only")
    p.add_argument("--questions", type=int, default=8)
    p.add_argument("--skip", type=int, default=0, help="questions skipped first (categories in turn)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--out", default=None, help="a JSON file for the results (none: print only)")
    a = p.parse_args(argv)
    sizes = tuple(int(s) for s in a.sizes.split(","))
    names = tuple(a.methods.split(","))
    if any(n < 1 for n in sizes) or any(m.partition("@")[0] not in MEMBERS for m in names) or a.questions < 1 or a.skip < 0:
        p.error(f"--sizes: integers >= 1; --methods: of {', '.join(MEMBERS)}; --questions >= 1; --skip >= 0")
    machine = machine_description()
    loaded = load_model("default", "default")
    questions = mtbench_questions(a.skip + a.questions)[a.skip:]
    prompts = loaded.encode_chat([q.first_turn for q in questions])
    models = build(loaded, names, sizes)
    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    rows = {label: [] for label in models}
    for i, prompt in enumerate(prompts):  # the results so far are written after every prompt
        for label, per in mixed_drafts.run_set(models, [prompt], a.max_new_tokens, loaded.eos_ids,
                                               loaded.pad_id).items():
            rows[label] += per
        summary = mixed_drafts.summarise(rows, {label: (t.nodes if t else 0) for label, (_, t) in models.items()})
        results = {"command": "python -m medusa_jax.bench.mixed_tree " + " ".join(argv or sys.argv[1:]),
                   "machine": machine, "questions": i + 1, "skip": a.skip, "max_new_tokens": a.max_new_tokens,
                   "rows": [{k: r[k] for k in ("method", "nodes", "tokens_per_step", "mismatches", "new_tokens")}
                            for r in summary]}
        text = json.dumps(results, indent=1) + "\n"
        if a.out:
            Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            Path(a.out).write_text(text)
        say(f"prompt {i + 1}/{len(prompts)}: " + ", ".join(f"{r['method']} {r['tokens_per_step']}"
                                                           for r in results["rows"]))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
