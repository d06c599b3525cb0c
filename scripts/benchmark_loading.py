"""Peak host memory of loading a model on 1 vs N forced CPU devices (each load in a fresh process).

Example (the README's figures, SmolLM2-135M-Instruct in float32):
  python scripts/benchmark_loading.py --model default --out bench/loading
Default runs: one device; 8 devices with fsdp=8, data=2,fsdp=4 and data=8 read in place (each device reads
its own slice of the memory-mapped safetensors); fsdp=8 loaded on one device first and then moved (the
naive way, for contrast). Writes OUT/loading.json and OUT/loading.md. See bench/load_memory.py for
what each column measures.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from medusa_jax.paths import portable_path
from medusa_jax.bench.bench_inputs import write_files
from medusa_jax.scripts import options, validate
from medusa_jax.scripts.cli_args import ArgumentParser
from medusa_jax.bench.load_memory import DEFAULT_RUNS, markdown, measure, parse_run


def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__)
    options.MODEL.add(p, default="default")
    p.add_argument("--runs", nargs="+", default=list(DEFAULT_RUNS), metavar="DEVICES:MESH:MODE",
                   help="loads to measure: forced CPU device count, mesh spec ('' = one device) and mode "
                        "(sharded | via_one) (default: %(default)s)")
    options.OUT.add(p, default="artifacts/benchmark_loading", more="folder for loading.json and loading.md; the "
                    "committed bench/loading is written only when named here")
    a = p.parse_args(argv)
    with p.checking():
        runs = [parse_run(run) for run in a.runs]  # its errors name --runs
    try:
        options.out_folder(a)
        folder = str(options.model_arg("--model", a.model, tokenizer=False))
    except (ValueError, OSError) as e:
        return validate.fail(e)

    rows = []
    for devices, mesh, mode in runs:  # each row printed as it comes
        rows.append(measure(folder, mesh, devices, mode))
        print(json.dumps(rows[-1]), flush=True)
    write_files(a.out, {"loading.json": json.dumps({"model": portable_path(folder), "runs": rows}, indent=1),
                        "loading.md": markdown(rows, Path(folder).name)})
    print(markdown(rows, Path(folder).name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
