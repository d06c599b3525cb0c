"""Mixed drafts from a name: `--heads lookup`, `--heads default+recycle+lookup`, any `+` combination of prompt
lookup, Token Recycling and one set of trained heads (a heads folder, `default`, `default-medusa` or a Hub id),
built into a `heads.mixed.MixedDrafter` and the `DraftSizes` its decode chooses among per step.

Node budgets. A budget B (the most nodes a step verifies) gives the static sizes (0, ..., B) of `sizes_for`; the
trained heads grow a dynamic tree of B nodes (K = the default for B, D = 4), Token Recycling fills its largest
shipped template of at most B nodes (`recycle_template`), and prompt lookup drafts `lookup_for(B)`.
The sizes' costs are measured on this machine at the batch size that decodes (`draft_size.measure_size_costs`).
"""

from __future__ import annotations

from typing import Callable

import jax

from medusa_jax.assets import resolve_heads_dir
from medusa_jax.model.backbone import CausalLM
from medusa_jax.model.sharding import MeshConfig, sharding_for
from medusa_jax.hf.load import load_pretrained
from medusa_jax.heads import recycle, recycle_file
from medusa_jax.heads.load import load_heads
from medusa_jax.heads.draft_merge import DraftSizes
from medusa_jax.heads.lookup import LookupConfig
from medusa_jax.heads.mixed import MixedDrafter, make_mix, template_spec
from medusa_jax.trees.tree import DEFAULT_DYNAMIC_DEPTH, DynamicTree, default_dynamic_top_k
from medusa_jax.inference.draft_size import measure_size_costs
from medusa_jax.inference.sharded import ShardedModel

LOOKUP = "lookup"
RECYCLE = recycle.HEAD_TYPE
UNTRAINED = (LOOKUP, RECYCLE)  # drafters that need no heads folder
DEFAULT_BUDGET = 16


class MixError(ValueError):
    """A --heads mix that names nothing usable (one line for the command line)."""


def is_mix(heads: str | None) -> bool:
    """Whether a --heads value names mixed drafts: a `+` combination, or prompt lookup alone (`--heads recycle`
    alone is Token Recycling on its own static template, scripts/generate.py)."""
    return heads is not None and ("+" in heads or heads == LOOKUP)


def parse_mix(text: str) -> tuple[tuple[str, ...], str | None]:
    """'default+lookup' -> (untrained drafters, the trained heads' location or None). Raises MixError for an empty
    part, a repeated part or two trained heads."""
    parts = text.split("+")
    if any(not p.strip() for p in parts):
        raise MixError(f"{text!r}: a mix is names joined by '+' (e.g. default+lookup), with no empty part")
    if len(set(parts)) != len(parts):
        raise MixError(f"{text!r}: a drafter is named twice")
    trained = [p for p in parts if p not in UNTRAINED]
    if len(trained) > 1:
        raise MixError(f"{text!r}: at most one heads folder in a mix (got {', '.join(trained)}); the drafters that "
                       f"need none are {', '.join(UNTRAINED)}")
    return tuple(p for p in parts if p in UNTRAINED), (trained[0] if trained else None)


def sizes_for(budget: int) -> tuple[int, ...]:
    """The static sizes of a budget: plain, two intermediate sizes and the budget (fewer when it is small)."""
    return tuple(sorted({0, max(1, budget // 8), max(1, budget // 3), budget}))


def lookup_for(budget: int) -> LookupConfig:
    """Prompt lookup within a budget: a chain of up to 10 tokens, one more matched branch per 10 nodes (at most 4)."""
    return LookupConfig(length=min(budget, 10), branches=max(1, min(4, budget // 10)))


def recycle_template(budget: int) -> str:
    """The largest shipped recycling template within a budget (the smallest when none fits)."""
    fitting = [n for n in sorted(int(name.split("_")[1]) for name in recycle.TEMPLATES) if n <= budget]
    return f"recycle_{fitting[-1] if fitting else min(int(n.split('_')[1]) for n in recycle.TEMPLATES)}"


def build_mix(base: CausalLM, untrained: tuple[str, ...], trained_heads, budget: int = DEFAULT_BUDGET, *,
              batch: int = 1, costs: Callable[[tuple[int, ...]], tuple[float, ...]] | None = None,
              recycler=None) -> tuple[MixedDrafter, DraftSizes]:
    """The drafter and the draft sizes of a parsed mix; `costs` (sizes -> relative costs) defaults to measuring
    them here (`measure_size_costs` at `batch`); `recycler` is the Token Recycling drafter to mix (default: a new
    one from `recycle_file.recycle_drafter`, the shipped warm table for SmolLM2)."""
    template = None
    if RECYCLE in untrained:
        recycler = recycler if recycler is not None else recycle_file.recycle_drafter(base)
        tree = recycle.template_tree(recycle_template(budget), recycler.config.top_k)
        template = (recycler, template_spec(tree, recycle.RANK_ACCEPTANCE))
    trained_tree = None
    if trained_heads is not None:
        depth = min(DEFAULT_DYNAMIC_DEPTH, trained_heads.config.num_heads)
        trained_tree = DynamicTree(budget, default_dynamic_top_k(budget, depth), depth)
    mix = make_mix(base.config.hidden_size, base.config.vocab_size, trained=trained_heads, trained_tree=trained_tree,
                   lookup=lookup_for(budget) if LOOKUP in untrained else None, template=template)
    sizes = sizes_for(min(budget, mix.candidates))
    measured = costs(sizes) if costs is not None else measure_size_costs(base, sizes, batch=batch, drafter=mix,
                                                                          depth=mix.depth)
    return mix, DraftSizes(sizes, tuple(measured), depth=mix.depth)


def load_mixed(model_dir, heads: str, mesh: MeshConfig | None = None, dtype: str = "float32", batch: int = 1,
               budget: int = DEFAULT_BUDGET) -> tuple[ShardedModel, DraftSizes]:
    """`sharded.load_sharded` for a --heads mix: the base on its mesh, the mix's trained heads (if any) beside it,
    and the draft sizes with this machine's costs at `batch` rows."""
    untrained, trained = parse_mix(heads)
    mesh = (mesh or MeshConfig()).make_mesh()
    base = load_pretrained(model_dir, dtype=dtype, sharding_for=sharding_for(mesh))
    trained_heads = None
    if trained is not None:
        trained_heads = load_heads(resolve_heads_dir(trained), base_config=base.config,
                                   base=base if jax.process_count() == 1 else None, dtype=dtype)
    mix, sizes = build_mix(base, untrained, trained_heads, budget, batch=batch)
    return ShardedModel(base, mix, mesh), sizes

