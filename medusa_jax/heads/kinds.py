"""The drafter kinds, registered by name: the one table that `HeadsConfig.head_type` (and a heads folder's
config.json) names a drafter class in.

A drafter kind is one class that owns everything about that kind (`heads.medusa.HeadsBase` says what and holds
the defaults):
  - its parameters or tables (an nnx.Module built as `cls(config, rngs, token_map=None)`);
  - the state it carries through the decode loop and its proposal: `init_draft` / `propose` / `accepted`, the
    proposer contract of the tree step (inference/medusa.py);
  - its file layouts: `folder_fields()` (the config.json fields other tools read, heads.folder) and
    `export_formats` (the serving layouts it exports to: heads.export, heads.eagle_layout);
  - what it takes from the base model when made fresh (`complete_config`) and which of its modules start from
    the base lm_head (`lm_head_modules`).
Its training loss and data needs sit one layer up, keyed by the same name: `medusa_jax.training.objectives`
(heads never import training). A kind with no objective there is decoded but not trained.

A new drafter is one module and one line in DRAFTERS. A drafter that needs no training (Token Recycling,
prompt lookup) registers the same way, e.g. `"recycle": RecycleDrafter` (with
`from medusa_jax.heads.recycle import RecycleDrafter` above), its class keeping the init_draft / propose /
accepted contract and `head_type = "recycle"`.
"""

from __future__ import annotations

from medusa_jax.heads.eagle import EagleDrafter
from medusa_jax.heads.hydra import HydraHeads
from medusa_jax.heads.medusa import HeadsBase, MedusaHeads

# kind name -> drafter class (its `head_type` is the name); every class takes (config, rngs, token_map=None)
DRAFTERS: dict[str, type[HeadsBase]] = {"medusa": MedusaHeads, "hydra": HydraHeads, "eagle": EagleDrafter}
assert all(cls.head_type == name for name, cls in DRAFTERS.items()), "a kind registers under its head_type"


def drafter_class(kind: str) -> type[HeadsBase]:
    """The class of drafter kind `kind` (MedusaHeads, HydraHeads, ...); ValueError naming the known kinds."""
    if kind not in DRAFTERS:
        raise ValueError(f"head_type must be one of {tuple(DRAFTERS)}, got {kind!r}")
    return DRAFTERS[kind]
