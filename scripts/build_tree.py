"""Build a Medusa tree for THIS machine: measure each head's top-k accuracy on held-out text and the Medusa
step time as a function of the tree size, then keep the tree with the most expected tokens per second.

Example:
  python scripts/build_tree.py --model smollm2 --heads default --out medusa_jax/trees/smollm2_cpu.json
The output is a `medusa_choices` JSON that `--tree FILE` of generate.py / benchmark.py loads; it also records
the accuracy table, the step-time curve and the predicted tokens per step.
"""

from __future__ import annotations

import argparse
import sys

from medusa_jax.cli_args import parse_int_list


def main(argv=None) -> int:
    from medusa_jax.inference.tree_builder import BuildTreeConfig

    d = BuildTreeConfig()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="HF model folder, or 'smollm2' for the packaged SmolLM2-135M-Instruct")
    p.add_argument("--heads", required=True, help="heads folder (any layout load_heads reads), or 'default' for "
                                                  "the heads shipped with medusa-jax")
    p.add_argument("--out", required=True, help="tree JSON to write (written to a temp file, then renamed)")
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
    p.add_argument("--batch", type=int, default=d.batch,
                   help="rows per step when timing: build a tree for the batch size you will serve "
                        "(default: %(default)s)")
    p.add_argument("--context", type=int, default=d.context,
                   help="committed tokens in the cache when timing (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=d.repeats, help="timed calls per size (median; default: %(default)s)")
    a = p.parse_args(argv)
    try:
        config = BuildTreeConfig(data=a.data, heldout=a.heldout, continuation_tokens=a.continuation_tokens,
                                 top_k=a.top_k, max_nodes=a.max_nodes, tree_tokens=a.tree_tokens, batch=a.batch,
                                 context=a.context, repeats=a.repeats)
    except ValueError as e:
        p.error(str(e))

    from medusa_jax import tree_search
    from medusa_jax.inference.bench_inputs import load_model
    from medusa_jax.inference.tree_builder import build, summary_lines

    try:
        loaded = load_model(a.model, a.heads)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    document = build(loaded, config, progress=lambda m: print(m, flush=True))
    document["command"] = "python scripts/build_tree.py " + " ".join(sys.argv[1:] if argv is None else argv)
    tree_search.write_json_atomic(a.out, document)
    for line in summary_lines(document):
        print(line)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
