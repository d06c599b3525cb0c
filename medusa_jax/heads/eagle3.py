"""The EAGLE-3 drafter (Li et al., 2025; SafeAILab/EAGLE eagle/model/cnets.py, vLLM llama_eagle3.py): EAGLE's
autoregressive feature drafter fed by the base's residual stream at three depths instead of its last hidden state,
drafting over its own vocabulary; its layer and tree step: docs/modules.md. Axes as in the package legend;
f = len(feature_layers) * D, the fused feature's width."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from medusa_jax.heads.config import HeadsConfig
from medusa_jax.heads.eagle import DraftState, EagleDrafter
from medusa_jax.heads.medusa import HeadsBase, head_lm_head, head_logits
from medusa_jax.model.backbone import MLP, Attention, CausalLM, RMSNorm
from medusa_jax.model.config import ModelConfig, resolve_dtype


def default_feature_layers(num_layers: int) -> tuple[int, ...]:
    """The layers whose input EAGLE-3 fuses by default (vLLM, the authors' code): 2, L // 2 and L - 3."""
    return tuple(min(max(i, 0), num_layers) for i in (2, num_layers // 2, num_layers - 3))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Eagle3DraftState(DraftState):
    """EAGLE-1's drafter state, plus h of the root pair: fc of the last accepted node's fused feature [b, D]."""

    root_bd: jax.Array = None


class Eagle3Layer(nnx.Module):
    """The midlayer: a decoder layer over the pair [emb; h] (2D wide in, D out)."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        d, h, dtype = config.hidden_size, config.head_dim, config.jnp_dtype
        self.input_layernorm = RMSNorm(d, config.rms_norm_eps, dtype)  # on the token embedding
        self.hidden_norm = RMSNorm(d, config.rms_norm_eps, dtype)  # on h
        self.self_attn = Attention(config, rngs)
        for name, width in (("q_proj", config.num_heads * h), ("k_proj", config.num_kv_heads * h),
                            ("v_proj", config.num_kv_heads * h)):  # q/k/v read [emb; h]
            setattr(self.self_attn, name, nnx.Linear(2 * d, width, use_bias=config.attention_bias, dtype=dtype,
                                                     param_dtype=dtype, rngs=rngs,
                                                     kernel_init=nnx.initializers.normal(0.02)))
        self.post_attention_layernorm = RMSNorm(d, config.rms_norm_eps, dtype)
        self.mlp = MLP(config, rngs)
        self.hidden_size = d

    def __call__(self, pair_btd, positions_bt, mask_bts, k_bkhs, v_bksh, lengths_b, inv_freq):
        """DecoderLayer's contract, its input the pair [emb; h] [B, T, 2D]; returns (g [B, T, D], K, V)."""
        emb_btd, h_btd = pair_btd[..., :self.hidden_size], pair_btd[..., self.hidden_size:]
        normed = jnp.concatenate([self.input_layernorm(emb_btd), self.hidden_norm(h_btd)], -1)
        attn, k_bkhs, v_bksh = self.self_attn(normed, positions_bt, mask_bts, k_bkhs, v_bksh, lengths_b, inv_freq)
        x = h_btd + attn
        return x + self.mlp(self.post_attention_layernorm(x)), k_bkhs, v_bksh


class Eagle3Drafter(EagleDrafter):
    head_type = "eagle3"
    export_formats = ("eagle3",)
    fc_options = False  # fc_bias and embed_scale are EAGLE-1's
    reads_feature_layers = True

    @classmethod
    def complete_config(cls, config: HeadsConfig, base: CausalLM) -> HeadsConfig:
        """EAGLE-1's completion, and the default fused layers (2, L // 2, L - 3) unless the config names some."""
        config = super().complete_config(config, base)
        if config.feature_layers:
            return config
        return dataclasses.replace(config, feature_layers=default_feature_layers(base.config.num_layers))

    def __init__(self, config: HeadsConfig, rngs: nnx.Rngs, token_map=None):
        HeadsBase.__init__(self, config, [], token_map)
        if not config.feature_layers:
            raise ValueError("an eagle3 drafter needs feature_layers (the base layers it reads)")
        if config.decoder is None:
            raise ValueError("an EAGLE-3 drafter needs HeadsConfig.decoder (init_heads fills it from the base model)")
        if config.num_layers != 1:
            raise ValueError(f"an EAGLE-3 drafter has one decoder layer (the published layout), got "
                             f"{config.num_layers}")
        dtype = resolve_dtype(config.dtype)
        d = config.hidden_size
        self.decoder = config.decoder.replace(num_layers=1, dtype=config.dtype)
        self.fc = nnx.Linear(len(config.feature_layers) * d, d, use_bias=False, dtype=dtype, param_dtype=dtype,
                             rngs=rngs, kernel_init=nnx.initializers.normal(0.02))
        self.layers = nnx.List([Eagle3Layer(self.decoder, rngs)])
        self.norm = RMSNorm(d, self.decoder.rms_norm_eps, dtype)
        self.lm_head = head_lm_head(config, dtype, rngs)

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.config.feature_layers

    def project(self, feats_btf: jax.Array) -> jax.Array:
        """Fused base features [..., f] -> h [..., D] (fc)."""
        return self.fc(feats_btf.astype(self.fc.kernel[...].dtype))

    def pair_inputs(self, h_btd, tokens_bt, base: CausalLM) -> jax.Array:
        dtype = self.fc.kernel[...].dtype
        return jnp.concatenate([base.embed_tokens(tokens_bt).astype(dtype), h_btd.astype(dtype)], -1)

    def logits(self, out_xd: jax.Array, base: CausalLM) -> jax.Array:
        """[..., D] drafter outputs g -> [..., V_head] fp32 draft logits: lm_head(norm(g))."""
        return head_logits(self, self.norm(out_xd), base)

    def teacher_forced_top_k(self, feats_btf, tokens_bt, base: CausalLM, k: int) -> jax.Array:
        """[M, B, T, k]: EAGLE-1's chains drafted from every position, started from fc of the fused taps."""
        return super().teacher_forced_top_k(self.project(feats_btf), tokens_bt, base, k)

    # ---- the tree step's proposer contract: EAGLE-1's, over projected features -------------------------------
    def init_draft(self, base: CausalLM, prompt_bt, prompt_lens_b, feats_btf, cache_size: int,
                   max_depth: int) -> Eagle3DraftState:
        """feats_btf: the fused feature of every prompt position (the prefill's taps)."""
        h_btd = self.project(feats_btf)
        state = super().init_draft(base, prompt_bt, prompt_lens_b, h_btd, cache_size, max_depth)
        root_bd = jnp.take_along_axis(h_btd, (prompt_lens_b - 1)[:, None, None], axis=1)[:, 0]
        return Eagle3DraftState(**{f.name: getattr(state, f.name) for f in dataclasses.fields(state)},
                                root_bd=root_bd.astype(state.pending_feat_bed.dtype))

    def propose(self, hidden_bd, root_b, base: CausalLM, tree, draft: Eagle3DraftState, active_b):
        """EAGLE-1's proposal with the root pair's h = the drafter's kept root feature (hidden_bd is unused)."""
        return super().propose(draft.root_bd, root_b, base, tree, draft, active_b)

    def accepted(self, draft: Eagle3DraftState, feats_btf, tokens_bt, nodes_be, accept_b, active_b):
        """feats_btf: the verify's fused features of every tree node."""
        h_btd = self.project(feats_btf)
        state = super().accepted(draft, h_btd, tokens_bt, nodes_be, accept_b, active_b)
        last_b = jnp.take_along_axis(nodes_be, accept_b[:, None], axis=1)[:, 0]
        root_bd = jnp.take_along_axis(h_btd, last_b[:, None, None], axis=1)[:, 0].astype(draft.root_bd.dtype)
        return dataclasses.replace(state, root_bd=jnp.where(active_b[:, None], root_bd, draft.root_bd))
