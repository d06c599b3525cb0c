"""The one memory estimator: closed-form bytes from a model's shapes, for the trainer's check before it loads
anything (`estimate_run`, `check_fits`) and for the planner's per-device estimate beside a compiled plan
(`estimate_per_device`, `lower_bound`); what each term counts: docs/planning.md, "The analytic estimate"."""

from __future__ import annotations

import dataclasses

import numpy as np

from medusa_jax.inference.autoregressive import prefill_groups
from medusa_jax.model.attention import PREFILL_QUERY_CHUNK, QUERY_CHUNK
from medusa_jax.model.config import ModelConfig, resolve_dtype

GIB = 2**30
OVERHEAD = int(1.5 * GIB)
CONFIG_KEYS = ("hidden_size", "intermediate_size", "vocab_size", "num_hidden_layers", "num_attention_heads")


class MemoryPlanError(ValueError):
    """The run would not fit the memory it may use (the message says what to change)."""


# ---- parameters -----------------------------------------------------------------------------------------

def layer_params(model: ModelConfig, split: int = 1, tensor: int = 1) -> float:
    """Parameters of one decoder layer one device holds: matrices / split, biases / tensor, norms whole."""
    d, h = model.hidden_size, model.head_dim
    q, kv = model.num_heads * h, model.num_kv_heads * h
    per_layer = (d * (q + 2 * kv) + q * d + 3 * d * model.intermediate_size) / split + 2 * d
    if model.attention_bias:
        per_layer += (q + 2 * kv) / tensor
    return per_layer


def backbone_params(model: ModelConfig, split: int = 1, tensor: int = 1) -> float:
    """Parameters of the backbone one device holds: matrices / split, biases / tensor, norms whole (the whole
    model with split = tensor = 1)."""
    embed = model.vocab_size * model.hidden_size / split
    return (model.num_layers * layer_params(model, split, tensor) + embed + model.hidden_size
            + (0 if model.tie_word_embeddings else embed))


def heads_params(model: ModelConfig, num_heads: int, num_layers: int, head_vocab: int | None, split: int = 1,
                 tensor: int = 1) -> float:
    """Parameters of the heads one device holds: each head's ResBlocks ([D, D] over split, bias over tensor) and
    its own lm_head [D, head_vocab] (None: a shared lm_head, no own parameters)."""
    d = model.hidden_size
    return num_heads * (num_layers * (d * d / split + d / tensor) + (d * head_vocab / split if head_vocab else 0))


# ---- a training run on one host -------------------------------------------------------------------------

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


def estimate_run(model: ModelConfig, *, num_heads: int, num_layers: int, head_vocab: int | None, batch_size: int,
                 seq_len: int, cached_batch_size: int, cache_hidden: bool, medusa2: bool, distill_kl: bool,
                 freeze_lm_heads: bool, optimizer_dtype: str = "float32") -> MemoryEstimate:
    """A training run's peak host bytes (module docstring). `head_vocab` is the heads' own output width (None:
    shared lm_head, which computes full-vocabulary logits)."""
    d, f, v = model.hidden_size, model.intermediate_size, model.vocab_size
    base = backbone_params(model)
    blocks = heads_params(model, num_heads, num_layers, None)
    own_lm = heads_params(model, num_heads, 0, head_vocab)
    trainable = blocks + (0 if freeze_lm_heads else own_lm) + (base if medusa2 else 0)
    weights = _bytes(model.dtype) * base * (2 if medusa2 and distill_kl else 1) + 4 * (blocks + own_lm)
    positions = cached_batch_size if cache_hidden else batch_size * seq_len
    logits = 12 * positions * num_heads * (head_vocab or v) + (12 * positions * v if medusa2 else 0)
    backbone = 0
    if not cache_hidden:
        per_layer = 4 * positions * (4 * d + 2 * f)
        scores = 4 * batch_size * model.num_heads * min(seq_len, QUERY_CHUNK) * seq_len  # one query block
        backbone = per_layer * (model.num_layers if medusa2 else 1) + scores
    per_trainable = 4 + 2 * _bytes(optimizer_dtype)  # its float32 gradient and Adam's two moments
    return MemoryEstimate(int(weights), int(per_trainable * trainable), int(logits), int(backbone))


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


# ---- one device of a planned job ------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class DeviceEstimate:
    params: int
    optimizer: int
    kv_cache: int
    activations: int

    @property
    def total(self) -> int:
        return self.params + self.optimizer + self.kv_cache + self.activations


def _bytes(dtype: str) -> int:
    return np.dtype(resolve_dtype(dtype)).itemsize


