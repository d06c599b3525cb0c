"""Mixed drafts from a name: `--heads lookup`, `--heads default+recycle+lookup`, any `+` combination of the
training-free drafter kinds (`heads.kinds`: prompt lookup, Token Recycling, ...) and one set of trained heads (a
heads folder, `default`, `default-medusa` or a Hub id), built into a `heads.mixed.MixedDrafter` and the
`DraftSizes` its decode chooses among per step.

Node budgets. A budget B (the most nodes a step verifies) gives the static sizes (0, ..., B) of `sizes_for`; the
trained heads grow a dynamic tree of B nodes (K = the default for B, D = 4), and each training-free kind joins as
its `mix_member(base, B)` says (Token Recycling fills its largest shipped template of at most B nodes, prompt
lookup drafts chains sized by B). The sizes' costs are measured on this machine at the batch size that decodes,
over two cache sizes (`draft_size.measure_span_costs`: each step prices its sizes at the slots it attends over),
once: later builds read them from the cache (`draft_size_cache`).
"""

from __future__ import annotations

from typing import Callable, Mapping

import jax
from flax import nnx

from medusa_jax.assets import resolve_heads_dir
from medusa_jax.model.backbone import CausalLM
from medusa_jax.model.sharding import MeshConfig, sharding_for
from medusa_jax.hf.load import load_pretrained
from medusa_jax.heads.kinds import drafter_class, training_free_kinds
from medusa_jax.heads.load import load_heads
from medusa_jax.heads.draft_merge import DraftSizes
from medusa_jax.heads.mixed import MixedDrafter, stand_in_config
from medusa_jax.trees.tree import DEFAULT_DYNAMIC_DEPTH, DynamicTree, default_dynamic_top_k
from medusa_jax.inference.draft_size_cache import size_costs
from medusa_jax.inference.sharded import ShardedModel

UNTRAINED = training_free_kinds()  # drafters that need no heads folder (for the command lines' checks)
DEFAULT_BUDGET = 16


class MixError(ValueError):
    """A --heads mix that names nothing usable (one line for the command line)."""


def is_mix(heads: str | None) -> bool:
    """Whether a --heads value names mixed drafts: a `+` combination, or a training-free kind that drafts only
    inside a mix (`--heads lookup`; `--heads recycle` alone is Token Recycling on its own static template,
    scripts/generate.py)."""
    return heads is not None and ("+" in heads or (heads in training_free_kinds() and
                                                    not drafter_class(heads).decodes_alone))


def parse_mix(text: str) -> tuple[tuple[str, ...], str | None]:
    """'default+lookup' -> (training-free kinds, the trained heads' location or None). Raises MixError for an
    empty part, a repeated part or two trained heads."""
    parts = text.split("+")
    if any(not p.strip() for p in parts):
        raise MixError(f"{text!r}: a mix is names joined by '+' (e.g. default+lookup), with no empty part")
    if len(set(parts)) != len(parts):
        raise MixError(f"{text!r}: a drafter is named twice")
    untrained = training_free_kinds()  # looked up now: a kind registered in heads.kinds is a --heads name
    trained = [p for p in parts if p not in untrained]
    if len(trained) > 1:
        raise MixError(f"{text!r}: at most one heads folder in a mix (got {', '.join(trained)}); the drafters that "
                       f"need none are {', '.join(untrained)}")
    return tuple(p for p in parts if p in untrained), (trained[0] if trained else None)


def sizes_for(budget: int) -> tuple[int, ...]:
    """The static sizes of a budget: plain, two intermediate sizes and the budget (fewer when it is small)."""
    return tuple(sorted({0, max(1, budget // 8), max(1, budget // 3), budget}))


def make_members(base: CausalLM, untrained: tuple[str, ...], trained_heads, budget: int,
                 given: Mapping[str, nnx.Module] | None = None) -> MixedDrafter:
    """The MixedDrafter of the training-free kinds `untrained` (each its `mix_member`, reusing a drafter of
    `given` by kind: e.g. a warm recycler) and the trained heads (a dynamic tree of `budget` nodes). Members that
    fill a template come first, then the trained heads, then those that size themselves (the merge gives ties to
    the earlier drafter)."""
    given = given or {}
    members = [(kind, *drafter_class(kind).mix_member(base, budget, given.get(kind))) for kind in untrained]
    ordered = [m for m in members if m[2] is not None]
    if trained_heads is not None:
        depth = min(DEFAULT_DYNAMIC_DEPTH, trained_heads.config.num_heads)
        tree = DynamicTree(budget, default_dynamic_top_k(budget, depth), depth)
        ordered.append((trained_heads.config.head_type, trained_heads,
                        tree.check(trained_heads.config.num_heads, trained_heads.config.head_vocab_size)))
    ordered += [m for m in members if m[2] is None]
    if not ordered:
        raise MixError("a mix needs at least one drafter")
    names, drafters, specs = zip(*ordered)
    depth = max(spec.depth if spec is not None else d.depth for d, spec in zip(drafters, specs))
    config = trained_heads.config if trained_heads is not None else stand_in_config(
        base.config.hidden_size, base.config.vocab_size, depth)
    return MixedDrafter(drafters, specs, names, config)


def build_mix(base: CausalLM, untrained: tuple[str, ...], trained_heads, budget: int = DEFAULT_BUDGET, *,
              batch: int = 1, costs: Callable[[tuple[int, ...]], tuple[float, ...]] | None = None,
              given: Mapping[str, nnx.Module] | None = None,
              calibration: str | None = None) -> tuple[MixedDrafter, DraftSizes]:
    """The drafter and the draft sizes of a parsed mix (`make_members`); `costs` (sizes -> relative costs, at every
    span) defaults to this machine's at `batch` by span, measured once and cached (`draft_size_cache.size_costs`;
    `calibration` auto / redo / skip as there)."""
    mix = make_members(base, untrained, trained_heads, budget, given)
    sizes = sizes_for(min(budget, mix.candidates))
    if costs is not None:
        return mix, DraftSizes(sizes, tuple(costs(sizes)), depth=mix.depth)
    return mix, DraftSizes.timed(sizes, size_costs(base, mix, sizes, batch=batch, mode=calibration)[0], mix.depth)


def load_mixed(model_dir, heads: str, mesh: MeshConfig | None = None, dtype: str = "float32", batch: int = 1,
               budget: int = DEFAULT_BUDGET, calibration: str | None = None) -> tuple[ShardedModel, DraftSizes]:
    """`sharded.load_sharded` for a --heads mix: the base on its mesh, the mix's trained heads (if any) beside it,
    and the draft sizes with this machine's costs at `batch` rows."""
    untrained, trained = parse_mix(heads)
    mesh = (mesh or MeshConfig()).make_mesh()
    base = load_pretrained(model_dir, dtype=dtype, sharding_for=sharding_for(mesh))
    trained_heads = None
    if trained is not None:
        trained_heads = load_heads(resolve_heads_dir(trained), base_config=base.config,
                                   base=base if jax.process_count() == 1 else None, dtype=dtype)
    mix, sizes = build_mix(base, untrained, trained_heads, budget, batch=batch, calibration=calibration)
    return ShardedModel(base, mix, mesh), sizes

