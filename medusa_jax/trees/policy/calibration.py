"""Tree choice calibrated on the machine that decodes: step costs measured here once, head accuracy from the heads.

What a tree buys has two halves. How often the heads' guesses are accepted travels with the heads (trees.json's
`built` record: the held-out accuracy table, the greedy node order, the accuracy scale and the speedup margin
that `scripts/build_tree.py` used). What a step costs does not: the shipped batch-1 tree chosen on one 2-core
Xeon decoded slower than plain on a 2-core EPYC (docs/design.md). So the first time the heads' own tree is asked for
(`BatchSettings.tree = HEADS_TREE`) at a batch size on this machine, the plain step and the Medusa step of
prefixes of the greedy order are timed here (`step_cost.measure_step_costs`, seconds, one progress line per
size), cached under `$MEDUSA_JAX_CACHE/calibration/` keyed by machine, backend, JAX version, model, heads and
batch size, and combined with the stored accuracy exactly as build_tree combines them (`pick_for_batch`, shared
by both): the tree with the most predicted tokens per second, or plain decoding when even that one is predicted
under the heads' `min_speedup` x plain. Dynamic trees are weighed too where the record measured them
(`DynamicGain`: what each accepted on the held-out text against the static tree of its size); their steps are
timed in the same rounds.

Modes (`BatchSettings.calibration`, the command lines' `--calibration`): "auto" measures on first use and reads
the cache after; "redo" measures again and replaces the cached entry; "skip" takes the shipped trees.json as
it is. The default is "auto", or `$MEDUSA_JAX_CALIBRATION` when set (the test suite sets "skip").

Calibration needs what it measures to be what decodes: heads whose trees.json carries the accuracy record of
this backend, and a model on one device (a step timed on one device says nothing about a mesh's step, whose
collectives depend on the mesh). Otherwise the shipped choice stands, and the note says why.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Sequence

import jax
import numpy as np
from flax import nnx

from medusa_jax.atomic import write_text_atomic
from medusa_jax.paths import cache_root
from medusa_jax.trees.tree import DynamicTree, TreeBuffers, TreeError, build_tree
from medusa_jax.trees.trees_file import HeadsTrees, resolve_tree
from medusa_jax.trees.policy import step_cost, tree_choice

MODES = ("auto", "redo", "skip")
ENV = "MEDUSA_JAX_CALIBRATION"
FORMAT = "medusa-jax-step-costs-v3"  # v3: YNNPACK kept from 2 rows (backbone.tree_step_compiler_options);
# v2: tree steps compiled without YNNPACK
CONTEXT = 256  # committed tokens in the cache when timing (as build_tree)
REPEATS = 5


def default_mode() -> str:
    """`$MEDUSA_JAX_CALIBRATION` if set (one of MODES), else "auto"."""
    mode = os.environ.get(ENV, "auto")
    if mode not in MODES:
        raise ValueError(f"${ENV} must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


def check_mode(mode: str | None) -> str:
    mode = default_mode() if mode is None else mode
    if mode not in MODES:
        raise ValueError(f"calibration must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


def pick_for_batch(accuracy_mr, costs: step_cost.StepCostTable, max_nodes: int, min_speedup: float,
                   per_sequence_smr=None, dynamic: "Sequence[DynamicGain]" = ()
                   ) -> tuple["tuple[tuple[int, ...], ...] | DynamicTree", dict]:
    """The tree for one batch size from its measured step costs: the tree with the most predicted tokens per
    second among the greedy static trees and the dynamic trees that were measured (`DynamicGain`), or () ("decode
    plainly") when its predicted speedup over a plain step is below min_speedup. Returns (paths or the
    DynamicTree, the record stored for that batch)."""
    # step time cannot fall as the tree grows: fit the measured (noisy) times with a non-decreasing curve
    fitted = tuple(tree_choice.nondecreasing_fit(costs.medusa_seconds))
    cost = tree_choice.StepCost(costs.num_tree_tokens, fitted)
    choice = tree_choice.fastest_greedy_tree(accuracy_mr, cost, min(max_nodes, cost.max_tokens - 1))
    if per_sequence_smr is not None:  # a batch waits for its slowest row: sized on per-sequence predictions
        choice = tree_choice.rescore_for_batch(choice, per_sequence_smr, costs.batch, cost)
    speedup_by_size = [tps * costs.plain_seconds for tps in choice.tokens_per_second]
    best: "tuple[tuple[int, ...], ...] | DynamicTree" = choice.paths
    speedup, tokens_per_step = speedup_by_size[choice.best_num_nodes - 1], choice.predicted_tokens_per_step
    dynamic_records = []
    for gain in dynamic:
        seconds = costs.dynamic_step_seconds(gain.tree)
        if seconds is None or gain.tree.nodes > len(choice.tokens_per_step):
            continue  # not timed here, or larger than the static trees it is predicted from
        predicted = gain.predict(choice.tokens_per_step[gain.tree.nodes - 1])
        dyn_speedup = predicted / seconds * costs.plain_seconds
        dynamic_records.append({"tree": gain.tree.name, "step_seconds": seconds,
                                "predicted_tokens_per_step": predicted, "predicted_speedup_vs_plain": dyn_speedup})
        if dyn_speedup > speedup:
            best, speedup, tokens_per_step = gain.tree, dyn_speedup, predicted
    chosen = best if speedup >= min_speedup else ()
    record = {
        "num_nodes": chosen.nodes if isinstance(chosen, DynamicTree) else len(chosen),
        "best_num_nodes": choice.best_num_nodes,
        "predicted_tokens_per_step": tokens_per_step if chosen else 1.0,
        "predicted_speedup_vs_plain": speedup if chosen else 1.0,
        "best_tree_predicted_speedup": speedup,
        "plain_step_seconds": costs.plain_seconds,
        "step_seconds": {"tree_tokens": list(costs.num_tree_tokens), "measured": list(costs.medusa_seconds),
                         "fitted": list(fitted)},
        "predicted_speedup_by_size": [None if np.isnan(x) else x for x in speedup_by_size],
        "cache_size": costs.cache_size,
    }
    if dynamic_records:
        record["dynamic"] = dynamic_records
        if isinstance(chosen, DynamicTree):
            record["tree"] = chosen.name
    return chosen, record


@dataclasses.dataclass(frozen=True)
class DynamicGain:
    """What a dynamic tree of N nodes accepts against the greedy static tree of N nodes, measured by decoding the
    same held-out prompts with both (build_tree): the tokens accepted per step beyond the bonus token, dynamic
    over static. A prediction for the dynamic tree is the static tree's prediction with its accepted part scaled
    by that ratio, so the static trees' accuracy discount and batch model carry over."""

    tree: DynamicTree
    heldout_tokens_per_step: float
    static_heldout_tokens_per_step: float

    @property
    def accepted_ratio(self) -> float:
        return (self.heldout_tokens_per_step - 1.0) / max(self.static_heldout_tokens_per_step - 1.0, 1e-6)

    def predict(self, static_tokens_per_step: float) -> float:
        return 1.0 + (static_tokens_per_step - 1.0) * self.accepted_ratio

    def to_json(self) -> dict:
        return {**self.tree.to_json(), "heldout_tokens_per_step": self.heldout_tokens_per_step,
                "static_heldout_tokens_per_step": self.static_heldout_tokens_per_step}

    @classmethod
    def from_json(cls, entry: dict) -> "DynamicGain":
        return cls(DynamicTree.from_json({"dynamic": entry["dynamic"]}), float(entry["heldout_tokens_per_step"]),
                   float(entry["static_heldout_tokens_per_step"]))


