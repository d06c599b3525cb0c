"""Decoding under a device mesh: the plain and Medusa decode loops jitted with explicit in/out shardings. The
layouts and the collectives of each mesh axis (decode over data x tensor; fsdp saves memory, not time) are in
docs/design.md, "Sharded decoding and batch generation". Multi-host: every process holds the same host batch and
`put_rows` builds only its own devices' shards; `engine_mesh.fetch` gathers the outputs."""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from medusa_jax.model.backbone import CausalLM
from medusa_jax.model.config import LayerExecution
from medusa_jax.model.kv_cache import KVCache
from medusa_jax.model.sharding import (BATCH_AXES, MeshConfig, MeshError, batch_sharding, cache_shardings,
                                       checked_sharding, param_shardings, replicated, sharding_for, validate_model_mesh)
from medusa_jax.hf.load import load_pretrained
from medusa_jax.heads.config import HeadsConfig
from medusa_jax.trees.dynamic_tree import grow_from_candidates
from medusa_jax.heads.init import init_heads
from medusa_jax.heads.load import load_heads
from medusa_jax.heads.medusa import MedusaHeads, MedusaModel
from medusa_jax.trees.tree import DynamicTree, TreeBuffers
from medusa_jax.trees.trees_file import trees_of
from medusa_jax.inference import autoregressive, medusa
from medusa_jax.inference.acceptance import DecodeConfig
from medusa_jax.inference.engine_mesh import fetch
from medusa_jax.inference.sampling import SamplingConfig

log = logging.getLogger(__name__)


def put_rows(mesh: Mesh, rows: np.ndarray) -> jax.Array:
    """A host array [B, ...] (the same on every process) -> a global array with rows over (data, fsdp).
    Each process materialises only the shards of its own devices."""
    rows = np.asarray(rows)
    sharding = checked_sharding(mesh, P(BATCH_AXES, *([None] * (rows.ndim - 1))), rows.shape, "batch rows")
    return jax.make_array_from_callback(rows.shape, sharding, lambda index: rows[index])


def sharded_top_k(logits_xbv: jax.Array, k: int, mesh: Mesh, with_values: bool = False):
    """Indices of the k largest entries along the last axis of [..., B, V] logits (and their values first when
    `with_values`), computed shard by shard:
    XLA's partitioner replicates a TopK (it all-gathers the whole [..., B, V] logits, even over the batch).
    Here each device takes the top-k of its rows and vocabulary slice, the k candidates of every vocabulary
    shard are all-gathered over `tensor` and reduced again. Ties resolve to the lower index, as in lax.top_k."""
    tensor = mesh.shape["tensor"]
    vocab = logits_xbv.shape[-1]
    vocab_axis = "tensor" if tensor > 1 and vocab % tensor == 0 and vocab // tensor >= k else None
    lead = (None,) * (logits_xbv.ndim - 2)

    def local(x):
        values, ids = jax.lax.top_k(x, k)
        if vocab_axis is not None:
            ids = ids + jax.lax.axis_index("tensor") * x.shape[-1]
            values = jax.lax.all_gather(values, "tensor", axis=x.ndim - 1, tiled=True)  # [..., b, tensor * k]
            ids = jax.lax.all_gather(ids, "tensor", axis=x.ndim - 1, tiled=True)
            values, best = jax.lax.top_k(values, k)  # candidates are ordered by vocabulary shard, so ties keep order
            ids = jnp.take_along_axis(ids, best, axis=-1)
        return (values, ids) if with_values else ids

    # check_vma=False: the all-gathered result is the same on every `tensor` shard, which JAX cannot infer
    out = P(*lead, BATCH_AXES, None)
    return jax.shard_map(local, mesh=mesh, in_specs=P(*lead, BATCH_AXES, vocab_axis),
                         out_specs=(out, out) if with_values else out, check_vma=False)(logits_xbv)


