"""Compiled per-device training plans of Llama-3-8B and 70B with the layers stacked and scanned, before
`--loss-chunk` (issue 41; the 'before' column of docs/planning.md); commands: docs/modules.md."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=16").strip()

from medusa_jax.atomic import write_text_atomic  # noqa: E402
from medusa_jax.model.config import LayerExecution  # noqa: E402
from medusa_jax.model.sharding import MeshConfig  # noqa: E402
from medusa_jax.training.memory_plan import estimate_per_device, lower_bound  # noqa: E402
from medusa_jax.training.plan import DEVICES, PlanConfig, compile_plan, model_config  # noqa: E402

SCANNED = LayerExecution(scan=True, remat="full")
# (model, Medusa-2, weight dtype, mesh): the table's training rows, and the bf16-weight rows the recipes use
# (the four targets first)
TARGETS = [("llama3-8b", True, "float32", "fsdp=8"), ("llama3-70b", False, "bfloat16", "fsdp=8"),
           ("llama3-70b", True, "bfloat16", "fsdp=16"), ("llama3-70b", False, "float32", "fsdp=8")]
ROWS = TARGETS + [(m, m2, "float32", mesh) for m in ("llama3-8b", "llama3-70b") for m2 in (False, True)
                  for mesh in ("fsdp=8", "fsdp=16") if (m, m2, "float32", mesh) not in TARGETS]


def key(model: str, medusa2: bool, dtype: str, mesh: str) -> str:
    return f"{model} | Medusa-{2 if medusa2 else 1} | {dtype} weights | {mesh}"


def config_of(model: str, medusa2: bool, dtype: str, mesh: str) -> PlanConfig:
    return PlanConfig(model_config(model, dtype), MeshConfig.parse(mesh), job="train", batch=16, seq=2048,
                      medusa2=medusa2, layers=SCANNED)


def table(saved: dict) -> str:
    """Markdown rows: compiled / analytic GiB per device (the analytic recomputed), and the verdicts for an
    H100-80G, an H200-141G and (fsdp=16) a 16 GB v5e chip with 10% headroom."""
    lines = ["| model | job | weights | mesh | compiled / analytic GiB | compiled / analytic | H100-80G | H200-141G "
             "| v5e (16 chips) |", "|---|---|---|---|---|---|---|---|---|"]
    for row in ROWS:
        entry = saved.get(key(*row))
        if entry is None:
            continue
        model, medusa2, dtype, mesh = row
        analytic = estimate_per_device(config_of(*row)).total
        if "device_bytes" in entry:
            used = entry["device_bytes"]
            figures = f"{used / GIB:.1f} / {analytic / GIB:.1f}", f"{used / analytic:.2f}"
        else:
            used = entry["lower_bound_bytes"]
            figures = f"> {used / GIB:.0f} (state alone)", "-"
        verdict = lambda capacity: "fits" if used <= 0.9 * capacity else "**no**"
        v5e = verdict(DEVICES["tpu-v5e-16g"]) if mesh == "fsdp=16" else "-"
        lines.append(f"| {model} | Medusa-{2 if medusa2 else 1} | {dtype} | {mesh} | {figures[0]} | {figures[1]} | "
                     f"{verdict(DEVICES['h100-80g'])} | {verdict(DEVICES['h200-141g'])} | {v5e} |")
    return "\n".join(lines)


GIB = 2**30


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("plans", metavar="PLANS_JSON", help="JSON file of the plans")
    p.add_argument("--resume", action="store_true", help="keep the plans already in PLANS_JSON")
    p.add_argument("--table", action="store_true", help="compile nothing: print the table of the saved plans")
    args = p.parse_args()
    out = Path(args.plans)
    if args.table:
        print(table(json.loads(out.read_text())))
        return 0
    saved = json.loads(out.read_text()) if args.resume and out.exists() else {}
    for model, medusa2, dtype, mesh in ROWS:
        name = key(model, medusa2, dtype, mesh)
        if name in saved:
            continue
        config = config_of(model, medusa2, dtype, mesh)
        start = time.perf_counter()
        estimate = estimate_per_device(config)
        if lower_bound(config) > DEVICES["h200-141g"] * 0.9:  # exact: no compile needed to say no
            entry = {"lower_bound_bytes": lower_bound(config)}
        else:
            plan = compile_plan(config)
            entry = {"device_bytes": plan.device_bytes, "temp_bytes": plan.temp_bytes,
                     "cpu_upcast_bytes": plan.cpu_upcast_bytes, "arguments": plan.arguments,
                     "collectives": [c.__dict__ for c in plan.collectives]}
        entry.update(analytic_bytes=estimate.total, seconds=round(time.perf_counter() - start))
        saved[name] = entry
        print(name, {k: v for k, v in entry.items() if k != "collectives"}, flush=True)
        write_text_atomic(out, json.dumps(saved, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
