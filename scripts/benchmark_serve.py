"""Load and soak tests of a running medusa-serve (scripts/serve.py) on this machine (loopback only).

Examples:
  python scripts/serve.py --model default --batch-size 16 --context 512 --port 8000 &
  python scripts/benchmark_serve.py --url http://127.0.0.1:8000 --concurrency 1,4,16 --out bench/serve/load.json
  python scripts/benchmark_serve.py --url http://127.0.0.1:8000 --soak-seconds 180 --out bench/serve/soak.json
Load: for each --concurrency C, C asyncio clients each send --requests-per-client streamed chat requests (greedy,
--max-tokens each, prompts from a fixed list) one after the other; reported per level: total tokens/s (all
completion tokens over the level's wall time), p50/p95 time to first token and p50/p95 per-token latency (a
request's time after its first token over its other tokens), and the ratio of tokens/s to the first level's.
Soak: --concurrency's largest C clients for --soak-seconds send a mix (streamed, whole, cancelled after the
first piece, bad requests); it checks that every good request got exactly one complete answer, every bad one a
4xx, no 5xx, and reports the server's resident memory (from /metrics) at the start, once a minute and at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

import httpx

from medusa_jax.atomic import write_text_atomic
from medusa_jax.bench.serve_load import ServeLoadConfig, run
from medusa_jax.paths import command_line
from medusa_jax.scripts import options, validate
from medusa_jax.scripts.cli_args import ArgumentParser, at_least, each, parse_positive_int_list
from medusa_jax.scripts.options import Option, add_fields, config_from


def parse_args(argv=None) -> tuple[argparse.Namespace, ServeLoadConfig]:
    p = ArgumentParser(description=__doc__)
    add_fields(p, ServeLoadConfig(), Option("--url", "the server, on this machine"),
               Option("--concurrency", "concurrent clients of each load level", parse_positive_int_list,
                      each(at_least(1))),
               Option("--requests-per-client", "requests each client sends in a load level", check=at_least(1)),
               Option("--max-tokens", "max_tokens of each request", check=at_least(1)),
               Option("--soak-seconds", "run the soak mix this long instead of the load levels (0: no soak)",
                      check=at_least(0.0)),
               Option("--timeout", "seconds one request may take at most", check=at_least(1.0)))
    options.OUT.add(p, required=True, more="JSON file for the results (written atomically)")
    a = p.parse_args(argv)
    with p.checking():
        config = config_from(ServeLoadConfig, a)
        validate.output_file("--out", a.out)
    return a, config


def main(argv=None) -> int:
    a, config = parse_args(argv)
    try:
        results = asyncio.run(run(config))
    except httpx.HTTPError as e:
        return validate.fail(OSError(f"--url {a.url}: {type(e).__name__}: {e}; is medusa-serve running there?"))
    results["command"] = command_line("scripts/benchmark_serve.py", argv)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(a.out, json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