@dataclasses.dataclass(frozen=True)
class MeshHeadsProposer:
    """`medusa.heads_proposer` with the heads' top-k computed per shard (`sharded_top_k`); a dynamic tree grows
    from them (and their log-probabilities) as `MedusaHeads.propose` grows it."""

    mesh: Mesh

    def __call__(self, inputs: medusa.ProposeInputs) -> tuple[Any, Any]:
        tree, heads = inputs.tree, inputs.model.heads
        if not getattr(heads, "proposes_top_k_of_logits", False):  # Hydra, EAGLE, mixes: left to the compiler
            return medusa.heads_proposer(inputs)
        logits_mbv = heads.logits(inputs.hidden_bd, inputs.model.base, num_heads=tree.depth)
        if isinstance(tree, DynamicTree):
            values_mbr, ids_mbr = sharded_top_k(logits_mbv, tree.top_k, self.mesh, with_values=True)
            logp_mbr = values_mbr - jax.nn.logsumexp(logits_mbv, axis=-1, keepdims=True)
            ids_bmr = heads.to_full_vocab(ids_mbr.astype(jnp.int32)).transpose(1, 0, 2)
            return grow_from_candidates(tree, inputs.root_b, ids_bmr, logp_mbr.transpose(1, 0, 2)), inputs.draft
        ids_mbr = sharded_top_k(logits_mbv, tree.top_k, self.mesh).astype(jnp.int32)
        return heads.to_full_vocab(ids_mbr).transpose(1, 0, 2), inputs.draft


@dataclasses.dataclass(frozen=True)
class DecodeStatics:
    """Everything one decode loop is specialised on (one compilation per distinct value): the loop
    (`autoregressive.decode`, `medusa.medusa_decode` or `medusa.medusa_decode_keeping_draft`), the graphdef of its
    model (the CausalLM or the MedusaModel) and its keyword settings (max_new_tokens, sampling or tree and
    acceptance, eos_ids, pad_id, prefill_groups (autoregressive.grouped_prefill), a Medusa loop's proposer)."""

    loop: Callable
    graphdef: Any
    settings: tuple[tuple[str, Any], ...]


def _decode(statics: DecodeStatics, params, cache, prompt_bt, prompt_lens_b, key, proposer_data):
    data = () if statics.loop is autoregressive.decode else (proposer_data,)  # a proposer's, replicated
    return statics.loop(statics.graphdef, params, cache, prompt_bt, prompt_lens_b, key, *data, **dict(statics.settings))


