"""AOT memory plans: the project's real train step or Medusa decode loop (`Trainer.jitted_step`,
`ShardedModel.medusa_decode`) lowered and compiled on abstract inputs (`nnx.eval_shape`; ShapeDtypeStructs with
the shardings of `model.sharding`) for a mesh of forced host devices: XLA's `memory_analysis()` gives the bytes
per device, the optimised HLO the collectives; nothing is allocated. What the figures mean: docs/planning.md."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from medusa_jax.hf.load import read_hf_config
from medusa_jax.model.backbone import CausalLM
from medusa_jax.model.config import LayerExecution, ModelConfig
from medusa_jax.model.sharding import MeshConfig, MeshError
from medusa_jax.heads.config import HeadsConfig
from medusa_jax.trees.dynamic_tree import scratch_slots
from medusa_jax.heads.init import init_heads
from medusa_jax.heads.medusa import MedusaHeads
from medusa_jax.trees.tree import load_tree
from medusa_jax.inference.sharded import ShardedModel
from medusa_jax.training.trainer import TrainConfig, Trainer
from medusa_jax.training import hlo_collectives as hc

JOBS = ("train", "decode")

# ---- well-known Llama-family shapes from their public HF config.json files -------------------------------------
# Only the fields ModelConfig.from_hf_config reads; values as published by the model authors.
PRESETS: dict[str, dict] = {
    "llama3-8b": {  # meta-llama/Meta-Llama-3-8B
        "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "max_position_embeddings": 8192, "tie_word_embeddings": False,
        "bos_token_id": 128000, "eos_token_id": 128001},
    "llama3-70b": {  # meta-llama/Meta-Llama-3-70B
        "model_type": "llama", "vocab_size": 128256, "hidden_size": 8192, "intermediate_size": 28672,
        "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "max_position_embeddings": 8192, "tie_word_embeddings": False,
        "bos_token_id": 128000, "eos_token_id": 128001},
    "mistral-7b": {  # mistralai/Mistral-7B-v0.1
        "model_type": "mistral", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "max_position_embeddings": 32768, "sliding_window": 4096,
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2},
    "qwen2-7b": {  # Qwen/Qwen2-7B
        "model_type": "qwen2", "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
        "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "max_position_embeddings": 131072, "use_sliding_window": False,
        "sliding_window": 131072, "tie_word_embeddings": False, "bos_token_id": 151643, "eos_token_id": 151643},
}


def model_config(name_or_folder: str | os.PathLike, dtype: str = "bfloat16") -> ModelConfig:
    """A preset name (see PRESETS) or a folder holding a HF config.json -> ModelConfig in `dtype`."""
    if str(name_or_folder) in PRESETS:
        return ModelConfig.from_hf_config(PRESETS[str(name_or_folder)], dtype=dtype)
    folder = Path(name_or_folder)
    if not (folder / "config.json").is_file():
        raise ValueError(f"--model {str(name_or_folder)!r} is neither a preset ({', '.join(PRESETS)}) nor a folder "
                         f"with a config.json")

    return ModelConfig.from_hf_config(read_hf_config(folder), dtype=dtype)


@dataclasses.dataclass(frozen=True)
class PlanConfig:
    """One job to plan. Train: `batch` packed rows of `seq` tokens. Decode: `batch` prompts of `seq` tokens,
    a KV cache of `cache` slots (the prompt, the new tokens and the tree's scratch block) and tree `tree`."""

    model: ModelConfig  # its dtype is the weights' storage dtype
    mesh: MeshConfig
    job: str = "decode"
    batch: int = 8
    seq: int = 1024
    cache: int = 2048
    tree: str = "mc_sim_7b_63"
    num_heads: int = 4
    lm_head: str = "own"  # the heads' lm_head mode (heads.LM_HEAD_MODES; truncated is not planned)
    medusa2: bool = False
    compute_dtype: str = "bfloat16"  # train only: the dtype the step computes in
    heads_dtype: str = "float32"  # train: heads are trained in float32; decode uses the model's dtype
    # train: the backbone's scan, remat and attention (train_heads flags); decode: its scan, a stacked model
    # decoding over a stacked KV cache (one scan over the layers per forward, `model.layer_stack.run_cached_layers`),
    # and the attention of prefill and verify (`model.attention.cache_attention`)
    layers: LayerExecution = LayerExecution()
    loss_chunk: int = 0  # train: tokens per chunk of the vocabulary-wide losses (TrainConfig.loss_chunk)
    optimizer_dtype: str = "float32"  # train: storage dtype of Adam's moments (TrainConfig.optimizer_dtype)

    def __post_init__(self):
        if self.job not in JOBS:
            raise ValueError(f"job must be one of {JOBS}, got {self.job!r}")
        if self.lm_head not in ("own", "shared"):
            raise ValueError(f"lm_head must be 'own' or 'shared' for planning, got {self.lm_head!r}")
        for name in ("batch", "seq", "cache", "num_heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        rows = self.mesh.data * self.mesh.fsdp
        if self.batch % rows:
            raise MeshError(f"batch {self.batch} is not divisible by mesh axes data x fsdp = {rows}")
        positions = self.model.max_position_embeddings
        if self.seq > positions:
            raise ValueError(f"--seq {self.seq}: the model has {positions} positions; plan at most that")
        if self.job == "decode" and self.cache > positions + 4096:
            raise ValueError(f"--cache {self.cache}: the model has {positions} positions (plus the tree's scratch "
                             f"slots); plan fewer cache slots")
        if self.job == "decode" and self.layers.remat != "none":
            raise ValueError(f"--remat {self.layers.remat}: it sets what training's backward pass keeps; a decode "
                             f"plan takes only --scan-layers and --attention")
        if self.job == "decode" and self.max_new_tokens < 1:
            raise ValueError(f"cache {self.cache} leaves no room for new tokens after a {self.seq}-token prompt "
                             f"and the tree's {self.tree_tokens} scratch slots")

    @property
    def tree_tokens(self) -> int:
        return scratch_slots(load_tree(self.tree))  # the verified tree tokens (a dynamic tree's may need more)

    @property
    def max_new_tokens(self) -> int:
        return self.cache - self.seq - self.tree_tokens

    def replace(self, **changes) -> "PlanConfig":
        return dataclasses.replace(self, **changes)

    def heads_config(self) -> HeadsConfig:
        dtype = self.heads_dtype if self.job == "train" else self.model.dtype
        return HeadsConfig(self.model.hidden_size, self.model.vocab_size, self.num_heads, 1, self.lm_head,
                           dtype=dtype)


@dataclasses.dataclass(frozen=True)
class CollectiveCount:
    kind: str  # one of hlo_collectives.COLLECTIVES
    count: int
    bytes: int  # summed result bytes per device


@dataclasses.dataclass(frozen=True)
class CompiledPlan:
    """Per-device bytes of one compiled program, and its collectives."""

    config: PlanConfig
    arguments: dict[str, int]  # params, optimizer, kv_cache, batch (per device, from the input shardings)
    argument_bytes: int  # XLA's figure: the arguments the program reads (at most the sum of `arguments`)
    output_bytes: int
    alias_bytes: int  # outputs written into donated arguments
    temp_bytes: int
    # collectives as run (a scan body's once per iteration): train: the whole step; decode: one verify step (the loop
    # body), and once_collectives outside the loop (prefill); train: empty
    collectives: tuple[CollectiveCount, ...]
    once_collectives: tuple[CollectiveCount, ...]
    invariant_gathers: tuple[str, ...]  # decode: weights all-gathered at every loop step (should be empty)
    replicated_optimizer_bytes: int  # optimiser bytes (leaves over 1 KiB) held whole on every device
    cpu_upcast_bytes: int  # float32 copies of bf16 weights that only the CPU compiler makes (hlo_collectives)
    cpu_loop_upcast_bytes: int = 0  # such copies made inside a loop or branch (the largest set of one computation)

    @property
    def total_bytes(self) -> int:
        """XLA's figure for this (CPU) compilation, with every argument resident: jit drops arguments the
        program never reads (Medusa-1's base lm_head) from XLA's count, but the device still holds them."""
        resident = max(self.argument_bytes, sum(self.arguments.values()))
        return resident + self.output_bytes - self.alias_bytes + self.temp_bytes

    @property
    def device_temp_bytes(self) -> int:
        return max(self.temp_bytes - self.cpu_upcast_bytes - self.cpu_loop_upcast_bytes, 0)

    @property
    def device_bytes(self) -> int:
        """The per-device peak on a GPU/TPU: XLA's total without the CPU-only weight upcasts."""
        return self.total_bytes - self.temp_bytes + self.device_temp_bytes

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["config"] = {k: v for k, v in out["config"].items() if k not in ("model", "mesh")}
        out["config"].update(model=dataclasses.asdict(self.config.model), mesh=dataclasses.asdict(self.config.mesh))
        out.update(total_bytes=self.total_bytes, device_temp_bytes=self.device_temp_bytes,
                   device_bytes=self.device_bytes)
        return out


def _device_bytes(tree) -> int:
    """Bytes one device holds of a pytree of ShapeDtypeStructs with shardings (the largest shard)."""
    return sum(int(np.prod(leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape,
                           dtype=np.int64)) * _itemsize(leaf.dtype) for leaf in jax.tree.leaves(tree))


def _itemsize(dtype) -> int:
    return 8 if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key) else np.dtype(dtype).itemsize  # a key: 2 uint32


def _mesh(config: PlanConfig):
    devices = jax.devices()
    if len(devices) < config.mesh.size:
        raise MeshError(f"mesh {config.mesh.shape} needs {config.mesh.size} devices, only {len(devices)}: run with "
                        f"XLA_FLAGS=--xla_force_host_platform_device_count={config.mesh.size} (scripts/plan.py "
                        f"sets it)")
    return config.mesh.make_mesh(devices[: config.mesh.size])


def abstract_models(config: PlanConfig) -> tuple[CausalLM, MedusaHeads]:
    """The backbone and heads as shapes only (nnx.eval_shape: no parameter is allocated). A decode plan's backbone
    is built in the layout it decodes in (stacked for `layers.scan`, as `load_pretrained(layers=...)` loads it);
    the train step stacks its layers itself (`Trainer`)."""
    model = config.model.replace(execution=planned_layers(config.layers)) if config.job == "decode" else config.model
    base = nnx.eval_shape(lambda: CausalLM(model, nnx.Rngs(0)))
    heads = nnx.eval_shape(lambda: MedusaHeads(config.heads_config(), nnx.Rngs(0)))
    return base, heads


def planned_layers(layers: LayerExecution) -> LayerExecution:
    """`layers` as the CPU compiler can plan them: it has no cuDNN, so the flash kernel is planned as chunked
    attention (neither keeps a [B, heads, T, T] tensor)."""
    return dataclasses.replace(layers, attention="chunked") if layers.attention == "cudnn" else layers


def train_config(config: PlanConfig, planned: bool = True) -> TrainConfig:
    """The TrainConfig of a planned train job (`planned`: as the CPU compiler can plan it, `planned_layers`)."""
    layers = planned_layers(config.layers) if planned else config.layers
    return TrainConfig(medusa2=config.medusa2, compute_dtype=config.compute_dtype, head_lr_multiplier=4.0
                       if config.medusa2 else 1.0, layers=layers, loss_chunk=config.loss_chunk,
                       optimizer_dtype=config.optimizer_dtype)


def lower_train(config: PlanConfig):
    """(lowered train step, argument groups) of `Trainer.jitted_step` on abstract state and batch."""
    mesh = _mesh(config)
    base, heads = abstract_models(config)
    trainer = Trainer(base, heads, train_config(config), mesh, abstract=True)
    rows = jax.ShapeDtypeStruct((config.batch, config.seq), np.int32)
    batch = {"tokens": rows, "segment_ids": rows, "positions": rows,
             "loss_mask": jax.ShapeDtypeStruct((config.batch, config.seq), np.bool_)}
    batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s)
             for (k, v), s in zip(batch.items(), trainer._batch_shardings(batch).values())}
    lowered = trainer.jitted_step(batch).lower(trainer.params, trainer.opt_state, trainer.frozen, batch)
    groups = {"params": {"trainable": trainer.params, "frozen": trainer.frozen}, "optimizer": trainer.opt_state,
              "kv_cache": {}, "batch": batch}
    return lowered, groups


