"""Calibrating the mixed tree's scores: how often a candidate node of each drafter is right, given its parent is
(the tables of `heads.merge_calibration`); method and command: docs/modules.md."""

from __future__ import annotations

import argparse
import json
import pickle
import sys
from pathlib import Path

import jax
import numpy as np

from medusa_jax.heads.draft_merge import PROB_EDGES, score_bin
from medusa_jax.heads.lookup import LookupDrafter
from medusa_jax.heads.mixed import MixedDrafter
from medusa_jax.inference.api import BatchSettings, generate_batch
from medusa_jax.inference.loaded_model import load_model
from medusa_jax.inference.mixed_decoding import make_members, parse_mix
from medusa_jax.inference.sharded import ShardedModel
from medusa_jax.model.sharding import MeshConfig
from medusa_jax.bench.bench_inputs import mtbench_questions
from medusa_jax.bench.mixed_tree import fixed_size
from medusa_jax.trees.policy.calibration import machine_description

RECORDS: list[dict] = []  # one per step and row: the members' candidate trees (host arrays) and the root's position
MAX_DEPTH = 10


def _record(length_b, *members):
    for row in range(length_b.shape[0]):
        RECORDS.append({"length": int(length_b[row]),
                        "members": [tuple(np.asarray(a[row]) for a in member) for member in members]})


class RecordingMix(MixedDrafter):
    """A MixedDrafter that also records its members' candidates (docs/modules.md); it needs prompt lookup."""

    def propose(self, hidden_bd, root_b, base, tree, draft, active_b):
        proposals, states = self.member_proposals(hidden_bd, root_b, base, draft, active_b)
        lookup = [i for i, d in enumerate(self.drafters) if isinstance(d, LookupDrafter)][0]
        jax.debug.callback(_record, draft[lookup].length_b,
                           *[(p.tokens_bt, p.parent_bt, p.depth_bt, p.score_bt) for p in proposals])
        return super().propose(hidden_bd, root_b, base, tree, draft, active_b)


def trials(records: list[dict], sequence: list[int], names: tuple[str, ...]) -> list[tuple]:
    """(member name, depth, bin of its conditional score, path key, right) for every candidate whose parent's path
    is the sequence's continuation after the root at `length` (docs/modules.md)."""
    out = []
    for rec in records:
        root = rec["length"]
        for name, (tokens_t, parent_t, depth_t, score_t) in zip(names, rec["members"]):
            on_path = np.zeros(len(tokens_t), bool)
            on_path[0] = True
            for t in range(1, len(tokens_t)):  # parents come first
                d, p = int(depth_t[t]), int(parent_t[t])
                if not np.isfinite(score_t[t]) or not on_path[p] or root + d >= len(sequence):
                    continue
                right = int(tokens_t[t]) == sequence[root + d]
                on_path[t] = right
                conditional = float(np.exp(score_t[t] - score_t[p]))
                out.append((name, min(d, MAX_DEPTH), score_bin(conditional), (root, d, int(tokens_t[t])), right))
    return out


def tables(all_trials: list[tuple], names: tuple[str, ...]) -> dict:
    """{member: {"tried": [D][B], "right": [D][B]}} and the agreement table: per number of members proposing the
    same node (same position, same token, parent on the path), tried and right."""
    out = {}
    for name in names:
        tried = np.zeros((MAX_DEPTH, len(PROB_EDGES) + 1), int)
        right = np.zeros_like(tried)
        for n, d, k, _, r in all_trials:
            if n == name:
                tried[d - 1, k] += 1
                right[d - 1, k] += r
        out[name] = {"tried": tried.tolist(), "right": right.tolist()}
    by_key: dict = {}
    for n, _, _, key, r in all_trials:
        by_key.setdefault(key, (set(), r))[0].add(n)
    agree = {}
    for members, r in by_key.values():
        label = "+".join(sorted(members))
        tried, right = agree.get(label, (0, 0))
        agree[label] = (tried + 1, right + int(r))
    out["agreement"] = {k: {"tried": t, "right": r, "rate": round(r / t, 3)} for k, (t, r) in sorted(agree.items())}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mix", default="default+recycle+lookup")
    p.add_argument("--nodes", type=int, default=64, help="the fixed size decoded with")
    p.add_argument("--questions", type=int, default=16)
    p.add_argument("--skip", type=int, default=16, help="MT-Bench questions skipped first (the benchmark's)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--out", required=True, help="JSON file for the counts")
    p.add_argument("--records", default=None, help="a pickle of every step's candidates and the answers (offline "
                                                  "replays of other scorings)")
    a = p.parse_args(argv)
    loaded = load_model("default", "default")
    untrained, trained = parse_mix(a.mix)
    if "lookup" not in untrained:
        p.error("--mix: the recorder reads prompt lookup's buffer; include lookup")
    mix = make_members(loaded.base, untrained, loaded.heads if trained else None, a.nodes)
    recording = RecordingMix(list(mix.drafters), mix.specs, mix.names, mix.config)
    model = ShardedModel(loaded.base, recording, MeshConfig())
    settings = BatchSettings(batch_size=1, max_new_tokens=a.max_new_tokens, tree=fixed_size(mix, a.nodes),
                             eos_ids=tuple(loaded.eos_ids), pad_id=loaded.pad_id, engine="batches", bucket=512)
    questions = mtbench_questions(a.skip + a.questions)[a.skip:]
    all_trials, steps, tokens, kept = [], 0, 0, []
    for i, prompt in enumerate(loaded.encode_chat([q.first_turn for q in questions])):
        RECORDS.clear()
        result = generate_batch(model, [prompt], settings, progress=False).results[0]
        sequence = list(prompt) + list(result.token_ids)
        all_trials += trials(RECORDS, sequence, mix.names)
        kept.append((list(RECORDS), sequence))
        steps, tokens = steps + result.steps, tokens + result.new_tokens
        print(f"prompt {i + 1}/{len(questions)}: {result.new_tokens / max(result.steps, 1):.2f} tokens/step, "
              f"{len(RECORDS)} steps recorded", file=sys.stderr, flush=True)
    out = {"command": "python -m medusa_jax.bench.merge_calibration " + " ".join(argv or sys.argv[1:]),
           "machine": machine_description(), "members": list(mix.names), "prob_edges": list(PROB_EDGES),
           "tokens_per_step": round(tokens / max(steps, 1), 3), **tables(all_trials, mix.names)}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out) + "\n")
    if a.records:
        with open(a.records, "wb") as f:
            pickle.dump({"names": mix.names, "prompts": kept}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
