"""The drafter kinds, registered by name: `HeadsConfig.head_type` or a `--heads` name names a class of DRAFTERS,
which owns its parameters or tables, its decode-loop state and proposal, and answers for itself (class attributes).
The contract of a trained and of a training-free kind: docs/modules.md. A new drafter is one module and one line in
DRAFTERS."""

from __future__ import annotations

from medusa_jax.heads.eagle import EagleDrafter
from medusa_jax.heads.eagle3 import Eagle3Drafter
from medusa_jax.heads.hydra import HydraHeads
from medusa_jax.heads.lookup import LookupDrafter
from medusa_jax.heads.medusa import HeadsBase, MedusaHeads
from medusa_jax.heads.recycle import RecycleDrafter

# kind name -> drafter class (its `head_type` is the name)
DRAFTERS: dict[str, type] = {"medusa": MedusaHeads, "hydra": HydraHeads, "eagle": EagleDrafter,
                             "eagle3": Eagle3Drafter, "recycle": RecycleDrafter, "lookup": LookupDrafter}
assert all(cls.head_type == name for name, cls in DRAFTERS.items()), "a kind registers under its head_type"


def training_free_kinds() -> tuple[str, ...]:
    """The kinds that need no heads folder (recycle, lookup, ...), in registration order."""
    return tuple(name for name, cls in DRAFTERS.items() if not cls.trained)


def drafter_class(kind: str) -> type:
    """The class of drafter kind `kind` (MedusaHeads, RecycleDrafter, ...); a one-line ValueError naming the
    known kinds."""
    if kind not in DRAFTERS:
        raise ValueError(f"unknown drafter kind: head_type must be one of {tuple(DRAFTERS)}, got {kind!r}")
    return DRAFTERS[kind]


def heads_class(kind: str) -> type[HeadsBase]:
    """The class of a trained kind, as a heads folder's or HeadsConfig's `head_type` names it; a one-line
    ValueError naming the trained kinds."""
    if kind not in DRAFTERS or not DRAFTERS[kind].trained:
        raise ValueError(f"head_type must be one of {tuple(k for k, c in DRAFTERS.items() if c.trained)}, got "
                         f"{kind!r}")
    return DRAFTERS[kind]
