"""Text for memory plans (scripts/plan.py) and the README's "Will it fit?" table (scripts/plan.py table)."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Callable

from medusa_jax.atomic import write_text_atomic
from medusa_jax.model.config import LayerExecution
from medusa_jax.model.sharding import MeshConfig
from medusa_jax.training.memory_plan import DeviceEstimate, estimate_per_device, lower_bound
from medusa_jax.training.plan import DEVICES, CompiledPlan, PlanConfig, compile_plan, fits, model_config

GIB = 2**30
POD_LAYERS = LayerExecution(scan=True, remat="full")  # train_heads.py --scan-layers --remat full (docs/planning.md)


def _gib(n: float) -> str:
    return f"{n / GIB:8.2f} GiB" if abs(n) >= GIB or n == 0 else f"{n / 2**20:8.2f} MiB"


def warnings(plan: CompiledPlan) -> list[str]:
    """Layout problems a plan shows: weights gathered in the decode loop, optimiser state on every device."""
    out = [f"weight all-gathered inside the decode loop: {shape}" for shape in plan.invariant_gathers]
    opt = plan.arguments.get("optimizer", 0)
    if opt and plan.replicated_optimizer_bytes > 0.01 * opt:
        out.append(f"{plan.replicated_optimizer_bytes / GIB:.2f} GiB of optimiser state is replicated on every "
                   f"device")
    return out


def _layers_text(c: PlanConfig) -> str:
    if c.job == "decode":
        return "stacked layers over a stacked KV cache" if c.layers.scan else "layers and KV cache per layer"
    return (f"layers {'scanned' if c.layers.scan else 'unrolled'}, remat {c.layers.remat}, attention "
            f"{c.layers.attention}")


def describe(plan: CompiledPlan, est: DeviceEstimate, device: str, capacity: int, headroom: float,
             largest: int | None = None) -> str:
    c = plan.config
    head = (f"{c.job} plan: {c.model.model_type} {c.model.num_layers} layers, hidden {c.model.hidden_size}, "
            f"{c.num_heads} Medusa heads ({c.lm_head} lm_head){', Medusa-2' if c.medusa2 else ''}; mesh "
            f"data={c.mesh.data} fsdp={c.mesh.fsdp} tensor={c.mesh.tensor}; batch {c.batch}, "
            + (f"rows of {c.seq} tokens, weights {c.model.dtype}, compute {c.compute_dtype}" if c.job == "train" else
               f"prompt {c.seq}, cache {c.cache} slots, tree {c.tree} ({c.tree_tokens} nodes), {c.model.dtype}")
            + f"; {_layers_text(c)}")
    lines = [head, "per device                compiled        analytic"]
    for name, analytic in (("params", est.params), ("optimizer", est.optimizer), ("kv_cache", est.kv_cache)):
        lines.append(f"  {name:<22}{_gib(plan.arguments.get(name, 0))}  {_gib(analytic)}")
    lines += [f"  {'batch inputs':<22}{_gib(plan.arguments.get('batch', 0))}",
              f"  {'arguments (XLA)':<22}{_gib(plan.argument_bytes)}",
              f"  {'outputs not donated':<22}{_gib(plan.output_bytes - plan.alias_bytes)}",
              f"  {'temporaries':<22}{_gib(plan.device_temp_bytes)}  {_gib(est.activations)}",
              f"  {'total':<22}{_gib(plan.device_bytes)}  {_gib(est.total)}"]
    if plan.cpu_upcast_bytes or plan.cpu_loop_upcast_bytes:
        lines.append(f"  (the CPU compile also held {plan.cpu_upcast_bytes / GIB:.2f} GiB (+ "
                     f"{plan.cpu_loop_upcast_bytes / GIB:.2f} GiB inside loops) of float32 weight copies that GPU/TPU "
                     f"compilers do not make; excluded above)")
    where = "one verify step (the decode loop body)" if c.job == "decode" else "one train step"
    lines.append(f"collectives per {where}:")
    lines += [f"  {k.kind:<20}{k.count:5d} x  {k.bytes / 2**20:10.1f} MiB" for k in plan.collectives] or ["  none"]
    if plan.once_collectives:
        lines.append("collectives once per batch (prefill):")
        lines += [f"  {k.kind:<20}{k.count:5d} x  {k.bytes / 2**20:10.1f} MiB" for k in plan.once_collectives]
    verdict = "fits" if fits(plan, capacity, headroom) else "does NOT fit"
    lines.append(f"{device}: {capacity / GIB:.1f} GiB per device, {headroom:.0%} headroom -> {verdict} "
                 f"({plan.device_bytes / capacity:.0%} used)")
    if largest is not None:
        unit = f" (x {c.cache} cache slots = {largest * c.cache} tokens)" if c.job == "decode" else f" x {c.seq} tokens"
        lines.append(f"largest batch that fits: {largest}{unit}")
    lines += [f"WARNING: {w}" for w in warnings(plan)]
    return "\n".join(lines)


# ---- the README table ------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class TableRow:
    model: str
    job: str  # e.g. "train Medusa-1", "decode batch 8"
    config: dict  # PlanConfig fields besides model and mesh
    meshes: dict  # {"8 GPUs": "fsdp=8", "v5e-16": "fsdp=16"}


def table_rows(models=("llama3-8b", "llama3-70b"), train_seq: int = 2048, train_batch: int = 16,
               prompt: int = 1024, cache: int = 2048) -> list[TableRow]:
    rows = []
    for model in models:
        for medusa2 in (False, True):
            rows.append(TableRow(model, f"train Medusa-{2 if medusa2 else 1}, {train_batch} x {train_seq} tokens",
                                 dict(job="train", batch=train_batch, seq=train_seq, medusa2=medusa2,
                                      dtype="float32", layers=POD_LAYERS),
                                 {"gpu": "fsdp=8", "v5e": "fsdp=16"}))
        for batch in (1, 8, 64):
            rows.append(TableRow(model, f"decode batch {batch}, cache {cache}",
                                 dict(job="decode", batch=batch, seq=prompt, cache=cache, dtype="bfloat16"),
                                 {"gpu": "tensor=8", "v5e": "tensor=8" if batch == 1 else "data=2,tensor=8"}))
    return rows


def row_config(row: TableRow, mesh_key: str) -> PlanConfig:
    settings = dict(row.config)
    dtype = settings.pop("dtype")
    return PlanConfig(model_config(row.model, dtype), MeshConfig.parse(row.meshes[mesh_key]), **settings)


def markdown_table(results: list[tuple[TableRow, dict[str, CompiledPlan | None]]], devices: dict[str, tuple],
                   headroom: float) -> str:
    """devices: column name -> (mesh key, capacity bytes). Plans need `device_bytes` and `analytic_bytes`
    (or `arguments_only`: a lower bound). Cells: compiled / analytic GiB per device (mesh): verdict."""
    head = "| model | job | " + " | ".join(devices) + " |"
    lines = [head, "|" + "---|" * (2 + len(devices))]
    for row, plans in results:
        cells = []
        for mesh_key, capacity in devices.values():
            plan = plans.get(mesh_key)
            if plan is None:
                cells.append("not planned")
                continue
            verdict = "fits" if fits(plan, capacity, headroom) else "**no**"
            if getattr(plan, "arguments_only", False) and verdict == "fits":
                cells.append("not planned")  # a lower bound proves only that a plan does not fit
            elif getattr(plan, "arguments_only", False):
                cells.append(f"> {plan.device_bytes / GIB:.0f} ({row.meshes[mesh_key]}): {verdict}")
            else:
                cells.append(f"{plan.device_bytes / GIB:.1f} / {plan.analytic_bytes / GIB:.1f} "
                             f"({row.meshes[mesh_key]}): {verdict}")
        lines.append(f"| {row.model} | {row.job} | " + " | ".join(cells) + " |")
    return "\n".join(lines)



TABLE_COLUMNS = {"8x H100-80G": ("gpu", DEVICES["h100-80g"]), "8x H200-141G": ("gpu", DEVICES["h200-141g"]),
                 "TPU v5e-16 (16 x 16 GB)": ("v5e", DEVICES["tpu-v5e-16g"])}


def build_table(models: tuple[str, ...], out: str | Path, headroom: float, resume: bool = False,
                saved_only: bool = False, log: Callable[[str], None] = print) -> str:
    """Compiles the table's plans (one per row and mesh; the GPU hosts share the 8-device plan), saving each to
    OUT/plans.json as it comes; a plan whose lower bound already exceeds every device it is planned for is not
    compiled. `resume` keeps the plans already saved; `saved_only` compiles nothing. Writes OUT/table.md and
    returns the table. Needs 16 host devices (XLA_FLAGS set before JAX starts)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    store = out / "plans.json"
    saved = json.loads(store.read_text()) if (resume or saved_only) and store.exists() else {}
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
        largest = max(capacity for key_, capacity in TABLE_COLUMNS.values() if key_ == mesh_key)
        if least > largest * (1 - headroom):  # exact: no compile needed to say no
            saved[key] = {"arguments_only": True, "device_bytes": least}
        elif saved_only:
            continue
        else:
            try:
                saved[key] = compile_plan(row_config(row, mesh_key)).to_dict()
            except ValueError as e:  # a mesh that does not divide the model
                saved[key] = {"error": str(e)}
        log(f"{key}: {saved[key].get('device_bytes', 0) / GIB:.1f} GiB ({time.perf_counter() - start:.0f} s)")
        write_text_atomic(store, json.dumps(saved, indent=1))
    results = []
    for row in rows:
        plans = {}
        for mesh_key in ("gpu", "v5e"):
            entry = saved.get(_key(row, mesh_key))
            if entry is not None and "error" not in entry:
                plans[mesh_key] = _Saved(entry, estimate_per_device(row_config(row, mesh_key)).total)
        results.append((row, plans))
    table = markdown_table(results, TABLE_COLUMNS, headroom)
    write_text_atomic(out / "table.md", table + "\n")
    return table


def _key(row: TableRow, mesh_key: str) -> str:
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
