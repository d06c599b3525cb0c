"""The drafter and tree a generation engine decodes with, from a --heads value (scripts/serve.py): a heads folder with
its own tree choice or --tree, Token Recycling on a template, or mixed drafts (`mixed_decoding.build_mix`, step
costs at the engine's row count); docs/serving.md, "Drafting" and "Shared drafter state"."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from medusa_jax.model.backbone import CausalLM
from medusa_jax.heads import recycle
from medusa_jax.heads.load import load_heads
from medusa_jax.trees.trees_file import trees_of
from medusa_jax.trees.policy.choose import choose_tree
from medusa_jax.trees.tree import load_tree
from medusa_jax.inference.mixed_decoding import build_mix, is_mix, parse_mix


@dataclasses.dataclass(frozen=True)
class ServedDrafter:
    heads: Any  # None: plain decoding
    tree: Any  # TreeBuffers / DynamicTree / DraftSizes, None with no heads
    note: str  # how it was chosen, one line for the log


def served_drafter(base: CausalLM, heads: str | None, heads_dir: Path | None, tree: str | None, rows: int,
                   dtype: str = "float32") -> ServedDrafter:
    """The drafter of a checked --heads value (heads_dir: its folder, or a mix's trained heads' folder, None for
    none) and --tree; `rows` the engine's rows (a heads folder's tree choice and a mix's step costs are per batch
    size)."""
    if heads is None:
        return ServedDrafter(None, None, "plain decoding")
    if is_mix(heads):
        untrained, _ = parse_mix(heads)
        trained = None if heads_dir is None else load_heads(heads_dir, base_config=base.config, base=base,
                                                            dtype=dtype)
        mix, sizes = build_mix(base, untrained, trained, batch=rows)
        return ServedDrafter(mix, sizes, f"mixed drafts {heads} ({sizes.name}: the size chosen per step from "
                                         f"costs {sizes.cost_note} at {rows} rows)")
    if heads == recycle.HEAD_TYPE:
        drafter = recycle.recycle_drafter(base)
        top_k = drafter.config.top_k
        template = tree is None or tree in recycle.TEMPLATES
        chosen = recycle.template_tree(tree or recycle.DEFAULT_TEMPLATE, top_k) if template else \
            load_tree(tree, num_heads=recycle.DEFAULT_MAX_DEPTH, max_top_k=top_k)
        return ServedDrafter(drafter, chosen, f"Token Recycling on {chosen.name} (table: {drafter.origin}; one "
                                              f"table for all rows, warm across requests)")
    loaded = load_heads(heads_dir, base_config=base.config, base=base, dtype=dtype)
    chosen = choose_tree(loaded.config, trees_of(loaded), rows, tree)
    if chosen.tree is None:
        return ServedDrafter(None, None, chosen.note)
    return ServedDrafter(loaded, chosen.tree, chosen.note)