def lower_decode(config: PlanConfig):
    """(lowered Medusa decode loop, argument groups) of `ShardedModel.medusa_decode` on abstract inputs."""
    mesh = _mesh(config)
    base, heads = abstract_models(config)
    model = ShardedModel(base, heads, mesh)
    tree = load_tree(config.tree, num_heads=config.num_heads, max_top_k=config.model.vocab_size)
    prompt_bt = np.broadcast_to(np.int32(0), (config.batch, config.seq))  # shape only: nothing allocated
    lowered = model.medusa_decode(prompt_bt, prompt_bt[:, 0], tree=tree, cache_size=config.cache,
                                  max_new_tokens=config.max_new_tokens, lowered_only=True)
    cache, prompts, lengths, key = model.abstract_inputs(config.batch, config.seq, config.cache)
    groups = {"params": model.medusa_params, "optimizer": {}, "kv_cache": cache, "batch": (prompts, lengths, key)}
    return lowered, groups


def random_packed_batch(vocab_size: int, rows: int, seq: int, seed: int = 0) -> dict[str, np.ndarray]:
    """A train batch of `rows` packed rows of `seq` random tokens, one conversation each, every token in the loss:
    the shapes a step is measured with."""
    shape = (rows, seq)
    return {"tokens": np.random.default_rng(seed).integers(0, vocab_size, shape).astype(np.int32),
            "segment_ids": np.ones(shape, np.int32),
            "positions": np.broadcast_to(np.arange(seq, dtype=np.int32), shape).copy(),
            "loss_mask": np.ones(shape, bool)}