@dataclasses.dataclass(frozen=True)
class Accuracy:
    """What trees.json's `built` record says about the heads, as tree choice uses it."""

    scaled_mr: np.ndarray  # held-out accuracy x accuracy_scale
    per_sequence_smr: np.ndarray | None
    order: tuple[tuple[int, ...], ...]  # the greedy node order
    min_speedup: float
    tree_tokens: tuple[int, ...]  # tree sizes (tokens, root included) to time
    dynamic: tuple[DynamicGain, ...] = ()  # dynamic trees measured on the held-out text (timed too)

    @classmethod
    def from_built(cls, built: dict) -> "Accuracy | None":
        """None when the record lacks what calibration needs (trees.json written by hand or by an old build)."""
        try:
            scale = float(built.get("accuracy_scale", 1.0))
            scaled = np.asarray(built["head_accuracy"], np.float64) * scale
            per_seq = built.get("head_accuracy_per_sequence")
            per_seq = None if per_seq is None else np.asarray(per_seq, np.float64) * scale
            order = tuple(tuple(int(i) for i in p) for p in built["greedy_order"])
            tokens = tuple(int(t) for t in built.get("timing", {}).get("tree_tokens", ()))
            min_speedup = float(built.get("min_speedup", 1.0))
            dynamic = tuple(DynamicGain.from_json(entry) for entry in built.get("dynamic", ()))
        except (KeyError, TypeError, ValueError, TreeError):
            return None
        tokens = tuple(sorted({t for t in tokens if 2 <= t <= len(order) + 1}))
        if not order or not tokens or scaled.ndim != 2:
            return None
        return cls(scaled, per_seq, order, min_speedup, tokens, tuple(g for g in dynamic if g.tree.nodes <= len(order)))


