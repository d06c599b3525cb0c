"""Where the time of a jitted call goes: XLA op events under `jax.profiler.trace`, summed by op kind (on CPU,
threads add up, so the total can exceed the wall clock)."""

from __future__ import annotations

import collections
import re
import tempfile
from pathlib import Path
from typing import Callable

import jax
from jax.profiler import ProfileData

_SKIP = ("ThunkExecutor", "end: ")


def op_times(fn: Callable[[], object], per: int = 1, top: int = 12) -> list[dict]:
    """Runs fn() once under the profiler; returns the `top` op kinds by time, each with calls and ms divided
    by `per` (e.g. the number of decode steps)."""
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp):
            jax.block_until_ready(fn())
        planes = sorted(Path(tmp).rglob("*.xplane.pb"))
        if not planes:
            raise RuntimeError("the profiler wrote no trace")
        data = ProfileData.from_file(str(planes[-1]))
    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for plane in data.planes:
        for line in plane.lines:
            if "Eigen" not in line.name and "XLA" not in line.name:
                continue
            for event in line.events:
                if any(event.name.startswith(s) for s in _SKIP) or event.name.startswith("$"):
                    continue
                kind = re.sub(r"\.\d+$", "", event.name)
                totals[kind][0] += 1
                totals[kind][1] += event.duration_ns / 1e6
    rows = sorted(totals.items(), key=lambda kv: -kv[1][1])[:top]
    return [{"op": k, "calls_per_step": n / per, "ms_per_step": ms / per} for k, (n, ms) in rows]
