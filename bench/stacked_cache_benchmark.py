"""SmolLM2 decoding on this CPU, per-layer vs stacked layers and KV cache, interleaved in one process, one JSON
line per (round, case, form); cases and command: docs/modules.md."""

from __future__ import annotations

import argparse
import json

from medusa_jax.bench.bench_inputs import fastest
from medusa_jax.bench.scan_benchmark import demo_model_and_heads
from medusa_jax.demo_model import resolve_model_dir
from medusa_jax.hf.load import load_pretrained
from medusa_jax.inference.api import generate, generate_medusa
from medusa_jax.model.config import LayerExecution


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per case (the fastest counts)")
    p.add_argument("--new", type=int, default=32, help="new tokens per prompt (default: %(default)s)")
    args = p.parse_args()
    base, heads = demo_model_and_heads()
    # the stacked form as users get it: read straight into the stacked layout (generate.py --scan-layers)
    forms = {"per-layer": base, "stacked": load_pretrained(resolve_model_dir("default"),
                                                           layers=LayerExecution(scan=True))}
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8] * 4] * 4
    cases = {"plain": lambda m: generate(m, prompts, max_new_tokens=args.new),
             "medusa": lambda m: generate_medusa(m, heads, prompts, tree="mc_sim_7b_16", max_new_tokens=args.new)}
    for rnd in range(args.rounds):
        for case, call in cases.items():
            for form, model in forms.items():
                results, seconds = fastest(lambda: call(model), args.repeats, warm_up=rnd == 0)
                tokens = sum(r.new_tokens for r in results)
                print(json.dumps({"round": rnd + 1, "case": case, "form": form, "seconds": round(seconds, 4),
                                  "new_tokens": tokens, "tokens_per_s": round(tokens / seconds, 2)}), flush=True)


if __name__ == "__main__":
    main()