def cpu_name() -> str:
    """The processor's model name (/proc/cpuinfo), else what `platform` says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_key() -> dict:
    """What a step cost depends on besides the model: processor, device kind and count, backend, JAX."""
    devices = jax.local_devices()
    return {"cpu": cpu_name(), "cpu_count": os.cpu_count(), "backend": jax.default_backend(),
            "device": f"{len(devices)} x {devices[0].device_kind}", "jax": jax.__version__}


def machine_description() -> dict:
    """Where a measurement ran: CPU model and count, JAX backend and version, load average at the time."""
    cpu = cpu_name()
    devices = jax.devices()
    return {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "devices": f"{len(devices)} x {devices[0].device_kind}",
        "load_average_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "python": sys.version.split()[0],
    }


def keyed_cache_file(what: dict, root: Path | None = None) -> Path:
    """The file under `$MEDUSA_JAX_CACHE/calibration/` of a measurement keyed by `what` (JSON-able: the machine,
    the model, the batch size, what was timed): a digest of it names the file."""
    name = hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:20]
    return (root or cache_root()) / "calibration" / f"{name}.json"


def cache_file(machine: dict, model_config, heads_config, batch: int, tree_tokens, *, root: Path | None = None,
               dynamic: Sequence[DynamicTree] = ()) -> Path:
    what = {"machine": machine, "model": repr(model_config), "heads": repr(heads_config), "batch": batch,
            "tree_tokens": list(tree_tokens), "context": CONTEXT}
    if dynamic:
        what["dynamic"] = [t.name for t in dynamic]
    return keyed_cache_file(what, root)


def read_costs(path: Path) -> step_cost.StepCostTable | None:
    """The cached table, or None when absent or unreadable (then it is measured again)."""
    try:
        doc = json.loads(path.read_text())
        if doc.get("format") != FORMAT:
            return None
        c = doc["costs"]
        return step_cost.StepCostTable(int(c["batch"]), int(c["context"]), int(c["cache_size"]),
                                       float(c["plain_seconds"]), tuple(int(t) for t in c["num_tree_tokens"]),
                                       tuple(float(s) for s in c["medusa_seconds"]),
                                       tuple(str(t) for t in c.get("dynamic_trees", ())),
                                       tuple(float(s) for s in c.get("dynamic_seconds", ())))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_costs(path: Path, costs: step_cost.StepCostTable, machine: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps({"format": FORMAT, "machine": machine,
                                        "costs": dataclasses.asdict(costs)}, indent=1) + "\n")


def measure(base, heads, accuracy: Accuracy, batch: int, progress: Callable[[str], None] | None = None
            ) -> step_cost.StepCostTable:
    trees = [build_tree(list(accuracy.order[: t - 1]), name=f"greedy_{t - 1}") for t in accuracy.tree_tokens]
    return step_cost.measure_step_costs(base, heads, trees, batch=batch, context=CONTEXT, repeats=REPEATS,
                                        progress=progress, dynamic=[g.tree for g in accuracy.dynamic])


@dataclasses.dataclass(frozen=True)
class Calibrated:
    tree: TreeBuffers | DynamicTree | None  # None: decode plainly
    record: dict  # pick_for_batch's record (predictions, step seconds)
    note: str
    measured: bool  # False: read from the cache


def calibrated_paths(model, trees: HeadsTrees, backend: str, batch: int, mode: str,
                     progress: Callable[[str], None] | None = print) -> Calibrated | str:
    """The heads' tree for `batch` from step costs of this machine (see the module docstring), or a string
    saying why the shipped choice stands. `model` is an `inference.sharded.ShardedModel` with heads."""
    # the accuracy is the heads', whichever backend's build measured it; the step costs are measured here
    records = [trees.built(b) for b in [backend] + [b for b in trees.backends() if b != backend]]
    accuracy = next((a for a in (Accuracy.from_built(r) for r in records if r) if a is not None), None)
    if accuracy is None:
        return f"no calibration: {trees.origin} has no accuracy record"
    if model.mesh.size > 1:
        return f"no calibration on a mesh of {model.mesh.size} devices (the shipped choice)"
    if not accuracy.dynamic and resolve_tree(trees, backend, batch).dynamic is not None:
        return "no calibration: the shipped dynamic tree stands (its accuracy record prices static trees only)"
    machine = machine_key()
    path = cache_file(machine, model.config, model.heads_config, batch, accuracy.tree_tokens,
                      dynamic=[g.tree for g in accuracy.dynamic])
    costs = None if mode == "redo" else read_costs(path)
    measured = costs is None
    if measured:
        say = progress or (lambda _: None)
        dynamic_names = "".join(f", {g.tree.name}" for g in accuracy.dynamic)
        say(f"calibrating tree choice for this machine at batch {batch} (once; cached in "
            f"$MEDUSA_JAX_CACHE/calibration/{path.name}): timing the plain step and trees of "
            f"{', '.join(str(t - 1) for t in accuracy.tree_tokens)} nodes{dynamic_names}")
        merged = nnx.merge(model.medusa_graphdef, model.medusa_params)
        costs = measure(merged.base, merged.heads, accuracy, batch, progress)
        write_costs(path, costs, machine)
    paths, record = pick_for_batch(accuracy.scaled_mr, costs, len(accuracy.order), accuracy.min_speedup,
                                   accuracy.per_sequence_smr, accuracy.dynamic)
    where = "measured now" if measured else "cached"
    if not paths:
        return Calibrated(None, record, f"plain decoding: calibrated on this machine at batch {batch} ({where}), no "
                          f"tree is predicted to pay (best x{record['best_tree_predicted_speedup']:.2f} < "
                          f"{accuracy.min_speedup})", measured)
    heads = model.heads_config
    tree = paths if isinstance(paths, DynamicTree) else build_tree(
        paths, name=f"calibrated_batch{batch}", num_heads=heads.num_heads, max_top_k=heads.head_vocab_size)
    what = f"dynamic tree {tree.name}" if isinstance(tree, DynamicTree) else f"tree of {len(paths)} nodes"
    return Calibrated(tree, record, f"the heads' {what} calibrated on this machine at batch {batch} ({where}: "
                      f"predicted x{record['predicted_speedup_vs_plain']:.2f} over plain)", measured)
