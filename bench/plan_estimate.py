"""A closed-form estimate of per-device memory, beside the compiled plan (`medusa_jax.bench.plan`).

Counts from the model's shapes and the mesh (data d, fsdp f, tensor t) alone, following the layouts of
`medusa_jax.model.sharding`: weight matrices split over f x t, norms replicated, biases over t; the KV cache
[L, B, S, K, H] split over rows (d x f) and KV heads (t); Adam's two moments like their parameters.
Activations are the largest working sets, not a full liveness analysis:
  decode  prefill: one layer's attention scores and probabilities (fp32) and MLP activations of the prompt;
          loop: the tree's base logits and the heads' logits (fp32)
  train   each head's logits, rematerialised one head at a time (forward + gradient, fp32); the backbone's
          forward one layer at a time (Medusa-1: nothing is kept for the backward pass), or every layer's
          saved activations and the backbone's gradients (Medusa-2); the trainable parameters' gradients;
          with fsdp > 1 the weights gathered over fsdp, all of them (XLA's CPU schedule keeps every gathered
          weight live; a GPU schedule may hold fewer at once, so this side is pessimistic).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from medusa_jax.model.config import resolve_dtype


@dataclasses.dataclass(frozen=True)
class Estimate:
    params: int
    optimizer: int
    kv_cache: int
    activations: int

    @property
    def total(self) -> int:
        return self.params + self.optimizer + self.kv_cache + self.activations


def _bytes(dtype: str) -> int:
    return np.dtype(resolve_dtype(dtype)).itemsize


def backbone_params(model, split: int, tensor: int) -> float:
    """Parameters one device holds of the backbone (matrices / split, biases / tensor, norms whole)."""
    d, h = model.hidden_size, model.head_dim
    q, kv = model.num_heads * h, model.num_kv_heads * h
    per_layer = (d * (q + 2 * kv) + q * d + 3 * d * model.intermediate_size) / split + 2 * d
    if model.attention_bias:
        per_layer += (q + 2 * kv) / tensor
    embed = model.vocab_size * d / split
    return model.num_layers * per_layer + embed + d + (0 if model.tie_word_embeddings else embed)


def heads_params(model, num_heads: int, lm_head: str, split: int, tensor: int) -> float:
    d = model.hidden_size
    per_head = d * d / split + d / tensor + (d * model.vocab_size / split if lm_head == "own" else 0)
    return num_heads * per_head


def estimate(config) -> Estimate:
    """Per-device bytes for a `plan.PlanConfig`."""
    m, mesh = config.model, config.mesh
    split, t, rows = mesh.fsdp * mesh.tensor, mesh.tensor, mesh.data * mesh.fsdp
    dev_rows = config.batch / rows
    heads_dtype = config.heads_dtype if config.job == "train" else m.dtype
    base_params = backbone_params(m, split, t)
    head_params = heads_params(m, config.num_heads, config.lm_head, split, t)
    params = base_params * _bytes(m.dtype) + head_params * _bytes(heads_dtype)
    vocab_part, mlp_part, heads_part = m.vocab_size / t, m.intermediate_size / t, m.num_heads / t
    if config.job == "decode":
        cache = 2 * m.num_layers * dev_rows * config.cache * (m.num_kv_heads / t) * m.head_dim * _bytes(m.dtype)
        act = _bytes(m.dtype)
        prefill = dev_rows * (2 * heads_part * config.seq * config.cache * 4
                              + config.seq * (4 * m.hidden_size + 3 * mlp_part) * act)
        loop = dev_rows * (config.tree_tokens * vocab_part * 4 + config.num_heads * vocab_part * 4)
        return Estimate(int(params), 0, int(cache), int(max(prefill, loop)))
    trainable = head_params * _bytes(heads_dtype) + (base_params * _bytes(m.dtype) if config.medusa2 else 0)
    act = _bytes(config.compute_dtype)
    tokens = dev_rows * config.seq
    scores = 2 * dev_rows * heads_part * config.seq * config.seq * 4  # fp32 scores and probabilities of one layer
    layer = tokens * (4 * m.hidden_size + 3 * mlp_part) * act + scores
    head_logits = 3 * tokens * vocab_part * 4  # logits, softmax and their gradient, one head at a time
    if config.medusa2:  # saved for the backward pass, one layer's backward working set, the LM loss's logits
        backbone = (m.num_layers + 1) * layer + 2 * tokens * vocab_part * 4
    else:
        backbone = layer
    gathered = (base_params + head_params) * (mesh.fsdp - 1) * act if mesh.fsdp > 1 else 0
    return Estimate(int(params), int(2 * trainable), 0, int(trainable + backbone + head_logits + gathered))


def lower_bound(config) -> int:
    """Bytes a device must hold at once whatever the compiler does: parameters, optimiser state and KV cache,
    plus (train) every trainable gradient, since the global-norm clip reads all of them before any update."""
    est = estimate(config)
    return est.params + est.optimizer + est.kv_cache + est.optimizer // 2
