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
from medusa_jax.model.sharding import MeshConfig
from medusa_jax.scripts.cli_args import ArgumentParser, mesh_spec
from medusa_jax.bench.load_memory import measure

DEFAULT_RUNS = ("1::sharded", "8:fsdp=8:sharded", "8:data=2,fsdp=4:sharded", "8:data=8:sharded",
                "8:fsdp=8:via_one")


def markdown(rows: list[dict], model: str) -> str:
    lines = [f"Loading {model} (float32): peak host memory, MiB (fresh process per row)", "",
             "| devices | mesh | mode | on devices | max per device | private memory growth (peak RssAnon) "
             "| VmHWM (incl. mapped file) | seconds |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['devices']} | {r['mesh']} | {r['mode']} | {r['on_devices_mib']} | "
                     f"{r['max_per_device_mib']} | {r['anon_growth_mib']} | {r['peak_total_mib']} | {r['seconds']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__)
    options.MODEL.add(p, default="default")
    p.add_argument("--runs", nargs="+", default=list(DEFAULT_RUNS), metavar="DEVICES:MESH:MODE",
                   help="loads to measure: forced CPU device count, mesh spec ('' = one device) and mode "
                        "(sharded | via_one) (default: %(default)s)")
    options.OUT.add(p, default="artifacts/benchmark_loading", more="folder for loading.json and loading.md; the "
                    "committed bench/loading is written only when named here")
    a = p.parse_args(argv)
    runs = []
    for run in a.runs:
        parts = run.split(":")
        if (len(parts) != 3 or not (parts[0].isascii() and parts[0].isdigit()) or int(parts[0]) < 1
                or parts[2] not in ("sharded", "via_one")):
            p.error(f"--runs {run!r}: expected DEVICES:MESH:MODE with DEVICES >= 1 and MODE sharded or via_one, e.g. "
                    f"8:fsdp=8:sharded")
        problem = mesh_spec(parts[1]) if parts[1] else None
        if problem or (parts[1] and MeshConfig.parse(parts[1]).size > int(parts[0])):
            p.error(f"--runs {run!r}: {problem or 'the mesh needs more devices than given'}")
        runs.append(parts)
    try:
        options.out_folder(a)
        folder = str(options.model_arg("--model", a.model, tokenizer=False))
    except (ValueError, OSError) as e:
        return validate.fail(e)

    rows = []
    for parts in runs:
        rows.append(measure(folder, parts[1], int(parts[0]), parts[2]))
        print(json.dumps(rows[-1]), flush=True)
    write_files(a.out, {"loading.json": json.dumps({"model": portable_path(folder), "runs": rows}, indent=1),
                        "loading.md": markdown(rows, Path(folder).name)})
    print(markdown(rows, Path(folder).name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
