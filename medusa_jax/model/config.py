"""Backbone configuration for the Llama family (Llama, Mistral, Qwen2) and its HF round trip."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


class UnsupportedModelError(ValueError):
    """The HF config describes an architecture this backbone does not implement."""


def resolve_dtype(name_or_dtype: Any) -> Any:
    """'float32' | 'bfloat16' | 'float16' | a jnp dtype -> a jnp dtype."""
    if isinstance(name_or_dtype, str):
        if name_or_dtype not in _DTYPES:
            raise ValueError(f"unknown dtype {name_or_dtype!r}; expected one of {sorted(_DTYPES)}")
        return _DTYPES[name_or_dtype]
    return jnp.dtype(name_or_dtype).type


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. `rope_type` is 'default' or 'llama3' (Llama 3.1 style)."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


REMAT_POLICIES = ("none", "full", "dots")
ATTENTION_KINDS = ("chunked", "xla", "cudnn")


@dataclasses.dataclass(frozen=True)
class LayerExecution:
    """How the decoder layers run (`medusa_jax.model.layer_stack`; `backbone.with_layer_execution` converts a model
    between the settings): scan and remat for a cache-free forward (training's packed rows), scan and attention
    for the cache paths (prefill, decode, tree verify) too.

    scan       False: the layers stored one by one and unrolled; True: stored stacked ([L, ...] parameters) and
               run by one `jax.lax.scan` (FSDP gathers one layer at a time, the program holds one layer)
    remat      what the backward pass keeps of each layer: "none" everything (fastest, most memory), "full" only
               the layer's input (the layer is recomputed), "dots" the matrix products' outputs
    attention  "chunked" (queries in blocks, scores recomputed for the backward: no [B, heads, T, T] tensor is
               kept; over a cache: blocks of a prefill's prompt, decode and verify are one block), "xla" /
               "cudnn" (`jax.nn.dot_product_attention` with that implementation; cudnn: fused flash attention
               on NVIDIA GPUs, bf16/fp16 only); `model.attention`
    """

    scan: bool = False
    remat: str = "none"
    attention: str = "chunked"

    def __post_init__(self):
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"remat must be one of {REMAT_POLICIES}, got {self.remat!r}")
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(f"attention must be one of {ATTENTION_KINDS}, got {self.attention!r}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Everything the backbone needs to know about a Llama-family model."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections have a bias (Qwen2)
    sliding_window: int | None = None  # Mistral: keys older than this many positions are masked
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "float32"  # parameter and compute dtype; norms and softmax always run in fp32
    execution: LayerExecution = LayerExecution()  # how a cache-free forward runs the layers (not an HF field)

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        resolve_dtype(self.dtype)

    @property
    def jnp_dtype(self):
        return resolve_dtype(self.dtype)

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    # ---- HF round trip -------------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, hf: dict[str, Any], dtype: str = "float32") -> "ModelConfig":
        """Builds a config from a HF `config.json` dict (transformers 4 or 5 spelling)."""
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(f"unsupported model_type {model_type!r}; medusa-jax supports "
                                        f"{list(SUPPORTED_MODEL_TYPES)}")
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            if key not in hf:
                raise ValueError(f"config.json lacks required field {key!r}")
        if hf.get("hidden_act", "silu") not in ("silu", "swish"):
            raise UnsupportedModelError(f"unsupported hidden_act {hf['hidden_act']!r}; only 'silu' is implemented")
        if hf.get("mlp_bias"):
            raise UnsupportedModelError("mlp_bias=True is not supported")
        num_heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
        # transformers 5 keeps rope settings in `rope_parameters`; 4.x in `rope_theta` + `rope_scaling`.
        rope = dict(hf.get("rope_scaling") or {})
        rope.update(hf.get("rope_parameters") or {})
        rope_theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default")) or "default"
        if rope_type not in ("default", "llama3"):
            raise UnsupportedModelError(f"unsupported rope_type {rope_type!r}; expected 'default' or 'llama3'")
        scaling = RopeScaling()
        if rope_type == "llama3":
            scaling = RopeScaling("llama3", float(rope["factor"]), float(rope.get("low_freq_factor", 1.0)),
                                  float(rope.get("high_freq_factor", 4.0)),
                                  int(rope.get("original_max_position_embeddings", 8192)))
        if model_type == "qwen2":
            attention_bias = True
            sliding = hf.get("sliding_window") if hf.get("use_sliding_window") else None
        else:
            attention_bias = bool(hf.get("attention_bias", False))
            sliding = hf.get("sliding_window")
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
        return cls(model_type=model_type, vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
                   intermediate_size=hf["intermediate_size"], num_layers=hf["num_hidden_layers"], num_heads=num_heads,
                   num_kv_heads=hf.get("num_key_value_heads") or num_heads, head_dim=head_dim,
                   rms_norm_eps=hf.get("rms_norm_eps", 1e-6), rope_theta=float(rope_theta), rope_scaling=scaling,
                   max_position_embeddings=hf.get("max_position_embeddings", 2048),
                   tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)), attention_bias=attention_bias,
                   sliding_window=sliding, bos_token_id=hf.get("bos_token_id"), eos_token_ids=eos_ids, dtype=dtype)

    def to_hf_config(self) -> dict[str, Any]:
        """The inverse of `from_hf_config` (transformers 5 spelling, with `rope_theta` kept for 4.x)."""
        rope: dict[str, Any] = {"rope_type": self.rope_scaling.rope_type, "rope_theta": self.rope_theta}
        if self.rope_scaling.rope_type == "llama3":
            rope.update({k: v for k, v in dataclasses.asdict(self.rope_scaling).items() if k != "rope_type"})
        arch = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
        out: dict[str, Any] = {
            "model_type": self.model_type, "architectures": [arch[self.model_type]], "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim, "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta, "rope_parameters": rope,
            "max_position_embeddings": self.max_position_embeddings, "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0]}
        if self.model_type == "qwen2":
            out["use_sliding_window"] = self.sliding_window is not None
            out["sliding_window"] = self.sliding_window
        else:
            out["attention_bias"] = self.attention_bias
            if self.model_type == "mistral":
                out["sliding_window"] = self.sliding_window
        return out
