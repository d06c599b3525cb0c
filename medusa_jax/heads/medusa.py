"""Medusa heads (Flax NNX) and the model object that runs backbone + heads in one forward.

Head i (0-based) reads the base model's final-norm hidden state at position t and predicts the token at
t + 2 + i. Each head is `num_layers` ResBlocks (x + SiLU(W x + b), W and b zero-initialised, so a fresh head
starts as the identity) followed by an lm_head in one of three modes:
  own        a [D, V] projection per head, initialised from the base lm_head (FasterDecoding/TRT-LLM layout)
  shared     the base model's lm_head is reused (TGI "v2", vLLM `original_lm_head`)
  truncated  a [D, Vt] projection per head over the Vt most frequent tokens; `token_map[j]` is the full-vocab
             id of truncated entry j (vLLM `truncated_vocab_size` + `token_map`)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from medusa_jax.model.backbone import CausalLM
from medusa_jax.model.config import resolve_dtype
from medusa_jax.model.kv_cache import KVCache
from medusa_jax.heads.config import HeadsConfig
from medusa_jax.heads.dynamic_tree import grow_from_candidates, top_k_log_probs
from medusa_jax.heads.tree import DynamicTree


class TokenMap(nnx.Variable):
    """Non-trainable int32 ids mapping truncated-vocab entries to full-vocab token ids."""


class ResBlock(nnx.Module):
    def __init__(self, dim: int, dtype, rngs: nnx.Rngs):
        self.linear = nnx.Linear(dim, dim, use_bias=True, dtype=dtype, param_dtype=dtype, rngs=rngs,
                                 kernel_init=nnx.initializers.zeros, bias_init=nnx.initializers.zeros)

    def __call__(self, x):
        return x + jax.nn.silu(self.linear(x))


def head_lm_head(config: HeadsConfig, dtype, rngs: nnx.Rngs) -> nnx.Linear | None:
    """A head's own [D, V_head] projection, or None in "shared" mode (the base lm_head is used)."""
    if config.lm_head == "shared":
        return None
    return nnx.Linear(config.hidden_size, config.head_vocab_size, use_bias=False, dtype=dtype, param_dtype=dtype,
                      rngs=rngs)


def head_logits(head: nnx.Module, hidden_xd: jax.Array, base: CausalLM) -> jax.Array:
    """[..., D] states after a head's blocks -> [..., V_head] fp32 logits through its lm_head (or the base's)."""
    return base.logits(hidden_xd) if head.lm_head is None else head.lm_head(hidden_xd).astype(jnp.float32)


class HeadsBase(nnx.Module):
    """What Medusa and Hydra heads share: the config, the list of heads and the truncated-vocab token map."""

    head_type = ""  # the HeadsConfig.head_type a subclass implements

    def __init__(self, config: HeadsConfig, heads: list[nnx.Module], token_map: np.ndarray | None):
        if config.head_type != self.head_type:
            raise ValueError(f"{type(self).__name__} needs head_type={self.head_type!r}, got {config.head_type!r}")
        self.config = config
        self.heads = nnx.List(heads)
        if config.lm_head == "truncated":
            ids_u = np.arange(config.truncated_vocab_size) if token_map is None else np.asarray(token_map)
            if ids_u.shape != (config.truncated_vocab_size,):
                raise ValueError(f"token_map has shape {ids_u.shape}, expected ({config.truncated_vocab_size},)")
            self.token_map = TokenMap(jnp.asarray(ids_u, jnp.int32))
        else:
            self.token_map = None

    def to_full_vocab(self, head_token_ids: jax.Array) -> jax.Array:
        """Maps ids in the head's vocabulary (truncated or not) to full-vocabulary ids."""
        if self.token_map is None:
            return head_token_ids
        return self.token_map[...][head_token_ids]

    # ---- the tree step's proposer contract (inference/medusa.py) ------------------------------------------
    # propose(hidden_bd, root_b, base, tree, draft, active_b) -> (proposal, draft): a proposal is [b, m, r]
    # candidates per (head, rank) or [b, t] tree tokens, or for a DynamicTree a dynamic_tree.TreeProposal (each
    # row's tree grown from the heads' own probabilities); `draft` is a drafter state carried from step to step
    # (None for heads that keep none). init_draft makes it after the prefill (given every prompt position's
    # hidden state when needs_prompt_hidden); accepted() updates it with the verified path, verified() with the
    # base's logits at every verified tree node (Token Recycling's table, heads/recycle.py). keeps_draft: the
    # decode call hands the final drafter state back (keep_draft) to start the next call from.
    needs_prompt_hidden = False
    keeps_draft = False

    def init_draft(self, base: CausalLM, prompt_bt, prompt_lens_b, hidden_btd, cache_size: int, max_depth: int):
        return None

    def accepted(self, draft, hidden_btd, tokens_bt, nodes_be, accept_b, active_b):
        return draft

    def verified(self, draft, tokens_bt, logits_btv, active_b):
        return draft


