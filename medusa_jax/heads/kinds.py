"""The drafter kinds, registered by name: `HeadsConfig.head_type` names a class of DRAFTERS. A kind's class owns its
parameters or tables, its decode-loop state and proposal (init_draft / propose / accepted: the tree step's proposer
contract, inference/medusa.py), what it takes from the base (`complete_config`, `lm_head_modules`), its file
layouts (`folder_fields`, `export_formats`) and, for a kind whose trees are searched, its teacher-forced guesses
(`teacher_forced_top_k`, trees.search.head_accuracy); `heads.medusa.HeadsBase` holds the defaults. Its training loss and data
needs sit one layer up under the same name (`medusa_jax.training.objectives`).

A new drafter is one module and one line in DRAFTERS; a training-free one (Token Recycling, prompt lookup) too,
e.g. `"recycle": RecycleDrafter` (its class keeping the init_draft / propose / accepted contract, `head_type =
"recycle"`, imported from medusa_jax.heads.recycle), and no objective.
"""

from __future__ import annotations

from medusa_jax.heads.eagle import EagleDrafter
from medusa_jax.heads.eagle3 import Eagle3Drafter
from medusa_jax.heads.hydra import HydraHeads
from medusa_jax.heads.medusa import HeadsBase, MedusaHeads

# kind name -> drafter class (its `head_type` is the name); every class takes (config, rngs, token_map=None)
DRAFTERS: dict[str, type[HeadsBase]] = {"medusa": MedusaHeads, "hydra": HydraHeads, "eagle": EagleDrafter,
                                        "eagle3": Eagle3Drafter}
assert all(cls.head_type == name for name, cls in DRAFTERS.items()), "a kind registers under its head_type"


def drafter_class(kind: str) -> type[HeadsBase]:
    """The class of drafter kind `kind` (MedusaHeads, HydraHeads, ...); ValueError naming the known kinds."""
    if kind not in DRAFTERS:
        raise ValueError(f"head_type must be one of {tuple(DRAFTERS)}, got {kind!r}")
    return DRAFTERS[kind]
