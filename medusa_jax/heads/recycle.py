"""Token Recycling (Luo et al., ACL 2025, "Turning Trash into Treasure"): drafts with no trained parameters,
from one table `table_vr` [V, r] int32 (row v: the r tokens the base's logits last ranked highest after token v),
refreshed from every verified node's logits inside the decode loop and shared by a batch's rows. The template
walk, the write order and the drafter contract: docs/modules.md."""

from __future__ import annotations

import dataclasses
import os
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from medusa_jax.model.backbone import CausalLM
from medusa_jax.model import vocab_reduce
from medusa_jax.heads.mixed import TemplateSpec, template_spec
from medusa_jax.heads.recycle_file import model_fingerprint, starting_table
from medusa_jax.trees.tree import DynamicTree, TreeBuffers, build_tree

HEAD_TYPE = "recycle"
DEFAULT_TOP_K = 8  # table width r: the widest rank a template may use
DEFAULT_MAX_DEPTH = 8  # the deepest template path accepted (drafting is a table lookup per depth: any depth works)

# How often SmolLM2's greedy next token after an assistant token of ShareGPT text sat at rank 0..7 of that token's
# row in the table as built so far (scripts/build_recycle_table.py, the shipped table's build: 37,055 positions
# after a 40-conversation warm-up); the templates below follow from it. On SmolLM2's own greedy answers to 8
# MT-Bench questions, replayed from the shipped table, the same measure gave 0.24, 0.08, 0.06, 0.03, ... (1,031
# positions): the ShareGPT figures hold for decoding. Under independence they predict 1.45 / 1.64 / 1.77
# tokens per step at 4 / 16 / 64 nodes (bench/recycle measures them).
RANK_ACCEPTANCE = (0.2567, 0.0826, 0.0464, 0.03, 0.0214, 0.0172, 0.0129, 0.0128)


def best_first_paths(rank_acceptance: tuple[float, ...], nodes: int, max_depth: int = DEFAULT_MAX_DEPTH
                     ) -> tuple[tuple[int, ...], ...]:
    """The `nodes` template paths of highest predicted acceptance, a path's the product of its ranks'
    (depth-independent) acceptance: wide at depth 1, narrowing with depth; every prefix of the result is a tree."""
    frontier, chosen = [(-rank_acceptance[0], (0,))], []
    while frontier and len(chosen) < nodes:
        frontier.sort()
        score, path = frontier.pop(0)
        chosen.append(path)
        if len(path) < max_depth:  # its first child and its next sibling become candidates
            frontier.append((score * rank_acceptance[0], path + (0,)))
        if path[-1] + 1 < len(rank_acceptance):
            frontier.append((score / rank_acceptance[path[-1]] * rank_acceptance[path[-1] + 1],
                             path[:-1] + (path[-1] + 1,)))
    return tuple(chosen)


# Templates (`medusa_choices` paths, ranks 0-based) of 4, 16 and 64 drafted nodes (the root comes on top)
TEMPLATES: dict[str, tuple[tuple[int, ...], ...]] = {
    f"recycle_{n}": best_first_paths(RANK_ACCEPTANCE, n) for n in (4, 8, 16, 32, 64)}
# the fastest measured on a 2-core CPU (bench/recycle: wider templates accept more per step but cost more there)
DEFAULT_TEMPLATE = "recycle_4"


class RecycleTable(nnx.Variable):
    """The [V, r] int32 table of recycled top-r successors (not trained; replaced after each decode call)."""


@dataclasses.dataclass(frozen=True)
class RecycleConfig:
    """What ShardedModel, MedusaModel and the tree checks read of a drafter's config (as of a HeadsConfig)."""

    hidden_size: int
    vocab_size: int
    top_k: int = DEFAULT_TOP_K
    max_depth: int = DEFAULT_MAX_DEPTH
    head_type: ClassVar[str] = HEAD_TYPE

    def __post_init__(self):
        if not 1 <= self.top_k <= self.vocab_size or self.max_depth < 1:
            raise ValueError(f"need 1 <= top_k <= vocab_size and max_depth >= 1, got top_k={self.top_k}, "
                             f"max_depth={self.max_depth}")

    @property
    def num_heads(self) -> int:  # the deepest tree it drafts (tree.load_tree's num_heads limit)
        return self.max_depth

    @property
    def head_vocab_size(self) -> int:  # the widest rank + 1 (tree.load_tree's max_top_k limit)
        return self.top_k