class MedusaHead(nnx.Module):
    def __init__(self, config: HeadsConfig, rngs: nnx.Rngs):
        dtype = resolve_dtype(config.dtype)
        self.blocks = nnx.List([ResBlock(config.hidden_size, dtype, rngs) for _ in range(config.num_layers)])
        self.lm_head = head_lm_head(config, dtype, rngs)

    def __call__(self, hidden_xd):
        for block in self.blocks:
            hidden_xd = block(hidden_xd)
        return hidden_xd


class MedusaHeads(HeadsBase):
    head_type = "medusa"

    def __init__(self, config: HeadsConfig, rngs: nnx.Rngs, token_map: np.ndarray | None = None):
        super().__init__(config, [MedusaHead(config, rngs) for _ in range(config.num_heads)], token_map)

    def logits(self, hidden_xd: jax.Array, base: CausalLM, num_heads: int | None = None) -> jax.Array:
        """[..., D] -> [M, ..., V_head] fp32 logits (V_head = truncated_vocab_size in truncated mode) of the
        first num_heads heads (all by default)."""
        if self.config.lm_head == "shared":
            # one matmul for all heads: the base lm_head is read once, not once per head (~30 -> 20 ms for
            # 4 SmolLM2 heads on 2 CPU cores)
            return base.logits(jnp.stack([head(hidden_xd) for head in self.heads[:num_heads]]))
        return jnp.stack([head_logits(head, head(hidden_xd), base) for head in self.heads[:num_heads]])

    def top_k(self, hidden_xd: jax.Array, base: CausalLM, k: int, num_heads: int | None = None) -> jax.Array:
        """[..., D] -> [M, ..., r] int32 full-vocab ids of each head's k best tokens, best first (first
        num_heads heads only when given)."""
        _, ids_mxr = jax.lax.top_k(self.logits(hidden_xd, base, num_heads), k)
        return self.to_full_vocab(ids_mxr.astype(jnp.int32))

    def propose(self, hidden_bd, root_b, base: CausalLM, tree, draft, active_b):
        """[b, m, r] candidates: head m's rank-r token from the last accepted hidden state (HeadsBase). A
        DynamicTree: the tree grown from them, a node's score the product of the heads' probabilities along its
        path (dynamic_tree.grow_from_candidates)."""
        if isinstance(tree, DynamicTree):
            ids_mbr, logp_mbr = top_k_log_probs(self.logits(hidden_bd, base, num_heads=tree.depth), tree.top_k)
            return grow_from_candidates(tree, root_b, self.to_full_vocab(ids_mbr).transpose(1, 0, 2),
                                        logp_mbr.transpose(1, 0, 2)), draft
        return self.top_k(hidden_bd, base, tree.top_k, num_heads=tree.depth).transpose(1, 0, 2), draft


class MedusaModel(nnx.Module):
    """Backbone + heads: one forward gives the base logits, the heads' logits and the updated cache."""

    def __init__(self, base: CausalLM, heads: MedusaHeads):
        if heads.config.hidden_size != base.config.hidden_size or heads.config.vocab_size != base.config.vocab_size:
            raise ValueError("heads and base model disagree on hidden_size or vocab_size")
        self.base = base
        self.heads = heads

    def __call__(self, tokens_bt, positions_bt, mask_bts, cache: KVCache):
        hidden_btd, cache = self.base(tokens_bt, positions_bt, mask_bts, cache)
        return self.base.logits(hidden_btd), self.heads.logits(hidden_btd, self.base), cache
