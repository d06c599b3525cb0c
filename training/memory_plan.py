"""Peak-memory estimate of a training run, checked before the model is loaded.

The estimate (bytes; float32 everywhere, as the trainer stores weights and optimiser state):
  weights      4 x (backbone parameters + head parameters), + 4 x backbone for the frozen reference of
               --distill-kl
  optimizer    12 x trainable parameters: the gradient and AdamW's two moments (the heads; the backbone too
               with --medusa2; not the lm_heads with --freeze-lm-heads)
  logits       12 x P x K x V_head: P positions per step (--batch-size x --seq-len, or --cached-batch-size),
               K heads, V_head = the head's output width (the full vocabulary for own/shared lm_heads, N for
               truncated:N); three float32 [P, V_head] blocks per head (logits, softmax, gradient) live at
               once, for all heads together (XLA on CPU schedules the heads side by side). With --medusa2 the
               backbone's own logits add 12 x P x V.
  backbone     frozen backbone in the step: 4 x P x (4 D + 2 F) for one layer's activations plus one layer's
               attention scores 4 x B x heads x T x T; with --medusa2 every layer's activations are kept for
               the backward pass (x layers).
  overhead     1.5 GiB: the Python process, XLA, tokenizer and data.
Checked against measured peaks (VmHWM) on SmolLM2-135M at 8 x 1,024 positions: own lm_heads over 49,152
tokens peaked at 23.9 GB (22.3 GiB; estimate 22.2 GiB), the default truncated:3072 at 3.3 GiB (estimate 3.7).
"""

from __future__ import annotations

import dataclasses
from typing import Any

GIB = 2**30
OVERHEAD = int(1.5 * GIB)
CONFIG_KEYS = ("hidden_size", "intermediate_size", "vocab_size", "num_hidden_layers", "num_attention_heads")


class MemoryPlanError(ValueError):
    """The run would not fit the memory it may use (the message says what to change)."""


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    weights: int
    optimizer: int
    logits: int
    backbone: int
    overhead: int = OVERHEAD

    @property
    def total(self) -> int:
        return self.weights + self.optimizer + self.logits + self.backbone + self.overhead

    def describe(self) -> str:
        parts = ", ".join(f"{name} {getattr(self, name) / GIB:.1f}" for name in
                          ("weights", "optimizer", "logits", "backbone", "overhead"))
        return f"{self.total / GIB:.1f} GiB ({parts})"


def backbone_params(hf: dict[str, Any]) -> tuple[int, int]:
    """(parameters, lm_head parameters) of a Llama-family model from its HF config."""
    d, f, v, layers = hf["hidden_size"], hf["intermediate_size"], hf["vocab_size"], hf["num_hidden_layers"]
    n = hf["num_attention_heads"]
    kv = hf.get("num_key_value_heads") or n
    h = hf.get("head_dim") or d // n
    per_layer = d * n * h * 2 + d * kv * h * 2 + 3 * d * f + 2 * d
    lm_head = 0 if hf.get("tie_word_embeddings", False) else d * v
    return v * d + layers * per_layer + d + lm_head, lm_head


def estimate(hf: dict[str, Any], *, num_heads: int, num_layers: int, head_vocab: int | None, batch_size: int,
             seq_len: int, cached_batch_size: int, cache_hidden: bool, medusa2: bool, distill_kl: bool,
             freeze_lm_heads: bool) -> MemoryEstimate:
    """`head_vocab` is the heads' own output width (None: shared lm_head, which computes full-vocabulary logits)."""
    d, f, v = hf["hidden_size"], hf["intermediate_size"], hf["vocab_size"]
    base, _ = backbone_params(hf)
    blocks = num_heads * num_layers * (d * d + d)
    own_lm = num_heads * d * head_vocab if head_vocab else 0
    trainable = blocks + (0 if freeze_lm_heads else own_lm) + (base if medusa2 else 0)
    weights = 4 * (base + blocks + own_lm + (base if medusa2 and distill_kl else 0))
    positions = cached_batch_size if cache_hidden else batch_size * seq_len
    logits = 12 * positions * num_heads * (head_vocab or v) + (12 * positions * v if medusa2 else 0)
    backbone = 0
    if not cache_hidden:
        per_layer = 4 * positions * (4 * d + 2 * f)
        scores = 4 * batch_size * hf["num_attention_heads"] * seq_len * seq_len
        backbone = per_layer * (hf["num_hidden_layers"] if medusa2 else 1) + scores
    return MemoryEstimate(weights, 12 * trainable, logits, backbone)


def available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (None where there is none)."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_fits(plan: MemoryEstimate, limit_gib: float | None, cache_hidden: bool, lm_head: str,
               medusa2: bool) -> None:
    """Refuses a run whose estimate exceeds --memory-limit GiB (default: the host's available memory)."""
    if limit_gib == 0:
        return
    limit = int(limit_gib * GIB) if limit_gib is not None else available_bytes()
    where = "--memory-limit" if limit_gib is not None else "available memory (/proc/meminfo MemAvailable)"
    if limit is None or plan.total <= limit:
        return
    advice = []
    if not lm_head.startswith("truncated"):
        advice.append("--lm-head truncated:3072 (heads over the 3,072 most frequent reply tokens)")
    if not cache_hidden and not medusa2:
        advice.append("--cache-hidden (train the heads on cached hidden states)")
    advice.append("a smaller --cached-batch-size" if cache_hidden else "a smaller --batch-size or --seq-len")
    raise MemoryPlanError(f"this run needs about {plan.describe()} at its peak, more than the {limit / GIB:.1f} GiB "
                          f"of {where}; use {', or '.join(advice)} (or --memory-limit 0 to skip this check)")


def check_cache_fits(cache_bytes: int, limit_gib: float | None) -> None:
    """--cache-hidden: the hidden states of every training position (float16) are held in memory."""
    if limit_gib == 0:
        return
    limit = int(limit_gib * GIB) if limit_gib is not None else available_bytes()
    if limit is not None and cache_bytes + OVERHEAD > limit:
        raise MemoryPlanError(f"--cache-hidden would hold {cache_bytes / GIB:.1f} GiB of hidden states in memory, "
                              f"more than the {limit / GIB:.1f} GiB available: use fewer conversations "
                              f"(--max-conversations) or drop --cache-hidden")