def empty_table(vocab_size: int, top_k: int = DEFAULT_TOP_K) -> np.ndarray:
    """A table before any logits were seen: every row drafts ids 0..r-1 (distinct siblings, as top-r rows)."""
    return np.broadcast_to(np.arange(top_k, dtype=np.int32), (vocab_size, top_k)).copy()


def template_within(budget: int) -> str:
    """The largest shipped template of at most `budget` nodes (the smallest when none fits)."""
    sizes = sorted(int(name.split("_")[1]) for name in TEMPLATES)
    fitting = [n for n in sizes if n <= budget]
    return f"recycle_{fitting[-1] if fitting else sizes[0]}"


def template_tree(name: str, max_top_k: int = DEFAULT_TOP_K, max_depth: int = DEFAULT_MAX_DEPTH) -> TreeBuffers:
    """A shipped template (`TEMPLATES`) as TreeBuffers."""
    if name not in TEMPLATES:
        raise ValueError(f"unknown recycling template {name!r}; one of {', '.join(TEMPLATES)}")
    return build_tree(TEMPLATES[name], name=name, num_heads=max_depth, max_top_k=max_top_k)


def draft_tokens(table_vr: jax.Array, root_b: jax.Array, tree: TreeBuffers) -> jax.Array:
    """[b, t] tree tokens of a static template, node 0 = root_b: depth by depth, node t gets
    table_vr[token of parent_t[t], rank_t[t]] (static gathers; nodes are sorted by depth)."""
    tokens_bt = jnp.zeros((root_b.shape[0], tree.num_tokens), jnp.int32).at[:, 0].set(root_b.astype(jnp.int32))
    for depth in range(1, tree.depth + 1):
        nodes_t = np.nonzero(tree.depth_t == depth)[0]
        parent_tokens_bt = tokens_bt[:, tree.parent_t[nodes_t]]
        tokens_bt = tokens_bt.at[:, nodes_t].set(table_vr[parent_tokens_bt, jnp.asarray(tree.rank_t[nodes_t])])
    return tokens_bt


def recycle_update(table_vr: jax.Array, tokens_bt: jax.Array, logits_btv: jax.Array,
                   active_b: jax.Array | None = None, writes_bt: jax.Array | None = None) -> jax.Array:
    """The table with row tokens_bt[b, t] set to the top-r ids of logits_btv[b, t], for every node of every
    active row (and where writes_bt holds, when given). Duplicate token ids: the largest flat index b * T + t
    wins (module docstring)."""
    b, t = tokens_bt.shape
    vocab, top_k = table_vr.shape
    _, ids_btr = vocab_reduce.top_k(logits_btv, top_k)
    writes_bt = jnp.ones((b, t), bool) if writes_bt is None else writes_bt
    writes_bt = writes_bt if active_b is None else writes_bt & active_b[:, None]
    target_bt = jnp.where(writes_bt, tokens_bt, vocab)  # vocab: out of range, dropped
    if b * t == 1:  # one write (a plain step at batch 1): nothing to deduplicate, no [V] scratch
        wins_bt = writes_bt
    else:
        order_bt = jnp.arange(b * t, dtype=jnp.int32).reshape(b, t)
        winner_v = jnp.full((vocab,), -1, jnp.int32).at[target_bt].max(order_bt, mode="drop")
        wins_bt = writes_bt & (winner_v[jnp.minimum(target_bt, vocab - 1)] == order_bt)
    rows_x = jnp.where(wins_bt, tokens_bt, vocab).reshape(-1)  # at most one write per token id now
    return table_vr.at[rows_x].set(ids_btr.reshape(b * t, top_k).astype(table_vr.dtype), mode="drop")