def measure_train_step(config: PlanConfig) -> dict[str, int]:
    """One real train step of `config` (random weights and rows, one device: the first accelerator) and what its
    device used: `state` (bytes in use before the step: parameters and optimiser state), `peak` (the runtime's
    high-water mark after it) and `compiled` (the device compiler's own figure for the step, as `CompiledPlan`
    computes it). The models are built on the host, so the peak is the step's, not the initialisation's."""
    device = jax.devices()[0]
    with jax.default_device(jax.devices("cpu")[0]):
        base = CausalLM(config.model, nnx.Rngs(0))
        heads = init_heads(config.heads_config(), base)
    trainer = Trainer(base, heads, train_config(config, planned=False), MeshConfig().make_mesh([device]))
    batch = random_packed_batch(config.model.vocab_size, config.batch, config.seq)
    device_batch = trainer.device_batch(batch)
    memory = trainer.jitted_step(batch).lower(trainer.params, trainer.opt_state, trainer.frozen,
                                              device_batch).compile().memory_analysis()
    state = device.memory_stats()["bytes_in_use"]
    trainer.train_step(batch)
    compiled = (memory.argument_size_in_bytes + memory.output_size_in_bytes - memory.alias_size_in_bytes
                + memory.temp_size_in_bytes)
    return {"state": int(state), "peak": int(device.memory_stats()["peak_bytes_in_use"]), "compiled": int(compiled)}


