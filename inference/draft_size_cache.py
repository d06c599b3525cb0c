"""The draft sizes' step costs of a mix, measured once per machine and cached (as the heads' tree calibrations are).

`draft_size.measure_span_costs` times the real mixed step of every draft size against a plain step on this machine,
over a cache of each span of `draft_size.SPAN_CONTEXTS` (up to `draft_size.TimingBudget.seconds` of timing plus a
compilation per size and span). What it measures depends on the
machine, the model, the batch size, the sizes and the drafters of the mix, so those key a file under
`$MEDUSA_JAX_CACHE/calibration/` (`trees.policy.calibration.keyed_cache_file`, beside the tree calibrations) and a
second build with the same key reads it instead of timing again.

Modes, as tree calibration's (`--calibration`, `$MEDUSA_JAX_CALIBRATION`): "auto" reads the cache and measures on
a miss, "redo" measures again and replaces the entry (after a code or load change), "skip" times nothing and takes
`draft_size.default_costs` (a 2-core CPU's), as the tree calibration's skip takes the shipped trees.json; it never
reads or writes the cache (the test suite's default: no test times steps it does not check, or fills the user's
cache).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Callable, Sequence

from medusa_jax.atomic import write_text_atomic
from medusa_jax.model.backbone import CausalLM
from medusa_jax.heads.draft_merge import SpanCosts
from medusa_jax.heads.mixed import MixedDrafter, TemplateSpec
from medusa_jax.heads.recycle_file import model_fingerprint
from medusa_jax.trees.policy.calibration import check_mode, keyed_cache_file, machine_key
from medusa_jax.inference import draft_size

FORMAT = "medusa-jax-draft-size-costs-v6"  # v6: timed at several spans (`draft_size.SPAN_CONTEXTS`);
# v5: YNNPACK kept from 2 rows (backbone.tree_step_compiler_options); v4: steps compiled without YNNPACK;
# v3: per-round ratios until stable (v2: 7 rounds' medians, v1: the pieces)


def mix_key(mix: MixedDrafter) -> list[list[str]]:
    """What the drafting cost depends on: each member's kind and what it drafts (its tree, template or size)."""
    out = []
    for name, drafter, spec in zip(mix.names, mix.drafters, mix.specs):
        if isinstance(spec, TemplateSpec):
            what = f"template {spec.tree.name}"
        elif spec is not None:
            what = f"dynamic tree {spec.name}"
        else:
            what = f"{drafter.num_nodes} nodes, depth {drafter.depth}"
        out.append([name, what])
    return out


def cost_file(base: CausalLM, mix: MixedDrafter, sizes: Sequence[int], batch: int,
              root: Path | None = None) -> Path:
    what = {"format": FORMAT, "machine": machine_key(), "model": repr(base.config),
            "model_fingerprint": model_fingerprint(base), "batch": batch, "sizes": list(sizes), "mix": mix_key(mix),
            "trained": repr(mix.config)}
    return keyed_cache_file(what, root)


def read_costs(path: Path, sizes: Sequence[int]) -> SpanCosts | None:
    """The cached costs, or None when absent, unreadable or not of these sizes (then they are measured)."""
    try:
        doc = json.loads(path.read_text())
        if doc.get("format") != FORMAT or list(doc["sizes"]) != list(sizes):
            return None
        costs = SpanCosts(tuple(int(n) for n in doc["spans"]),
                          tuple(tuple(float(c) for c in row) for row in doc["costs"]))
        return costs if len(costs.costs[0]) == len(sizes) else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def size_costs(base: CausalLM, mix: MixedDrafter, sizes: Sequence[int], *, batch: int = 1,
               mode: str | None = None, progress: Callable[[str], None] | None = None,
               root: Path | None = None) -> tuple[SpanCosts, str]:
    """(the costs of `sizes` for `mix` at `batch` on this machine by attention span, where they came from:
    "cached", "measured now (cached in ...)" or "default (timing skipped)", one span then); `mode` as the module
    docstring (None: $MEDUSA_JAX_CALIBRATION or auto); `progress` gets one line before a measurement (default:
    stderr)."""
    mode = check_mode(mode)
    if mode == "skip":
        return SpanCosts((draft_size.SPAN_CONTEXTS[0] + max(sizes) + 2 + mix.depth,),
                         (draft_size.default_costs(sizes),)), "default (timing skipped)"
    path = cost_file(base, mix, sizes, batch, root)
    if mode == "auto":
        cached = read_costs(path, sizes)
        if cached is not None:
            return cached, "cached"
    say = progress or (lambda line: print(line, file=sys.stderr, flush=True))
    say(f"timing the draft sizes {', '.join(map(str, sizes))} of {'+'.join(mix.names)} at batch {batch} on this "
        f"machine (once; cached in $MEDUSA_JAX_CACHE/calibration/{path.name})")
    costs = draft_size.measure_span_costs(base, mix, sizes, batch=batch, depth=mix.depth)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps({"format": FORMAT, "machine": machine_key(), "batch": batch,
                                        "mix": mix_key(mix), "sizes": list(sizes), "spans": list(costs.spans),
                                        "costs": [list(row) for row in costs.costs]}, indent=1) + "\n")
    return costs, f"measured now (cached in $MEDUSA_JAX_CACHE/calibration/{path.name})"