class ShardedModel:
    """A base model (and optionally Medusa heads) placed on a mesh, with the decode loops jitted under explicit
    in/out shardings. Build it once and reuse it across batches: compilations are cached per batch shape and
    static settings, the donated KV cache is recycled when the next batch has the same shape, and so is the
    generation engine of `api.generate_batch`'s sorted batches."""

    def __init__(self, base: CausalLM, heads: MedusaHeads | None = None, mesh: Mesh | MeshConfig | None = None):
        if mesh is None or isinstance(mesh, MeshConfig):
            mesh = (mesh or MeshConfig()).make_mesh()
        if not isinstance(base, CausalLM):
            raise TypeError(f"expected a CausalLM base model, got {type(base).__name__}")
        validate_model_mesh(base.config, mesh)
        if jax.process_count() > 1 and mesh.size != jax.device_count():
            raise MeshError(f"with {jax.process_count()} processes the mesh must span all {jax.device_count()} "
                            f"devices (every process runs the same program), got a mesh of {mesh.size}")
        self.mesh = mesh
        self.config = base.config
        self.heads_config = None if heads is None else heads.config
        self.heads_trees = None if heads is None else trees_of(heads)  # the heads folder's trees.json
        # heads that keep their drafter state across calls (Token Recycling's table): the state a call ends with
        # replaces their variables in the params, and the heads object gets it too (heads.keep_draft)
        self.heads = heads if heads is not None and heads.keeps_draft else None
        graphdef, state = nnx.split(base if heads is None else MedusaModel(base, heads))
        shardings = param_shardings(state, mesh)
        params = jax.tree.map(_placed, state, shardings)
        if heads is None:
            self.base_graphdef, self.base_params, self.base_shardings = graphdef, params, shardings
            self.medusa_graphdef = self.medusa_params = self.medusa_shardings = None
        else:
            self.medusa_graphdef, self.medusa_params, self.medusa_shardings = graphdef, params, shardings
            self.base_graphdef = nnx.split(base)[0]
            self.base_params, self.base_shardings = params["base"], shardings["base"]
        if mesh.shape["fsdp"] > 1:
            log.warning("mesh axis fsdp=%d stores weights split over hidden_size: every decode step then needs "
                        "extra collectives per layer (weights or activations over fsdp); prefer data x tensor "
                        "meshes for decoding", mesh.shape["fsdp"])
        self._jits: dict[tuple, Callable] = {}
        self._spare_cache: KVCache | None = None  # the last donated-and-returned cache
        # the generation engine of the last batch call (`engine_batches.LastEngine`), for the next of its shapes
        self.last_engine = None

    @property
    def has_heads(self) -> bool:
        return self.medusa_graphdef is not None

    # ---- placement -------------------------------------------------------------------------------------
    def cache_sharding(self, batch_size: int, cache_size: int) -> KVCache:
        return _cache_sharding(self.mesh, self.config, batch_size, cache_size)

    def new_cache(self, batch_size: int, cache_size: int) -> KVCache:
        """A zeroed KV cache created directly in its sharded layout (never whole on one device)."""
        spare, self._spare_cache = self._spare_cache, None
        if spare is not None and (spare.batch_size, spare.cache_size) == (batch_size, cache_size):
            return spare  # decoding resets lengths and masks every slot past them: stale contents are harmless
        shardings = self.cache_sharding(batch_size, cache_size)
        return jax.jit(_zero_cache, static_argnums=(0, 1, 2), out_shardings=shardings)(self.config, batch_size,
                                                                                       cache_size)

    @property
    def row_multiple(self) -> int:
        """Batch sizes must be multiples of this (rows are split over data x fsdp)."""
        return self.mesh.shape["data"] * self.mesh.shape["fsdp"]

    def _jit(self, loop: Callable, params_shardings, batch_size: int, cache_size: int,
             out_batch_ndims: tuple[int | None, ...]) -> Callable:
        """`_decode` of a DecodeStatics with this `loop` under explicit shardings (data: a replicated pytree, e.g. a
        proposer's); it returns batch-major arrays of `out_batch_ndims` (None: a replicated pytree) and then the
        cache (donated in, returned out)."""
        memo = (loop, batch_size, cache_size, out_batch_ndims)
        if memo not in self._jits:
            kv_shardings = self.cache_sharding(batch_size, cache_size)
            rows_2d, rows_1d = batch_sharding(self.mesh, 2), batch_sharding(self.mesh, 1)
            outs = tuple(replicated(self.mesh) if nd is None else batch_sharding(self.mesh, nd)
                         for nd in out_batch_ndims) + (kv_shardings,)
            self._jits[memo] = jax.jit(
                _decode, static_argnums=(0,), donate_argnums=(2,),
                in_shardings=(params_shardings, kv_shardings, rows_2d, rows_1d, replicated(self.mesh),
                              replicated(self.mesh)),
                out_shardings=outs)
        return self._jits[memo]

    def abstract_inputs(self, batch_size: int, prompt_len: int, cache_size: int) -> tuple:
        """(cache, prompt_bt, prompt_lens_b, key) as jax.ShapeDtypeStructs in their mesh layouts: lowering a
        decode loop on them allocates nothing (medusa_jax.training.plan)."""
        rows_2d, rows_1d, rep = batch_sharding(self.mesh, 2), batch_sharding(self.mesh, 1), replicated(self.mesh)
        cache = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                             jax.eval_shape(lambda: KVCache.zeros(self.config, batch_size, cache_size)),
                             self.cache_sharding(batch_size, cache_size))
        key = jax.eval_shape(lambda: jax.random.key(0))
        return (cache, jax.ShapeDtypeStruct((batch_size, prompt_len), jnp.int32, sharding=rows_2d),
                jax.ShapeDtypeStruct((batch_size,), jnp.int32, sharding=rows_1d),
                jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=rep))

    def _run(self, statics, params, params_shardings, prompt_bt, prompt_lens_b, cache_size, seed,
             out_batch_ndims, lowered_only, data=None):
        batch_size = prompt_bt.shape[0]
        if batch_size % self.row_multiple:
            raise MeshError(f"batch size {batch_size} is not divisible by mesh axes ('data', 'fsdp') of total size "
                            f"{self.row_multiple} (data={self.mesh.shape['data']}, fsdp={self.mesh.shape['fsdp']})")
        jitted = self._jit(statics.loop, params_shardings, batch_size, cache_size, out_batch_ndims)
        if lowered_only:  # shapes suffice: no cache, prompt or key is allocated
            with jax.set_mesh(self.mesh):
                return jitted.lower(statics, params, *self.abstract_inputs(batch_size, prompt_bt.shape[1],
                                                                           cache_size), data)
        args = (statics, params, self.new_cache(batch_size, cache_size), put_rows(self.mesh, prompt_bt),
                put_rows(self.mesh, prompt_lens_b), jax.jit(jax.random.key, out_shardings=replicated(self.mesh))(seed),
                data)
        with jax.set_mesh(self.mesh):  # lets row-local steps run per shard (sharding.map_cache_rows)
            *outs, cache = jitted(*args)
        self._spare_cache = cache
        return outs

    # ---- decode loops ----------------------------------------------------------------------------------
    def plain_decode(self, prompt_bt: np.ndarray, prompt_lens_b: np.ndarray, *, cache_size: int,
                     max_new_tokens: int, sampling: SamplingConfig = SamplingConfig(), seed: int = 0,
                     eos_ids: tuple[int, ...] = (), pad_id: int = 0, lowered_only: bool = False):
        """Prefill + plain decoding of one padded batch -> host (tokens [b, o], num_new [b]).
        `lowered_only` returns the lowered computation instead (for HLO inspection and memory plans; only the
        prompts' shape is used)."""
        settings = dict(max_new_tokens=max_new_tokens, sampling=sampling, eos_ids=tuple(eos_ids), pad_id=pad_id,
                        prefill_groups=autoregressive.prefill_groups(prompt_bt.shape[0], self.row_multiple))
        statics = DecodeStatics(autoregressive.decode, self.base_graphdef, tuple(settings.items()))
        outs = self._run(statics, self.base_params, self.base_shardings, prompt_bt,
                         prompt_lens_b, cache_size, seed, (2, 1), lowered_only)
        return outs if lowered_only else tuple(fetch(o) for o in outs)

    def medusa_decode(self, prompt_bt: np.ndarray, prompt_lens_b: np.ndarray, *, tree: TreeBuffers | DynamicTree,
                      cache_size: int, max_new_tokens: int, acceptance: DecodeConfig = DecodeConfig(),
                      seed: int = 0, eos_ids: tuple[int, ...] = (), pad_id: int = 0, lowered_only: bool = False,
                      proposer: medusa.Proposer | None = None, proposer_data: Any = None):
        """Prefill + Medusa decoding of one padded batch (the cache needs dynamic_tree.scratch_slots(tree) scratch
        slots) -> host (tokens [b, o], num_new [b], verify steps [b], accept lengths [b, o]). `proposer` (default:
        the heads' top-k, computed per shard) receives `proposer_data`, replicated on every device."""
        if not self.has_heads:
            raise ValueError("this ShardedModel was built without Medusa heads")
        settings = dict(tree=tree, max_new_tokens=max_new_tokens, acceptance=acceptance, eos_ids=tuple(eos_ids),
                        pad_id=pad_id, proposer=proposer or MeshHeadsProposer(self.mesh),
                        prefill_groups=autoregressive.prefill_groups(prompt_bt.shape[0], self.row_multiple))
        keeps_draft = self.heads is not None
        loop = medusa.medusa_decode_keeping_draft if keeps_draft else medusa.medusa_decode
        outs = self._run(DecodeStatics(loop, self.medusa_graphdef, tuple(settings.items())), self.medusa_params,
                         self.medusa_shardings, prompt_bt, prompt_lens_b, cache_size, seed,
                         (2, 1, 1, 2) + ((None,) if keeps_draft else ()), lowered_only, proposer_data)
        if lowered_only:
            return outs
        if keeps_draft:
            *outs, draft = outs
            self.keep_draft(draft)
        return tuple(fetch(o) for o in outs)

    def keep_draft(self, draft) -> None:
        """The drafter state a decode call (or the generation engine) ended with becomes the start of the next call:
        in the params (same sharding: replicated) and in the heads object (`keep_draft`), so a new ShardedModel of
        them starts there."""
        self.heads.keep_draft(draft)

        def place(value, sharding):  # a state on one device (the engine's, read back) is placed from the host
            return _placed(value if isinstance(value.sharding, NamedSharding) else np.asarray(value), sharding)

        self.medusa_params["heads"] = jax.tree.map(place, nnx.state(self.heads), self.medusa_shardings["heads"])

    def draft_snapshot(self):
        """The drafter state the next call starts from, for `restore_draft` (the heads' placed variables, shared,
        not copied: calls replace them, never write into them); None for heads that keep no state across calls."""
        return None if self.heads is None else jax.tree.map(lambda x: x, self.medusa_params["heads"])

    def restore_draft(self, snapshot) -> None:
        """The next call starts from the drafter state of `snapshot` (`draft_snapshot`), whatever calls ran since:
        e.g. every round of a benchmark from the same table; None (heads that keep no state) changes nothing."""
        if snapshot is None:
            return
        self.medusa_params["heads"] = jax.tree.map(lambda x: x, snapshot)
        nnx.update(self.heads, snapshot)