def estimate_per_device(config) -> DeviceEstimate:
    """Per-device bytes of a `training.plan.PlanConfig` (module docstring)."""
    m, mesh = config.model, config.mesh
    split, tensor, rows = mesh.fsdp * mesh.tensor, mesh.tensor, mesh.data * mesh.fsdp
    dev_rows = config.batch / rows
    heads_dtype = config.heads_dtype if config.job == "train" else m.dtype
    base_params = backbone_params(m, split, tensor)
    own_vocab = m.vocab_size if config.lm_head == "own" else None
    head_params = heads_params(m, config.num_heads, 1, own_vocab, split, tensor)
    params = base_params * _bytes(m.dtype) + head_params * _bytes(heads_dtype)
    vocab_part, mlp_part, heads_part = m.vocab_size / tensor, m.intermediate_size / tensor, m.num_heads / tensor
    if config.job == "decode":
        kv_heads = m.num_kv_heads / tensor
        cache = 2 * m.num_layers * dev_rows * config.cache * kv_heads * m.head_dim * _bytes(m.dtype)
        act = _bytes(m.dtype)
        # the prefill runs its rows in length groups (`grouped_prefill`), each into a fresh cache of its rows
        groups = prefill_groups(config.batch, rows)
        group_rows = dev_rows / groups
        queries = config.seq if config.layers.attention == "xla" else min(config.seq, PREFILL_QUERY_CHUNK)
        prefill = group_rows * (2 * heads_part * queries * config.cache * 4
                                + config.seq * (4 * m.hidden_size + 3 * mlp_part) * act)
        prefill += cache / groups if groups > 1 else 0
        loop = dev_rows * (config.tree_tokens * vocab_part * 4 + config.num_heads * vocab_part * 4)
        return DeviceEstimate(int(params), 0, int(cache), int(max(prefill, loop)))
    trainable = head_params * _bytes(heads_dtype) + (base_params * _bytes(m.dtype) if config.medusa2 else 0)
    optimizer = 2 * (head_params + (base_params if config.medusa2 else 0)) * _bytes(config.optimizer_dtype)
    act = _bytes(config.compute_dtype)
    layers = config.layers
    tokens = dev_rows * config.seq
    # fp32 scores and probabilities of one layer: all T queries (xla), or one block of them (chunked; cudnn's
    # flash tiles are smaller still)
    queries = config.seq if layers.attention == "xla" else min(config.seq, QUERY_CHUNK)
    scores = 2 * dev_rows * heads_part * queries * config.seq * 4
    layer = tokens * (4 * m.hidden_size + 3 * mlp_part) * act + scores  # one layer's working set
    # every head's logits and their gradient (fp32; the softmax is fused into its reductions) at once: XLA
    # schedules the heads side by side; with fsdp > 1 each own lm_head is also held whole, gathered (in the compute
    # dtype) and as its float32 gradient before the reduction. With `loss_chunk`: one chunk of tokens at a time,
    # and XLA then holds one head's lm_head at a time
    head_weights = m.hidden_size * vocab_part * (act + 4) if own_vocab and mesh.fsdp > 1 else 0
    loss_tokens = dev_rows * min(config.seq, config.loss_chunk or config.seq)
    head_logits = config.num_heads * 2 * loss_tokens * vocab_part * 4 + (
        1 if config.loss_chunk else config.num_heads) * head_weights
    if config.medusa2:  # saved for the backward pass, one layer's backward working set, the LM loss's logits
        saved = {"none": tokens * (4 * m.hidden_size + 3 * mlp_part) * act + (scores if queries == config.seq
                                                                               else 0),
                 "full": tokens * m.hidden_size * act,
                 "dots": tokens * (3 * m.hidden_size + 3 * mlp_part) * act}[layers.remat]
        backbone = m.num_layers * saved + 2 * layer + 2 * loss_tokens * vocab_part * 4
    else:
        backbone = layer
    gathered = 0
    if mesh.fsdp > 1 and layers.scan:  # two layers gathered at once (one in use, the next one arriving) and the
        # base lm_head where the step reads it (Medusa-2's LM loss, shared heads); the embedding's lookup reads
        # its rows where they are stored, and the heads' own lm_heads are counted with their logits
        whole = lambda params: params * mesh.fsdp * act
        lm_head = m.hidden_size * vocab_part / mesh.fsdp if config.medusa2 or not own_vocab else 0
        gathered = 2 * whole(layer_params(m, split, tensor)) + whole(lm_head)
    elif mesh.fsdp > 1:
        gathered = (base_params + head_params) * (mesh.fsdp - 1) * act
    return DeviceEstimate(int(params), int(optimizer),
                          0, int(trainable + backbone + head_logits + gathered))


def lower_bound(config) -> int:
    """Bytes a device must hold at once whatever the compiler does: parameters, optimiser state and KV cache,
    plus (train) every trainable gradient, since the global-norm clip reads all of them before any update."""
    est = estimate_per_device(config)
    if config.job != "train":
        return est.params + est.optimizer + est.kv_cache
    m, split, tensor = config.model, config.mesh.fsdp * config.mesh.tensor, config.mesh.tensor
    own_vocab = m.vocab_size if config.lm_head == "own" else None
    gradients = heads_params(m, config.num_heads, 1, own_vocab, split, tensor) * _bytes(config.heads_dtype) + (
        backbone_params(m, split, tensor) * _bytes(m.dtype) if config.medusa2 else 0)
    return int(est.params + est.optimizer + est.kv_cache + gradients)
