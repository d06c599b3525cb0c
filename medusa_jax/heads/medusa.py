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
from medusa_jax.model import vocab_reduce
from medusa_jax.heads.config import HeadsConfig
from medusa_jax.trees.dynamic_tree import grow_from_candidates, top_k_log_probs
from medusa_jax.trees.tree import DynamicTree


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
    """A drafter kind (registered in `heads.kinds`): the config, the list of heads, the truncated-vocab token map,
    and what each kind answers for itself (the defaults here; a subclass overrides its own)."""

    head_type = ""  # the kind's name (HeadsConfig.head_type) in heads.kinds.DRAFTERS
    has_decoder = False  # HeadsConfig.decoder describes the drafter's own decoder layers (EAGLE)
    export_formats: tuple[str, ...] = ()  # the serving layouts it exports to (heads.export, heads.eagle_layout)
    fc_options = False  # takes HeadsConfig.fc_bias / embed_scale (the EAGLE-1 drafter's input fc)
    reads_feature_layers = False  # takes HeadsConfig.feature_layers (the EAGLE-3 drafter)
    trained = True  # a heads folder holds its parameters (heads.kinds: the training-free kinds say False)
    decodes_alone = True
    # its proposal is each head's top-k of `logits(hidden, base, num_heads)` (Medusa heads): a mesh may take that
    # top-k per vocabulary shard (inference.sharded.MeshHeadsProposer); other kinds leave theirs to the compiler
    proposes_top_k_of_logits = False

    def __init__(self, config: HeadsConfig, heads: list[nnx.Module], token_map: np.ndarray | None):
        if config.head_type != self.head_type:
            raise ValueError(f"{type(self).__name__} needs head_type={self.head_type!r}, got {config.head_type!r}")
        if config.decoder is not None and not self.has_decoder:
            raise ValueError(f"only an eagle drafter has a decoder config, not {config.head_type} heads")
        if (config.fc_bias or config.embed_scale != 1.0) and not self.fc_options:
            raise ValueError(f"fc_bias and embed_scale are EAGLE-1 drafter options (head_type 'eagle'), not "
                             f"{config.head_type}'s")
        if config.feature_layers and not self.reads_feature_layers:
            raise ValueError(f"feature_layers are the base layers an eagle3 drafter reads; {config.head_type} "
                             f"heads read none")
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

    @classmethod
    def complete_config(cls, config: HeadsConfig, base: CausalLM) -> HeadsConfig:
        """The config of fresh heads over `base`, with what the kind takes from the base filled in."""
        return config

    def lm_head_modules(self) -> list[nnx.Module]:
        """The modules whose `lm_head` fresh heads copy from the base lm_head (heads.init)."""
        return list(self.heads)

    def folder_fields(self) -> dict:
        """config.json fields beside medusa-jax's own, for other tools that read the folder (heads.folder)."""
        return {}

    # ---- the tree step's proposer contract (inference/medusa.py) ------------------------------------------
    # propose(hidden_bd, root_b, base, tree, draft, active_b) -> (proposal, draft): a proposal is [b, m, r]
    # candidates per (head, rank) or [b, t] tree tokens, or for a DynamicTree a dynamic_tree.TreeProposal (each
    # row's tree grown from the heads' own probabilities); `draft` is a drafter state carried from step to step
    # (None for heads that keep none). init_draft makes it after the prefill (given every prompt position's
    # hidden state when needs_prompt_hidden); accepted() updates it with the verified path, verified() with the
    # base's logits at every verified tree node (Token Recycling's table, heads/recycle.py). A drafter with
    # feature_layers (EAGLE-3) gets, in place of those hidden states, the base's residual stream entering these
    # layers, concatenated (`CausalLM.forward_taps`), in init_draft and accepted alike. keeps_draft: the decode
    # call hands the final drafter state back (keep_draft) to start the next call from. In a mix
    # (heads/mixed.py): a drafter that reads the prompt's hidden states only to learn the prompt (learns_prompt:
    # Token Recycling's refresh) is not given them beside a drafter that drafts from the prompt's own tokens
    # (drafts_from_prompt: prompt lookup).
    needs_prompt_hidden = False
    learns_prompt = False
    drafts_from_prompt = False
    feature_layers: tuple[int, ...] = ()
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
    export_formats = ("medusa", "vllm")
    proposes_top_k_of_logits = True

    def folder_fields(self) -> dict:
        return {"medusa_num_heads": self.config.num_heads, "medusa_num_layers": self.config.num_layers}

    def __init__(self, config: HeadsConfig, rngs: nnx.Rngs, token_map: np.ndarray | None = None):
        super().__init__(config, [MedusaHead(config, rngs) for _ in range(config.num_heads)], token_map)

    def logits(self, hidden_xd: jax.Array, base: CausalLM, num_heads: int | None = None) -> jax.Array:
        """[..., D] -> [M, ..., V_head] fp32 logits (V_head = truncated_vocab_size in truncated mode) of the
        first num_heads heads (all by default)."""
        if self.config.lm_head == "shared":
            # one matmul for all heads: the base lm_head is read once, not once per head (the gain for 4 SmolLM2
            # heads on 2 CPU cores: docs/results.md)
            return base.logits(jnp.stack([head(hidden_xd) for head in self.heads[:num_heads]]))
        return jnp.stack([head_logits(head, head(hidden_xd), base) for head in self.heads[:num_heads]])

    def top_k(self, hidden_xd: jax.Array, base: CausalLM, k: int, num_heads: int | None = None) -> jax.Array:
        """[..., D] -> [M, ..., r] int32 full-vocab ids of each head's k best tokens, best first (first
        num_heads heads only when given)."""
        _, ids_mxr = vocab_reduce.top_k(self.logits(hidden_xd, base, num_heads), k)
        return self.to_full_vocab(ids_mxr.astype(jnp.int32))

    def teacher_forced_top_k(self, hidden_btd, tokens_bt, base: CausalLM, k: int) -> jax.Array:
        """[M, B, T, k] each head's k best tokens at every position of whole sequences (held-out accuracy,
        trees.search.head_accuracy; Hydra heads and the EAGLE drafter read the true tokens on their paths)."""
        return self.top_k(hidden_btd, base, k)

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
