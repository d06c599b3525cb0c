"""Hydra heads (Ankner et al., 2024): draft heads that also see the tokens already drafted on their path; their
inputs (`HeadsConfig.hydra_input`: concat or add, and why add is the default) and how they draft a static or
dynamic tree are in docs/modules.md. Axes: t tree nodes, e depth along a path, r the head's top-k ranks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from medusa_jax.model.backbone import CausalLM
from medusa_jax.model.config import resolve_dtype
from medusa_jax.model import vocab_reduce
from medusa_jax.heads.config import HeadsConfig
from medusa_jax.trees.dynamic_tree import TreeProposal, grow_tree, top_k_log_probs
from medusa_jax.heads.medusa import HeadsBase, ResBlock, head_lm_head, head_logits
from medusa_jax.trees.tree import DynamicTree, TreeBuffers


def _identity_on_hidden(key, shape, dtype):
    """[(j + 1) D, D] kernel that passes h through and ignores the embeddings."""
    return jnp.eye(shape[0], shape[1], dtype=dtype)


class HydraHead(nnx.Module):
    def __init__(self, config: HeadsConfig, index: int, rngs: nnx.Rngs):
        dtype = resolve_dtype(config.dtype)
        d, path_len = config.hidden_size, index + 1
        kw = dict(dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.hydra_input = config.hydra_input
        if config.hydra_input == "concat":
            self.input_proj = nnx.Linear((path_len + 1) * d, d, use_bias=True, kernel_init=_identity_on_hidden,
                                         bias_init=nnx.initializers.zeros, **kw)
        else:
            self.input_proj = nnx.Linear(path_len * d, d, use_bias=False, kernel_init=nnx.initializers.zeros, **kw)
        self.blocks = nnx.List([ResBlock(d, dtype, rngs) for _ in range(config.num_layers)])
        self.lm_head = head_lm_head(config, dtype, rngs)

    def __call__(self, hidden_xd, path_embeds_xed):
        """[..., D] hidden states and [..., e, D] path-token embeddings -> [..., D] (before the lm_head)."""
        path_embeds_flat = path_embeds_xed.reshape(  # [..., e * D]
            *path_embeds_xed.shape[:-2], -1).astype(hidden_xd.dtype)
        if self.hydra_input == "concat":
            x = self.input_proj(jnp.concatenate([hidden_xd, path_embeds_flat], axis=-1))
        else:
            x = hidden_xd + self.input_proj(path_embeds_flat)
        for block in self.blocks:
            x = block(x)
        return x


class HydraHeads(HeadsBase):
    head_type = "hydra"

    def __init__(self, config: HeadsConfig, rngs: nnx.Rngs, token_map: np.ndarray | None = None):
        super().__init__(config, [HydraHead(config, i, rngs) for i in range(config.num_heads)], token_map)

    def head_logits(self, index: int, hidden_xd: jax.Array, path_tokens_xe: jax.Array, base: CausalLM) -> jax.Array:
        """Head `index`'s fp32 logits [..., V_head] from hidden states [..., D] and the index + 1 path tokens
        [..., index + 1] (root first)."""
        head = self.heads[index]
        return head_logits(head, head(hidden_xd, base.embed_tokens(path_tokens_xe)), base)

    def teacher_forced_top_k(self, hidden_btd, tokens_bt, base: CausalLM, k: int) -> jax.Array:
        """[M, B, T, k]: head i's k best at every position, its path the true tokens t + 1 .. t + 1 + i."""
        path_bte = path_tokens(tokens_bt, self.config.num_heads)
        _, ids = vocab_reduce.top_k(jnp.stack([self.head_logits(i, hidden_btd, path_bte[..., : i + 1], base)
                                          for i in range(self.config.num_heads)]), k)
        return self.to_full_vocab(ids.astype(jnp.int32))

    def propose(self, hidden_bd, root_b, base: CausalLM, tree: TreeBuffers | DynamicTree, draft, active_b):
        """The [b, t] tree tokens (`tree_tokens`), or a DynamicTree's TreeProposal (`dynamic_tree`); no drafter
        state (HeadsBase)."""
        if isinstance(tree, DynamicTree):
            return self.dynamic_tree(hidden_bd, root_b, base, tree), draft
        return self.tree_tokens(hidden_bd, root_b, base, tree), draft

    def dynamic_tree(self, hidden_bd: jax.Array, root_b: jax.Array, base: CausalLM, spec: DynamicTree) -> TreeProposal:
        """Each row's dynamic tree: round d runs head d - 1 on each frontier node's own path (its K children are
        the head's top-K given that path, scored by the head's log-probability)."""
        def expand(depth, frontier, carry):
            b, w = frontier.path_bwe.shape[:2]
            hidden_bwd = jnp.broadcast_to(hidden_bd[:, None, :], (b, w, hidden_bd.shape[-1]))
            ids_bwr, logp_bwr = top_k_log_probs(self.head_logits(depth - 1, hidden_bwd, frontier.path_bwe, base),
                                                spec.top_k)
            return self.to_full_vocab(ids_bwr), logp_bwr, carry

        return grow_tree(spec, root_b, expand)[0]

    def tree_tokens(self, hidden_bd: jax.Array, root_b: jax.Array, base: CausalLM, tree: TreeBuffers) -> jax.Array:
        """[B, T] tokens of every tree node (node 0 = root_b), drafted depth by depth along each node's path.
        In a round, the t axis of hidden_btd / path_tokens_bte / ids_btr runs over the round's parents_t."""
        b = root_b.shape[0]
        tokens_bt = jnp.zeros((b, tree.num_tokens), jnp.int32).at[:, 0].set(root_b.astype(jnp.int32))
        for depth, r in enumerate(draft_rounds(tree), start=1):
            path_tokens_bte = tokens_bt[:, r.paths_te]
            hidden_btd = jnp.broadcast_to(hidden_bd[:, None, :], (b, len(r.parents_t), hidden_bd.shape[-1]))
            _, ids_btr = vocab_reduce.top_k(self.head_logits(depth - 1, hidden_btd, path_tokens_bte, base), r.top_k)
            ids_btr = self.to_full_vocab(ids_btr.astype(jnp.int32))
            tokens_bt = tokens_bt.at[:, r.children_t].set(ids_btr[:, r.parent_slot_t, r.rank_t])
        return tokens_bt


