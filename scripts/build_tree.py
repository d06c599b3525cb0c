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

import sys
from pathlib import Path

from medusa_jax.trees import trees_file
from medusa_jax.paths import command_line
from medusa_jax.inference.loaded_model import load_model
from medusa_jax.trees.search.tree_builder import BuildTreeConfig, build, save_trees
from medusa_jax.scripts import options, validate
from medusa_jax.scripts.cli_args import ArgumentParser, each, in_range, parse_int_list, parse_positive_int_list
from medusa_jax.scripts.options import Option, add_fields, config_from


def main(argv=None) -> int:
    d = BuildTreeConfig()
    p = ArgumentParser(description=__doc__)
    options.MODEL.add(p, required=True)
    options.HEADS.add(p, required=True, more="; the trees go into its trees.json (checked writable first)")
    options.OUT.add(p, more="file: the trees file instead of HEADS/trees.json (e.g. when the heads folder "
                    "is read-only; copy it into the heads folder to use it) (default: HEADS/trees.json)")
    p.add_argument("--batch-sizes", "--batch", type=parse_positive_int_list, default=d.batch_sizes,
                   check=each(in_range(1, 4096)),
                   help="batch sizes to build a tree for, comma-separated: each is timed and gets its own tree "
                        "(or none); decoding at another batch size uses the nearest smaller one (default: %s)"
                        % ",".join(map(str, d.batch_sizes)))
    add_fields(p, d, Option("--accuracy-scale", "multiply each drafted token's held-out acceptance by this (0 < s <= "
                            "1) when sizing and predicting trees: held-out ShareGPT text is easier than most prompts "
                            "(MT-Bench accepted 0.72x of it); 1 trusts the held-out text"),
               Option("--min-speedup", "keep a tree only if its predicted speedup over plain decoding reaches this: a "
                      "margin for timing noise and for heads less independent than the prediction assumes"))
    options.DATA.add(p, more="for the held-out prompts (default: packaged ShareGPT)")
    add_fields(p, d, Option("--heldout", "prompts taken from the END of the data, away from what training reads "
                            "first"),
               Option("--continuation-tokens", "greedy tokens the base model generates per prompt; heads are scored "
                      "on them"),
               Option("--top-k", "ranks measured per head"),
               Option("--max-nodes", "largest tree considered, root excluded"),
               Option("--tree-tokens", "tree sizes T (root included) whose step time is measured, comma-separated; "
                      "sizes in between are interpolated", parse_int_list),
               Option("--dynamic-nodes", "also weigh dynamic trees (EAGLE-2 style) of these node budgets N: the "
                      "held-out prompts are decoded with each and with the static tree of N nodes, and its step is "
                      "timed; the chooser keeps whichever tree, static or dynamic, predicts the most tokens per "
                      "second; '' for none", parse_int_list),
               Option("--context", "committed tokens in the cache when timing"),
               Option("--repeats", "timed calls per size (median)"))
    a = p.parse_args(argv)
    with p.checking():
        config = config_from(BuildTreeConfig, a)
    try:
        inputs = {"--model": options.model_location(a.model), "--data": options.data_arg("--data", a.data)}
        if a.out is not None:
            validate.output_file("--out", a.out, {**inputs, "--heads": options.heads_location(a.heads)})
        heads_dir = options.heads_arg("--heads", a.heads)
        out = Path(a.out) if a.out is not None else heads_dir / trees_file.FILE_NAME
        if a.out is None:
            validate.output_file("--out", out, inputs)  # HEADS/trees.json: the heads folder must be writable
        # an existing file must be valid: its other backends are kept (checked before the slow work)
        existing = trees_file.read_trees_file(out)
        loaded = load_model(options.model_arg("--model", a.model), heads_dir)
        batches, built = build(loaded, config, progress=lambda m: print(m, flush=True))
    except (OSError, ValueError) as e:  # TreeError and DataError are ValueErrors
        return validate.fail(e)
    print("\n".join(save_trees(out, existing, batches, built, command_line("scripts/build_tree.py", argv))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