PROMPT_CHUNK = 64  # prompt positions whose logits are taken at once (prompt_update)


def prompt_update(table_vr: jax.Array, base: CausalLM, prompt_bt: jax.Array, prompt_lens_b: jax.Array,
                  hidden_btd: jax.Array) -> jax.Array:
    """The table refreshed from the prefill: row prompt_bt[b, i] set to the top-r ids of the base's logits at
    prompt position i < prompt_lens_b[b] (Token Recycling's own use of the prompt). Where a token id occurs
    several times, one write wins: the latest PROMPT_CHUNK-position chunk, then the later row, then the later
    position (the order of a chunk-by-chunk `recycle_update`). Only the winning positions' logits are computed,
    PROMPT_CHUNK at a time (a fori_loop over them, gathered to the front: the [b, t, V] logits of a whole prompt
    are never held): in a 300-token SmolLM2 prompt about a third of the positions repeat an earlier token, and
    each position costs one row of the vocabulary projection (a 300-token update took ~1/5 of the prefill)."""
    b, t = prompt_bt.shape
    vocab, top_k = table_vr.shape
    position_t = jnp.arange(t, dtype=jnp.int32)
    writes_bt = position_t[None, :] < prompt_lens_b[:, None]
    if t <= PROMPT_CHUNK:  # no loop: XLA:CPU hoists a one-chunk body out of it, and its hoisted top_k became a
        # full sort of every position's logits (0.64 s for a 64-token prompt against 0.03 s)
        return recycle_update(table_vr, prompt_bt.astype(jnp.int32), base.logits(hidden_btd), writes_bt=writes_bt)
    key_bt = (position_t // PROMPT_CHUNK * b * PROMPT_CHUNK + position_t % PROMPT_CHUNK)[None, :] + \
        jnp.arange(b, dtype=jnp.int32)[:, None] * PROMPT_CHUNK  # the write order above
    tokens_x = prompt_bt.astype(jnp.int32).reshape(-1)
    target_x = jnp.where(writes_bt.reshape(-1), tokens_x, vocab)  # vocab: out of range, no write
    key_x = key_bt.reshape(-1)
    winner_v = jnp.full((vocab,), -1, jnp.int32).at[target_x].max(key_x, mode="drop")
    wins_x = (target_x < vocab) & (winner_v[jnp.minimum(target_x, vocab - 1)] == key_x)
    chunks = -(-(b * t) // PROMPT_CHUNK)
    pad = chunks * PROMPT_CHUNK - b * t
    order_x = jnp.pad(jnp.argsort(~wins_x, stable=True).astype(jnp.int32), (0, pad))  # the winners first
    count = jnp.sum(wins_x).astype(jnp.int32)
    hidden_xd = hidden_btd.reshape(b * t, hidden_btd.shape[-1])
    slot_c = jnp.arange(PROMPT_CHUNK, dtype=jnp.int32)

    def chunk(i, table_vr):
        index_c = jax.lax.dynamic_slice_in_dim(order_x, i * PROMPT_CHUNK, PROMPT_CHUNK)
        _, ids_cr = vocab_reduce.top_k(base.logits(hidden_xd[index_c]), top_k)
        rows_c = jnp.where(i * PROMPT_CHUNK + slot_c < count, tokens_x[index_c], vocab)  # distinct ids: no ties
        return table_vr.at[rows_c].set(ids_cr.astype(table_vr.dtype), mode="drop")

    return jax.lax.fori_loop(0, (count + PROMPT_CHUNK - 1) // PROMPT_CHUNK, chunk, table_vr)


class RecycleDrafter(nnx.Module):
    """Token Recycling behind the proposer contract of `HeadsBase`; `config` answers the tree-limit and model
    checks a HeadsConfig answers. `recycle_table` holds the table the next decode call starts from;
    `keep_draft` stores the table a call ended with (ShardedModel does, after each call)."""

    head_type = HEAD_TYPE
    trained = False  # no heads folder: heads.kinds lists it among the training-free kinds
    decodes_alone = True  # drafts a static template by itself (`--heads recycle`), not only inside a mix
    needs_prompt_hidden = True  # the table is refreshed from the prompt's logits (`prompt_update`)
    # that refresh only learns the prompt: in a mix with prompt lookup, which drafts from the prompt itself, the mix
    # leaves it out (heads.mixed.MixedDrafter.prompt_readers; docs/recycle.md)
    learns_prompt = True
    drafts_from_prompt = False
    feature_layers: tuple[int, ...] = ()  # reads the final hidden states only (no EAGLE-3 taps)
    keeps_draft = True  # the decode call returns the final drafter state, handed back through keep_draft

    def __init__(self, config: RecycleConfig, table_vr: np.ndarray | jax.Array | None = None):
        table_vr = empty_table(config.vocab_size, config.top_k) if table_vr is None else table_vr
        if tuple(table_vr.shape) != (config.vocab_size, config.top_k):
            raise ValueError(f"a recycling table of shape {tuple(table_vr.shape)} does not fit vocab_size "
                             f"{config.vocab_size} and top_k {config.top_k}")
        self.config = config
        self.recycle_table = RecycleTable(jnp.asarray(table_vr, jnp.int32))

    @classmethod
    def mix_member(cls, base: CausalLM, budget: int, drafter: "RecycleDrafter | None" = None
                   ) -> tuple["RecycleDrafter", TemplateSpec]:
        """This kind in a mix of `budget` nodes (heads.kinds): `drafter` (default: `recycle_drafter(base)`, the
        shipped warm table where it fits) filling the largest template within the budget, each node scored by
        the measured acceptance of its path's ranks (RANK_ACCEPTANCE)."""
        drafter = drafter if drafter is not None else recycle_drafter(base)
        tree = template_tree(template_within(budget), drafter.config.top_k)
        return drafter, template_spec(tree, RANK_ACCEPTANCE)

    @property
    def table(self) -> np.ndarray:
        """The current table on the host, [V, r] int32."""
        return np.asarray(self.recycle_table[...])

    def keep_draft(self, table_vr) -> None:
        """The table a decode call ended with becomes the table the next call starts from."""
        self.recycle_table[...] = jnp.asarray(table_vr, jnp.int32)

    # ---- the proposer contract (inference/medusa.py; see HeadsBase) ---------------------------------------
    def init_draft(self, base, prompt_bt, prompt_lens_b, hidden_btd, cache_size: int, max_depth: int):
        """The kept table, refreshed from the prompt's logits when its hidden states are given."""
        if hidden_btd is None:
            return self.recycle_table[...]
        return prompt_update(self.recycle_table[...], base, prompt_bt, prompt_lens_b, hidden_btd)

    def propose(self, hidden_bd, root_b, base, tree, draft, active_b):
        """[b, t] tree tokens drafted from the table (`draft_tokens`); static templates only."""
        if isinstance(tree, DynamicTree):
            raise ValueError(f"Token Recycling drafts a static template, not the dynamic tree {tree.name}")
        return draft_tokens(draft, root_b, tree), draft

    def accepted(self, draft, hidden_btd, tokens_bt, nodes_be, accept_b, active_b):
        return draft

    def verified(self, draft, tokens_bt, logits_btv, active_b):
        """The table refreshed from the verify logits at every node of every active row (`recycle_update`)."""
        return recycle_update(draft, tokens_bt, logits_btv, active_b)


def recycle_drafter(base: CausalLM, table_path: str | os.PathLike | None = None,
                    top_k: int = DEFAULT_TOP_K) -> RecycleDrafter:
    """The Token Recycling drafter for `base`, starting from `recycle_file.starting_table` (its `origin` says
    which; its `fingerprint` is the model's, for `recycle_file.save_table`)."""
    fingerprint = model_fingerprint(base)
    table, origin = starting_table(base, table_path, fingerprint)
    top_k = top_k if table is None else table.shape[1]
    drafter = RecycleDrafter(RecycleConfig(base.config.hidden_size, base.config.vocab_size, top_k=top_k), table)
    drafter.origin, drafter.fingerprint = origin, fingerprint
    return drafter