def _count(collectives) -> tuple[CollectiveCount, ...]:
    by_kind: dict[str, list[int]] = {}
    for c in collectives:
        entry = by_kind.setdefault(c.op, [0, 0])
        entry[0] += 1
        entry[1] += hc.shape_bytes(c.shape)
    return tuple(CollectiveCount(k, n, b) for k, (n, b) in sorted(by_kind.items()))


def _replicated_optimizer_bytes(groups, mesh_size: int) -> int:
    """Bytes of optimiser leaves (over 1 KiB) that every device holds whole on a mesh of more than one device."""
    if mesh_size == 1:
        return 0
    sizes = [(int(np.prod(leaf.shape, dtype=np.int64)) * _itemsize(leaf.dtype), leaf)
             for leaf in jax.tree.leaves(groups["optimizer"])]
    return sum(nbytes for nbytes, leaf in sizes if nbytes > 1024 and leaf.sharding.is_fully_replicated)


def compile_plan(config: PlanConfig, keep_hlo: list | None = None) -> CompiledPlan:
    """Lowers and compiles the job on abstract inputs; reads XLA's memory analysis and collectives."""
    lowered, groups = (lower_train if config.job == "train" else lower_decode)(config)
    compiled = lowered.compile()
    memory = compiled.memory_analysis()
    hlo = compiled.as_text()
    if keep_hlo is not None:
        keep_hlo.append(hlo)
    # as often as each runs: a scan over stacked layers repeats its body's collectives once per layer
    in_loop, once = hc.executed_collectives(hlo)
    if config.job == "decode":
        gathers = tuple(c.shape for c in hc.invariant_gathers(hlo))
    else:  # the train step has no data-dependent loop: everything it runs is the step
        in_loop, once, gathers = in_loop + once, [], ()
    return CompiledPlan(
        config=config, arguments={k: _device_bytes(v) for k, v in groups.items()},
        argument_bytes=int(memory.argument_size_in_bytes), output_bytes=int(memory.output_size_in_bytes),
        alias_bytes=int(memory.alias_size_in_bytes), temp_bytes=int(memory.temp_size_in_bytes),
        collectives=_count(in_loop), once_collectives=_count(once), invariant_gathers=gathers,
        replicated_optimizer_bytes=_replicated_optimizer_bytes(groups, config.mesh.size),
        cpu_upcast_bytes=hc.entry_upcast_bytes(hlo), cpu_loop_upcast_bytes=hc.loop_upcast_bytes(hlo))


