"""The configuration of a set of draft heads: how many, how deep, which lm_head mode, which head type.

The lm_head modes (see `heads.medusa`): own (a [D, V] projection per head), shared (the base lm_head), truncated
(a [D, Vt] projection over the Vt most frequent tokens, with a token map). `head_type` names a drafter kind of
`heads.kinds.DRAFTERS`, the one table a new kind joins (and whose class checks what is particular to it).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from medusa_jax.model.config import ModelConfig, resolve_dtype

LM_HEAD_MODES = ("own", "shared", "truncated")
HYDRA_INPUTS = ("concat", "add")


@dataclasses.dataclass(frozen=True)
class HeadsConfig:
    hidden_size: int
    vocab_size: int
    num_heads: int = 4
    num_layers: int = 1
    lm_head: str = "own"  # one of LM_HEAD_MODES
    truncated_vocab_size: int | None = None  # only for lm_head == "truncated"
    dtype: str = "float32"
    base_model_name_or_path: str = ""
    head_type: str = "medusa"  # a drafter kind of heads.kinds.DRAFTERS (medusa, hydra, eagle, ...)
    hydra_input: str = "add"  # hydra only: how a head combines h and its path embeddings (heads/hydra.py)
    # eagle only: the drafter's decoder layers (the base's architecture; num_layers of them; heads.init fills it
    # from the base when None). For an EAGLE drafter num_heads is the deepest tree it drafts for (it drafts
    # autoregressively: any depth works).
    decoder: ModelConfig | None = None
    fc_bias: bool = False  # eagle only: the input fc has a bias (the EAGLE authors' default; their published drafts)
    # eagle only: the token embedding is multiplied by this before fc (heads.eagle_init: the feature's RMS over the
    # embedding's, so both inputs of fc start at one scale); an export folds it into fc's embedding columns
    embed_scale: float = 1.0
    # eagle3 only: the base layers whose INPUT (the residual stream before layer i) the drafter fuses (low, mid,
    # high); the base's own forward returns them beside its final hidden state (model.backbone.CausalLM.forward_taps)
    feature_layers: tuple[int, ...] = ()

    def __post_init__(self):
        if self.hydra_input not in HYDRA_INPUTS:
            raise ValueError(f"hydra_input must be one of {HYDRA_INPUTS}, got {self.hydra_input!r}")
        if self.num_heads < 1 or self.num_layers < 0:
            raise ValueError(f"need num_heads >= 1 and num_layers >= 0, got {self.num_heads}, {self.num_layers}")
        if self.lm_head not in LM_HEAD_MODES:
            raise ValueError(f"lm_head must be one of {LM_HEAD_MODES}, got {self.lm_head!r}")
        if self.lm_head == "truncated":
            if not self.truncated_vocab_size or not 0 < self.truncated_vocab_size <= self.vocab_size:
                raise ValueError(f"lm_head='truncated' needs 0 < truncated_vocab_size <= {self.vocab_size}, "
                                 f"got {self.truncated_vocab_size}")
        elif self.truncated_vocab_size is not None:
            raise ValueError("truncated_vocab_size is only meaningful with lm_head='truncated'")
        if not (self.embed_scale > 0 and self.embed_scale < float("inf")):
            raise ValueError(f"embed_scale must be a positive finite number, got {self.embed_scale}")
        resolve_dtype(self.dtype)

    @property
    def head_vocab_size(self) -> int:
        return self.truncated_vocab_size if self.lm_head == "truncated" else self.vocab_size

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        del d["decoder"]
        if self.head_type == HeadsConfig.head_type:  # the default kind's configs (and run signatures) stay as
            # they were before other kinds existed
            del d["head_type"], d["hydra_input"]
        if self.decoder is not None:
            d["decoder"] = self.decoder.to_hf_config()
        for field, unset in (("fc_bias", False), ("feature_layers", ()), ("embed_scale", 1.0)):
            if d[field] == unset:  # written only when set (earlier configs stay as they were)
                del d[field]
        if self.feature_layers:
            d["feature_layers"] = list(self.feature_layers)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "HeadsConfig":
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - fields)
        if unknown:
            raise ValueError(f"unknown heads config fields {unknown}")
        d = dict(d)
        if d.get("decoder") is not None:
            d["decoder"] = ModelConfig.from_hf_config(d["decoder"], dtype=d.get("dtype", "float32"))
        if "feature_layers" in d:
            d["feature_layers"] = tuple(int(i) for i in d["feature_layers"])
        return cls(**d)