class DraftRound:
    """Static indices of one drafting round (numpy): the parents whose children it fills.

    children_t: the tree nodes at this depth; parents_t: their distinct parents (ascending); for each child,
    parent_slot_t (its parent's index in parents_t) and rank_t (its rank among the parent's top-k);
    paths_te: each parent's path, root first."""

    def __init__(self, tree: TreeBuffers, depth: int):
        self.children_t = np.nonzero(tree.depth_t == depth)[0]
        self.parents_t = np.unique(tree.parent_t[self.children_t])
        self.parent_slot_t = np.searchsorted(self.parents_t, tree.parent_t[self.children_t])
        self.rank_t = tree.rank_t[self.children_t]
        self.top_k = int(self.rank_t.max()) + 1
        # a node's ancestors (itself included) in node order are its path, root first: nodes sort by length
        self.paths_te = np.stack([np.nonzero(tree.ancestor_mask_tt[p])[0] for p in self.parents_t])


def draft_rounds(tree: TreeBuffers) -> list[DraftRound]:
    return [DraftRound(tree, d) for d in range(1, tree.depth + 1)]


def path_tokens(tokens_bt, num_heads: int):
    """Teacher forcing's paths: [B, T, E] tokens t + 1 + e, e = 0..num_heads-1 (depth along the path, 0 = the
    root), 0 past the row's end (NumPy in, NumPy out; jax in, jax out). Head i at position t reads
    path[..., :i + 1]."""
    xp = np if isinstance(tokens_bt, np.ndarray) else jnp
    b, t = tokens_bt.shape
    padded = xp.concatenate([tokens_bt, xp.zeros((b, num_heads), tokens_bt.dtype)], axis=1)
    return xp.stack([padded[:, 1 + e: 1 + e + t] for e in range(num_heads)], axis=-1).astype(xp.int32)
