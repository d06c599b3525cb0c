"""The README's "Will it fit?" table: compiled memory plans of Llama-3-8B and 70B, Medusa-1/2 training and
Medusa decoding (tree mc_sim_7b_63, batch 1/8/64), for one 8x H100-80G host, one 8x H200 host and a TPU v5e-16
slice. Each row is one compile per mesh (the two GPU hosts share the 8-device plan); a plan whose parameters,
optimiser state, KV cache and gradients alone (`plan_estimate.lower_bound`, exact) exceed every device it is
planned for is not compiled ("> N GiB" in the table). Results are saved to OUT/plans.json as they come; --resume continues an interrupted run.

Example:
  nice -n 15 python scripts/plan_table.py --out artifacts/plan_table
Writes OUT/plans.json and OUT/table.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output folder for plans.json and table.md")
    p.add_argument("--models", default="llama3-8b,llama3-70b", help="comma-separated presets (default: %(default)s)")
    p.add_argument("--headroom", type=float, default=0.1, help="fraction of memory kept free (default: %(default)s)")
    p.add_argument("--resume", action="store_true", help="keep the plans already in OUT/plans.json")
    p.add_argument("--saved-only", action="store_true",
                   help="compile nothing: the table from OUT/plans.json (and the exact lower bounds), missing plans shown "
                        "as 'not planned'")
    args = p.parse_args(argv)
    from medusa_jax.presets import PRESETS

    models = tuple(m for m in args.models.split(",") if m)
    unknown = [m for m in models if m not in PRESETS]
    if unknown or not models:
        print(f"error: unknown presets {unknown}; choose from {', '.join(PRESETS)}", file=sys.stderr)
        return 2
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=16").strip()
    import jax

    jax.config.update("jax_platforms", "cpu")
    from medusa_jax.atomic import write_text_atomic
    from medusa_jax.bench.plan import DEVICES
    from medusa_jax.bench.plan_estimate import estimate, lower_bound
    from medusa_jax.bench.plan_report import markdown_table, plan_row, row_config, table_rows

    columns = {"8x H100-80G": ("gpu", DEVICES["h100-80g"]), "8x H200-141G": ("gpu", DEVICES["h200-141g"]),
               "TPU v5e-16 (16 x 16 GB)": ("v5e", DEVICES["tpu-v5e-16g"])}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    store = out / "plans.json"
    saved = json.loads(store.read_text()) if (args.resume or args.saved_only) and store.exists() else {}
    rows = table_rows(models)
    # cheapest compiles first (decode, then Medusa-1, then Medusa-2), so an interrupted run has the most rows
    order = sorted(((r, k) for r in rows for k in ("gpu", "v5e")),
                   key=lambda rk: (rk[0].config["job"] == "train", rk[0].config.get("medusa2", False)))
    for row, mesh_key in order:
        key = _key(row, mesh_key)
        if key in saved:
            continue
        start = time.perf_counter()
        least = lower_bound(row_config(row, mesh_key))
        largest = max(capacity for key_, capacity in columns.values() if key_ == mesh_key)
        if least > largest * (1 - args.headroom):  # exact: no compile needed to say no
            saved[key] = {"arguments_only": True, "device_bytes": least}
        elif args.saved_only:
            continue
        else:
            try:
                saved[key] = plan_row(row, mesh_key).to_dict()
            except ValueError as e:  # a mesh that does not divide the model
                saved[key] = {"error": str(e)}
        print(f"{key}: {saved[key].get('device_bytes', 0) / 2**30:.1f} GiB ({time.perf_counter() - start:.0f} s)",
              flush=True)
        write_text_atomic(store, json.dumps(saved, indent=1))
    results = []
    for row in rows:
        plans = {}
        for mesh_key in ("gpu", "v5e"):
            entry = saved.get(_key(row, mesh_key))
            if entry is not None and "error" not in entry:
                plans[mesh_key] = _Saved(entry, estimate(row_config(row, mesh_key)).total)
        results.append((row, plans))
    table = markdown_table(results, columns, args.headroom)
    write_text_atomic(out / "table.md", table + "\n")
    print(table)
    return 0


def _key(row, mesh_key: str) -> str:
    return f"{row.model} | {row.job} | {row.meshes[mesh_key]}"


class _Saved:
    """A plan read back from plans.json: what the table needs of a CompiledPlan."""

    def __init__(self, d: dict, analytic: int):
        self.analytic_bytes = analytic
        self.arguments_only = d.get("arguments_only", False)
        if self.arguments_only:
            self.device_bytes = d["device_bytes"]
        else:  # recomputed as CompiledPlan.device_bytes does, from the saved parts
            resident = max(d["argument_bytes"], sum(d["arguments"].values()))
            self.device_bytes = resident + d["output_bytes"] - d["alias_bytes"] + d["device_temp_bytes"]


if __name__ == "__main__":
    sys.exit(main())