# Memory a program may use per device (bytes): what the runtime reports as the device's total.
DEVICES = {
    "h100-80g": 81559 * 2**20,  # nvidia-smi, H100 SXM 80GB
    "h200-141g": 143771 * 2**20,  # nvidia-smi, H200 141GB
    "tpu-v5e-16g": 16 * 2**30,  # v5e: 16 GiB HBM per chip
}


def device_capacity(spec: str) -> tuple[str, int]:
    """'h100-80g' | 'h200-141g' | 'tpu-v5e-16g' | a byte count -> (name, bytes)."""
    if spec in DEVICES:
        return spec, DEVICES[spec]
    if spec.isascii() and spec.isdigit() and int(spec) > 0:
        return f"{int(spec)} bytes", int(spec)
    raise ValueError(f"--device {spec!r}: unknown device; expected one of {', '.join(DEVICES)} or a number of bytes")


def fits(plan: CompiledPlan, capacity: int, headroom: float) -> bool:
    """The plan fits when it leaves `headroom` (a fraction) of the device free for the runtime."""
    return plan.device_bytes <= capacity * (1.0 - headroom)


def largest_batch(config: PlanConfig, capacity: int, headroom: float, first: CompiledPlan | None = None,
                  max_compiles: int = 6, log=lambda msg: None) -> tuple[int | None, list[CompiledPlan]]:
    """The largest batch (a multiple of data x fsdp) whose compiled plan fits, by a secant search over compiled
    plans: bytes grow about linearly with the batch, so two plans predict the boundary and each further plan
    checks it. Returns (batch or None if not even the smallest fits, the plans compiled)."""
    step = config.mesh.data * config.mesh.fsdp
    limit = capacity * (1.0 - headroom)
    plans = {config.batch: first or compile_plan(config)}
    log(f"batch {config.batch}: {plans[config.batch].device_bytes / 2**30:.2f} GiB")

    def at(batch: int) -> CompiledPlan:
        if batch not in plans:
            plans[batch] = compile_plan(config.replace(batch=batch))
            log(f"batch {batch}: {plans[batch].device_bytes / 2**30:.2f} GiB")
        return plans[batch]

    lo, hi = _bounds(None, None, config.batch, plans[config.batch].device_bytes <= limit)
    for _ in range(max_compiles - 1):
        if (lo is not None and hi is not None and hi - lo <= step) or hi == step:
            break
        if len(plans) == 1:
            guess = 2 * config.batch if lo is not None else step
        else:  # the secant through the two plans nearest the limit
            (b1, p1), (b2, p2) = sorted(plans.items(), key=lambda kv: abs(kv[1].device_bytes - limit))[:2]
            slope = (p2.device_bytes - p1.device_bytes) / (b2 - b1)
            guess = b1 + (limit - p1.device_bytes) / slope if slope > 0 else 2 * max(plans)
        guess = max(step, int(guess) // step * step)
        if lo is not None:
            guess = max(guess, lo + step)
        if hi is not None:
            guess = min(guess, hi - step)
        if guess in plans:
            break
        lo, hi = _bounds(lo, hi, guess, at(guess).device_bytes <= limit)
    return lo, [plans[b] for b in sorted(plans)]


def _bounds(lo, hi, batch, ok):
    if ok:
        return (batch if lo is None else max(lo, batch)), hi
    return lo, (batch if hi is None else min(hi, batch))
