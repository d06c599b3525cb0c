"""Hydra heads (Ankner et al., 2024): draft heads that also see the tokens already drafted on their path.

Head i (0-based) reads the base model's final-norm hidden state h_t and the embeddings of the i + 1 tokens on
its path: the base model's next token x_{t+1} (the tree root) and the drafts x_{t+2}..x_{t+1+i} at depths
1..i. It predicts x_{t+2+i}, as Medusa head i does. The embeddings are looked up in the base model's input
table (frozen and shared: never copied into the heads). `HeadsConfig.hydra_input` combines them:
  concat  x = W [h; e_0; ...; e_i] + b     W starts as [I; 0; ...] (a fresh head is a Medusa head)
  add     x = h + P [e_0; ...; e_i]        P starts at zero (= h + the sum of per-position projections)
then `num_layers` ResBlocks and an lm_head in the Medusa modes (own / shared / truncated, see heads.py).
"add" is the default: on SmolLM2 hidden states (same data, steps and seed) it gave higher held-out top-1 on
every head and a lower held-out loss than "concat", with ~30% fewer parameters (concat's trainable [D, D]
block on h only adds capacity to overfit; add keeps h's path through the head fixed, as Medusa does).

Drafting runs inside the jitted decode loop on the same static tree buffers as Medusa heads, in tree.depth
rounds: round d runs head d - 1 once per tree node at depth d - 1 that has children, on that node's own path
tokens, and its top-k tokens fill the node's children (node (a, b) = head 1's rank-b token given head 0's
rank-a token on its path). Axes: p parent nodes of a round, c their children (local to this file), e positions along a path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from medusa_jax.backbone import CausalLM
from medusa_jax.config import resolve_dtype
from medusa_jax.heads import HeadsBase, HeadsConfig, ResBlock, head_lm_head, head_logits
from medusa_jax.tree import TreeBuffers


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
        path_xf = path_embeds_xed.reshape(*path_embeds_xed.shape[:-2], -1).astype(hidden_xd.dtype)
        if self.hydra_input == "concat":
            x = self.input_proj(jnp.concatenate([hidden_xd, path_xf], axis=-1))
        else:
            x = hidden_xd + self.input_proj(path_xf)
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

    def tree_tokens(self, hidden_bd: jax.Array, root_b: jax.Array, base: CausalLM, tree: TreeBuffers) -> jax.Array:
        """[B, T] tokens of every tree node (node 0 = root_b), drafted depth by depth along each node's path."""
        b = root_b.shape[0]
        tokens_bt = jnp.zeros((b, tree.num_tokens), jnp.int32).at[:, 0].set(root_b.astype(jnp.int32))
        for depth, r in enumerate(draft_rounds(tree), start=1):
            path_tokens_bpe = tokens_bt[:, r.paths_pe]
            hidden_bpd = jnp.broadcast_to(hidden_bd[:, None, :], (b, len(r.parents_p), hidden_bd.shape[-1]))
            _, ids_bpr = jax.lax.top_k(self.head_logits(depth - 1, hidden_bpd, path_tokens_bpe, base), r.top_k)
            ids_bpr = self.to_full_vocab(ids_bpr.astype(jnp.int32))
            tokens_bt = tokens_bt.at[:, r.children_c].set(ids_bpr[:, r.parent_slot_c, r.rank_c])
        return tokens_bt


class DraftRound:
    """Static indices of one drafting round (numpy): the parents whose children it fills."""

    def __init__(self, tree: TreeBuffers, depth: int):
        self.children_c = np.nonzero(tree.depth_t == depth)[0]
        self.parents_p = np.unique(tree.parent_t[self.children_c])
        self.parent_slot_c = np.searchsorted(self.parents_p, tree.parent_t[self.children_c])
        self.rank_c = tree.rank_t[self.children_c]
        self.top_k = int(self.rank_c.max()) + 1
        # a node's ancestors (itself included) in node order are its path, root first: nodes sort by length
        self.paths_pe = np.stack([np.nonzero(tree.ancestor_mask_tt[p])[0] for p in self.parents_p])


def draft_rounds(tree: TreeBuffers) -> list[DraftRound]:
    return [DraftRound(tree, d) for d in range(1, tree.depth + 1)]


def path_tokens(tokens_bt, num_heads: int):
    """Teacher forcing's paths: [B, T, K] tokens t + 1 + j, j = 0..K-1, 0 past the row's end (NumPy in, NumPy
    out; jax in, jax out). Head i at position t reads path[..., :i + 1]."""
    xp = np if isinstance(tokens_bt, np.ndarray) else jnp
    b, t = tokens_bt.shape
    padded = xp.concatenate([tokens_bt, xp.zeros((b, num_heads), tokens_bt.dtype)], axis=1)
    return xp.stack([padded[:, 1 + j: 1 + j + t] for j in range(num_heads)], axis=-1).astype(xp.int32)
