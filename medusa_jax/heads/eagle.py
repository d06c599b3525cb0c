"""An EAGLE-style feature drafter (Li et al., 2024): one decoder layer of the base's own architecture that predicts
the base's next final hidden state, drafted autoregressively over the tree inside the jitted tree step. Its
inputs, its own KV cache (`DraftState`) and the three parts of a tree step (catch-up, tree rounds, the accepted
path) are in docs/design.md, "The EAGLE-style drafter". Axes as in the package legend; here t runs over a call's
drafter entries and `i` over the tree's internal nodes."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from medusa_jax.model.backbone import CausalLM, DecoderLayer
from medusa_jax.model.config import resolve_dtype
from medusa_jax.heads.config import HeadsConfig
from medusa_jax.heads.eagle_dynamic import propose_dynamic
from medusa_jax.heads.hydra import draft_rounds
from medusa_jax.heads.medusa import HeadsBase, head_lm_head, head_logits
from medusa_jax.model.kv_cache import KVCache, attention_mask, causal_block
from medusa_jax.model.rope import inverse_frequencies
from medusa_jax.model import vocab_reduce
from medusa_jax.trees.tree import DynamicTree, TreeBuffers


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftState:
    """The drafter's state between tree steps: its KV cache (lengths_b = P committed pairs) and the pairs of the
    last accepted path not yet in it (the first pending_n_b of pending_*)."""

    cache: KVCache
    pending_feat_bed: jax.Array  # [b, E, D] true features f_{P..P+E-1}
    pending_tok_be: jax.Array  # [b, E] the token after each
    pending_n_b: jax.Array  # [b] how many are valid


class DrafterRounds:
    """Static indices of a tree's drafting rounds (numpy). Internal nodes (non-root nodes with children), in node
    order, own the tree block's entries: internal node internal_t[i] is block entry i. Round d (d = 2..depth)
    runs block entries start[d] .. start[d + 1] - 1 (the internal nodes at depth d - 1)."""

    def __init__(self, tree: TreeBuffers):
        has_children = np.zeros(tree.num_tokens, bool)
        has_children[tree.parent_t[1:]] = True
        self.internal_i = np.nonzero(has_children & (np.arange(tree.num_tokens) > 0))[0]
        depth_i = tree.depth_t[self.internal_i]
        self.starts = {d: int(np.searchsorted(depth_i, d - 1)) for d in range(2, tree.depth + 2)}
        # block entry j is visible to entry i when node internal_i[j] is an ancestor of (or is) internal_i[i]
        self.visible_ii = tree.ancestor_mask_tt[np.ix_(self.internal_i, self.internal_i)]
        self.depth_i = depth_i


class EagleDrafter(HeadsBase):
    head_type = "eagle"
    has_decoder = True
    export_formats = ("eagle", "eagle-sglang")
    fc_options = True  # HeadsConfig.fc_bias and embed_scale (the EAGLE-1 input fc)

    @classmethod
    def complete_config(cls, config: HeadsConfig, base: CausalLM) -> HeadsConfig:
        """The drafter's layers take the base's architecture unless the config names one."""
        return config if config.decoder is not None else dataclasses.replace(config, decoder=base.config)

    def lm_head_modules(self) -> list[nnx.Module]:
        return [self]

    def __init__(self, config: HeadsConfig, rngs: nnx.Rngs, token_map: np.ndarray | None = None):
        super().__init__(config, [], token_map)
        if config.decoder is None:
            raise ValueError("an EAGLE drafter needs HeadsConfig.decoder (init_heads fills it from the base model)")
        dtype = resolve_dtype(config.dtype)
        decoder = config.decoder.replace(num_layers=config.num_layers, dtype=config.dtype)
        d = config.hidden_size
        self.decoder = decoder
        self.fc = nnx.Linear(2 * d, d, use_bias=config.fc_bias, dtype=dtype, param_dtype=dtype, rngs=rngs,
                             kernel_init=nnx.initializers.normal(0.02), bias_init=nnx.initializers.zeros)
        self.layers = nnx.List([DecoderLayer(decoder, rngs, input_norm=i > 0) for i in range(config.num_layers)])
        self.lm_head = head_lm_head(config, dtype, rngs)

    # ---- the drafter's forward ---------------------------------------------------------------------------
    def __call__(self, feats_btd, tokens_bt, positions_bt, mask_bts, cache: KVCache | None, base: CausalLM,
                 offsets_b=None) -> tuple[jax.Array, KVCache | None]:
        """Outputs g [B, T, D] of the pairs (feats_btd[t], tokens_bt[t]) and the cache with their K/V written at
        slots offsets_b + t (default: cache.lengths_b); mask_bts is over the cache slots (or, cache None, over
        the call's own entries: training)."""
        x = self.pair_inputs(feats_btd, tokens_bt, base)
        cfg = self.decoder
        if cfg.sliding_window is not None:
            key_pos = positions_bt[:, None, :] if cache is None else jnp.arange(mask_bts.shape[-1])[None, None, :]
            mask_bts = mask_bts & ((positions_bt[:, :, None] - key_pos) < cfg.sliding_window)
        inv_freq = inverse_frequencies(cfg)
        if cache is None:
            for layer in self.layers:
                x, _, _ = layer(x, positions_bt, mask_bts, None, None, None, inv_freq)
            return x, None
        offsets_b = cache.lengths_b if offsets_b is None else offsets_b
        k_layers, v_layers = [], []
        for layer, k_bkhs, v_bksh in zip(self.layers, cache.k_bkhs, cache.v_bksh):
            x, k_bkhs, v_bksh = layer(x, positions_bt, mask_bts, k_bkhs, v_bksh, offsets_b, inv_freq)
            k_layers.append(k_bkhs)
            v_layers.append(v_bksh)
        return x, cache.replace(k_bkhs=tuple(k_layers), v_bksh=tuple(v_layers))

    def pair_inputs(self, feats_btd, tokens_bt, base: CausalLM) -> jax.Array:
        """The first layer's input for the pairs (feature, token): fc([embed_scale * emb(token); feature])."""
        dtype = self.fc.kernel[...].dtype
        emb_btd = base.embed_tokens(tokens_bt).astype(dtype)
        if self.config.embed_scale != 1.0:
            emb_btd = emb_btd * jnp.asarray(self.config.embed_scale, dtype)
        return self.fc(jnp.concatenate([emb_btd, feats_btd.astype(dtype)], -1))

    def unrolled(self, feats_btd, tokens_bt, base: CausalLM, depth: int, segments_bt=None) -> jax.Array:
        """[depth, B, T, D] outputs of chains drafted from every position of whole sequences at once: depth k's
        output at t drafts x_{t+k+1} from the true context up to t (pairs (f_i, x_{i+1}), i <= t) and the TRUE
        tokens x_{t+2}..x_{t+k} with the drafter's own features along the chain (what a tree step sees on an
        accepted path). Entries of depth k live at slots (k - 1) T .. k T - 1 of one scratch cache and attend
        to the true entries up to t and their own chain (held-out acceptance per depth; training-time tests)."""
        b, t = tokens_bt.shape
        seg_bt = jnp.ones((b, t), jnp.int32) if segments_bt is None else segments_bt
        positions_bt = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        if segments_bt is not None:  # positions restart with each packed conversation
            first_bt = jnp.concatenate([jnp.ones((b, 1), bool), seg_bt[:, 1:] != seg_bt[:, :-1]], axis=1)
            start_bt = jax.lax.cummax(jnp.where(first_bt, positions_bt, 0), axis=1)
            positions_bt = positions_bt - start_bt
        causal_btt = (seg_bt[:, :, None] == seg_bt[:, None, :]) & jnp.tril(jnp.ones((t, t), bool))[None]
        eye_btt = jnp.broadcast_to(jnp.eye(t, dtype=bool), (b, t, t))
        cache = KVCache.zeros(self.decoder, b, depth * t, dtype=self.fc.kernel[...].dtype)
        outs, feats = [], feats_btd
        for k in range(1, depth + 1):
            toks = jnp.concatenate([tokens_bt[:, k:], jnp.zeros((b, k), tokens_bt.dtype)], axis=1)
            # true entries up to t (block 0), then the query's own chain entries of depths 2..k (blocks 1..k-1)
            mask = jnp.concatenate([causal_btt] + [eye_btt] * (k - 1) + [jnp.zeros_like(eye_btt)] * (depth - k),
                                   axis=2)
            out, cache = self(feats, toks, positions_bt + k - 1, mask, cache, base,
                              offsets_b=jnp.full((b,), (k - 1) * t, jnp.int32))
            outs.append(out)
            feats = out
        return jnp.stack(outs)

    def logits(self, out_xd: jax.Array, base: CausalLM) -> jax.Array:
        """[..., D] drafter outputs -> [..., V_head] fp32 draft logits."""
        return head_logits(self, out_xd, base)

    def top_k(self, out_xd: jax.Array, base: CausalLM, k: int) -> jax.Array:
        """[..., D] -> [..., k] full-vocabulary ids of the k most likely draft tokens, best first."""
        _, ids = vocab_reduce.top_k(self.logits(out_xd, base), k)
        return self.to_full_vocab(ids.astype(jnp.int32))

    def teacher_forced_top_k(self, hidden_btd, tokens_bt, base: CausalLM, k: int) -> jax.Array:
        """[M, B, T, k]: depth m + 1 of a chain drafted from every position, the true tokens on the chain."""
        outs_mbtd = self.unrolled(hidden_btd, tokens_bt, base, self.config.num_heads)
        return jnp.stack([self.top_k(out_btd, base, k) for out_btd in outs_mbtd])

    # ---- the tree step's proposer contract ---------------------------------------------------------------
    needs_prompt_hidden = True

    def init_draft(self, base: CausalLM, prompt_bt, prompt_lens_b, hidden_btd, cache_size: int,
                   max_depth: int) -> DraftState:
        """After the base prefill: the pairs (f_i, x_{i+1}) of every prompt position i < len - 1 in the drafter
        cache (one forward over the padded prompt); nothing pending."""
        b, t = prompt_bt.shape
        cache = KVCache.zeros(self.decoder, b, cache_size, dtype=self.fc.kernel[...].dtype)
        next_bt = jnp.concatenate([prompt_bt[:, 1:], prompt_bt[:, -1:]], axis=1)
        positions_bt = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        mask_bts = attention_mask(cache.lengths_b, causal_block(t), cache_size)
        _, cache = self(hidden_btd, next_bt, positions_bt, mask_bts, cache, base)
        e, d = max_depth + 1, hidden_btd.shape[-1]
        return DraftState(cache.replace(lengths_b=(prompt_lens_b - 1).astype(jnp.int32)),
                          jnp.zeros((b, e, d), hidden_btd.dtype), jnp.zeros((b, e), jnp.int32),
                          jnp.zeros((b,), jnp.int32))

    def catch_up(self, hidden_bd, root_b, base: CausalLM, draft: DraftState,
                 active_b) -> tuple[jax.Array, KVCache, jax.Array]:
        """Step 1 of a tree step (catch-up): the pending pairs and the root pair written to the drafter cache.
        Returns (the root pair's output g [B, D], the cache, the committed pairs per row: L for an active row)."""
        b, e = draft.pending_tok_be.shape
        cache, p_b, n_b = draft.cache, draft.cache.lengths_b, draft.pending_n_b
        # 1. catch-up: pending pairs 0..n-1, then the root pair at n (entries past n are masked padding)
        slot_e = jnp.arange(e + 1)
        feats = jnp.concatenate([draft.pending_feat_bed, hidden_bd[:, None].astype(draft.pending_feat_bed.dtype)], 1)
        toks = jnp.concatenate([draft.pending_tok_be, root_b[:, None].astype(jnp.int32)], 1)
        is_root_be = slot_e[None, :] == n_b[:, None]
        feats = jnp.where(is_root_be[..., None], hidden_bd[:, None].astype(feats.dtype), feats)
        toks = jnp.where(is_root_be, root_b[:, None], toks)
        positions_be = p_b[:, None] + slot_e[None, :]
        mask = attention_mask(p_b, causal_block(e + 1), cache.cache_size)
        out_bed, cache = self(feats, toks, positions_be, mask, cache, base)
        g_root_bd = jnp.take_along_axis(out_bed, n_b[:, None, None], axis=1)[:, 0]
        committed_b = jnp.where(active_b, p_b + n_b + 1, p_b)  # = L for an active row
        return g_root_bd, cache, committed_b

    def propose(self, hidden_bd, root_b, base: CausalLM, tree: TreeBuffers | DynamicTree, draft: DraftState,
                active_b) -> tuple[jax.Array, DraftState]:
        """The [B, T] tokens of every tree node (node 0 = root_b), and the state with the catch-up committed; for
        a DynamicTree a dynamic_tree.TreeProposal instead of the tokens (`eagle_dynamic.propose_dynamic`)."""
        if isinstance(tree, DynamicTree):
            return propose_dynamic(self, hidden_bd, root_b, base, tree, draft, active_b)
        g_root_bd, cache, committed_b = self.catch_up(hidden_bd, root_b, base, draft, active_b)
        b = root_b.shape[0]
        # 2. the tree: depth 1 from the root's output, deeper rounds from the drafted nodes' own pairs
        tokens_bt = jnp.zeros((b, tree.num_tokens), jnp.int32).at[:, 0].set(root_b.astype(jnp.int32))
        out_btd = jnp.zeros((b, tree.num_tokens, hidden_bd.shape[-1]), g_root_bd.dtype).at[:, 0].set(g_root_bd)
        rounds = DrafterRounds(tree)
        for depth, r in enumerate(draft_rounds(tree), start=1):
            if depth > 1:  # run the parents' own pairs (they are internal nodes at depth - 1)
                lo, hi = rounds.starts[depth], rounds.starts[depth + 1]
                nodes = rounds.internal_i[lo:hi]
                feats_btd = out_btd[:, tree.parent_t[nodes]]
                positions_bt = committed_b[:, None] - 1 + jnp.asarray(tree.depth_t[nodes])[None, :]
                slot_s = jnp.arange(cache.cache_size)
                rel_bs = slot_s[None, :] - committed_b[:, None]
                visible_ts = jnp.asarray(rounds.visible_ii[lo:hi])  # [t, internal entries]
                in_block_bts = jnp.take(visible_ts, jnp.clip(rel_bs, 0, visible_ts.shape[1] - 1), axis=1
                                        ).transpose(1, 0, 2) & ((rel_bs >= 0) & (rel_bs < visible_ts.shape[1]))[:, None]
                mask_bts = (rel_bs < 0)[:, None, :] | in_block_bts
                out_b_d, cache = self(feats_btd, tokens_bt[:, nodes], positions_bt, mask_bts, cache, base,
                                      offsets_b=committed_b + lo)
                out_btd = out_btd.at[:, nodes].set(out_b_d)
            ids_bpr = self.top_k(out_btd[:, r.parents_t], base, r.top_k)
            tokens_bt = tokens_bt.at[:, r.children_t].set(ids_bpr[:, r.parent_slot_t, r.rank_t])
        return tokens_bt, dataclasses.replace(draft, cache=cache.replace(lengths_b=committed_b))

    def accepted(self, draft: DraftState, hidden_btd, tokens_bt, nodes_be, accept_b, active_b) -> DraftState:
        """The accepted path's pairs (f at path node j, token of node j + 1), j < accept length, become the next
        step's catch-up entries (none for an inactive row)."""
        e = draft.pending_tok_be.shape[1]
        n = min(e, nodes_be.shape[1] - 1)
        feat_bed = jnp.take_along_axis(hidden_btd, nodes_be[:, :n, None], axis=1).astype(draft.pending_feat_bed.dtype)
        tok_be = jnp.take_along_axis(tokens_bt, nodes_be[:, 1:n + 1], axis=1)
        pad = e - n
        feat_bed = jnp.pad(feat_bed, ((0, 0), (0, pad), (0, 0)))
        tok_be = jnp.pad(tok_be, ((0, 0), (0, pad)))
        return dataclasses.replace(draft, pending_feat_bed=feat_bed, pending_tok_be=tok_be.astype(jnp.int32),
                                   pending_n_b=jnp.where(active_b, accept_b, 0).astype(jnp.int32))