@functools.lru_cache(maxsize=64)
def _cache_sharding(mesh: Mesh, config, batch_size: int, cache_size: int) -> KVCache:
    """The KV cache's shardings (cached: tracing the cache's shapes costs more than a small decode call)."""
    return cache_shardings(mesh, jax.eval_shape(functools.partial(_zero_cache, config, batch_size, cache_size)))


def _zero_cache(config, batch_size: int, cache_size: int) -> KVCache:
    """A module-level function, so that every ShardedModel's jitted copy hits the same compilation cache."""
    return KVCache.zeros(config, batch_size, cache_size)


def _placed(value: jax.Array, sharding: NamedSharding) -> jax.Array:
    """One parameter in its mesh layout: kept when loaded in place (sharding_for), resharded when already
    global, else built shard by shard from the local copy (the same on every process: no cross-process
    transfer, which `device_put` of a local array to a multi-host sharding would need)."""
    if isinstance(value, jax.ShapeDtypeStruct):  # an abstract model (nnx.eval_shape), for planning
        return jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding)
    if isinstance(value, jax.Array) and value.sharding.is_equivalent_to(sharding, value.ndim):
        return value
    if jax.process_count() == 1 or (isinstance(value, jax.Array) and not value.is_fully_addressable):
        return jax.device_put(value, sharding)
    host = np.asarray(value)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def load_sharded(model_dir, heads_dir=None, mesh: MeshConfig | Mesh | None = None, dtype: str = "float32",
                 random_heads: int = 0, drafter: Callable[[CausalLM], Any] | None = None,
                 layers: LayerExecution = LayerExecution()) -> ShardedModel:
    """A HF model folder read straight into its mesh layout (each device reads its own slice), plus heads
    from a folder in any layout `heads.load.load_heads` reads, as a ShardedModel. `random_heads` = K > 0
    instead adds K untrained heads sharing the base lm_head (for timing runs before trained heads exist);
    `drafter` instead makes the heads from the base (e.g. `heads.recycle.recycle_drafter`: Token Recycling).
    `layers.scan` loads the layers stacked: they decode under one scan over a stacked KV cache (`--scan-layers`)."""
    if mesh is None or isinstance(mesh, MeshConfig):
        mesh = (mesh or MeshConfig()).make_mesh()
    base = load_pretrained(model_dir, dtype=dtype, sharding_for=sharding_for(mesh), layers=layers)
    heads = None
    if drafter is not None:
        heads = drafter(base)
    elif heads_dir is not None:
        # `base` lets heads whose lm_heads equal the base's load as shared; comparing needs the whole base on
        # this process, so multi-host runs load them as own copies instead (same outputs, more memory)
        same_process = jax.process_count() == 1
        heads = load_heads(heads_dir, base_config=base.config, base=base if same_process else None, dtype=dtype)
    elif random_heads:
        config = HeadsConfig(base.config.hidden_size, base.config.vocab_size, num_heads=random_heads,
                             lm_head="shared", dtype=dtype)
        heads = init_heads(config, base)
    return ShardedModel(base, heads, mesh)
