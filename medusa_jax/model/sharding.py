"""One mesh configuration and one set of partition rules for training and decoding.

Mesh axes: `data` (batch), `fsdp` (batch and parameter storage), `tensor` (attention heads, MLP width,
vocabulary). Parameter layouts are kept as data: PARAM_RULES maps a regex over the dotted NNX path of a
parameter to one mesh axis (or None) per array dimension. Every parameter must match a rule, so a new
parameter can never be silently replicated.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from medusa_jax.model.config import ModelConfig
from medusa_jax.model.kv_cache import KVCache
from medusa_jax.model.param_paths import fill_state

AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")  # the batch dimension is split over both
_KV_SPEC = P(BATCH_AXES, "tensor", None, None)  # a K [B, K, H, S] or V [B, K, S, H] buffer of the KV cache

# (regex over the dotted parameter path, axis per dimension). Kernels are [in, out].
PARAM_RULES: tuple[tuple[str, tuple[Any, ...]], ...] = (
    (r"embed_tokens\.embedding$", ("tensor", "fsdp")),  # [V, D]
    (r"self_attn\.(q|k|v)_proj\.kernel$", ("fsdp", "tensor")),  # [D, heads*head_dim]
    (r"self_attn\.(q|k|v)_proj\.bias$", ("tensor",)),
    (r"self_attn\.o_proj\.kernel$", ("tensor", "fsdp")),  # [heads*head_dim, D]
    (r"mlp\.(gate|up)_proj\.kernel$", ("fsdp", "tensor")),  # [D, F]
    (r"mlp\.down_proj\.kernel$", ("tensor", "fsdp")),  # [F, D]
    (r"(layernorm|norm)\.weight$", (None,)),  # [D]
    (r"^lm_head\.kernel$", ("fsdp", "tensor")),  # [D, V]
    (r"^base\.lm_head\.kernel$", ("fsdp", "tensor")),  # [D, V], the backbone inside MedusaModel
    # Medusa heads (alone, or under `heads.` inside MedusaModel)
    (r"blocks\.\d+\.linear\.kernel$", ("fsdp", "tensor")),  # [D, D]
    (r"blocks\.\d+\.linear\.bias$", ("tensor",)),
    (r"heads\.\d+\.lm_head\.kernel$", ("fsdp", "tensor")),  # [D, V_head]
    (r"heads\.\d+\.input_proj\.kernel$", ("fsdp", "tensor")),  # Hydra: [(path tokens [+ 1]) * D, D]
    (r"heads\.\d+\.input_proj\.bias$", ("tensor",)),
    (r"(^|heads\.)fc\.kernel$", ("fsdp", "tensor")),  # EAGLE drafter: [2D, D]
    (r"^(heads\.)?lm_head\.kernel$", ("fsdp", "tensor")),  # EAGLE drafter's draft vocabulary [D, V_head]
    (r"token_map$", (None,)),
    # Token Recycling's [V, r] table: replicated, updated alike (alone, or inside a mix: heads.drafters.N.recycle_table)
    (r"(^|\.)recycle_table$", (None, None)),
)


# Medusa head parameters whose dimensions need not divide the mesh: an axis that does not divide its dimension
# (e.g. a truncated lm_head of 3,584 tokens on tensor=3) is replicated instead; the rest stays sharded. The
# backbone's dimensions must divide (validate_model_mesh): a mesh that suits the model suits its heads.
REPLICATE_IF_INDIVISIBLE = re.compile(r"(blocks\.\d+\.linear\.(kernel|bias)|(^|heads\.)(\d+\.)?lm_head\.kernel)$")


class MeshError(ValueError):
    """The mesh does not fit the model or the machine."""


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    data: int = 1
    fsdp: int = 1
    tensor: int = 1

    def __post_init__(self):
        for axis in AXES:
            if getattr(self, axis) < 1:
                raise MeshError(f"mesh axis {axis} must be >= 1, got {getattr(self, axis)}")

    @classmethod
    def parse(cls, spec: str | None) -> "MeshConfig":
        """'data=2,fsdp=2,tensor=2' (missing axes are 1; '' or None is a single device)."""
        if not spec:
            return cls()
        sizes = {}
        for part in spec.split(","):
            name, sep, value = part.strip().partition("=")
            value = value.strip()
            if not sep or name not in AXES or not (value.isascii() and value.isdigit()):
                raise MeshError(f"bad mesh spec {spec!r}: expected e.g. 'data=2,fsdp=2,tensor=2' with axes {AXES}")
            if name in sizes:
                raise MeshError(f"bad mesh spec {spec!r}: axis {name} given twice")
            sizes[name] = int(value)
        return cls(**sizes)

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.data, self.fsdp, self.tensor)

    @property
    def size(self) -> int:
        return self.data * self.fsdp * self.tensor

    def make_mesh(self, devices: Sequence[jax.Device] | None = None) -> Mesh:
        devices = list(jax.devices() if devices is None else devices)
        if len(devices) < self.size:
            raise MeshError(f"mesh {self.shape} {AXES} needs {self.size} devices, only {len(devices)} available")
        # Auto axes: XLA propagates shardings from the parameters and inputs (GSPMD), as pjit did.
        auto = (AxisType.Auto,) * len(AXES)
        if devices == list(jax.devices()) and self.size == len(devices):
            return jax.make_mesh(self.shape, AXES, devices=devices, axis_types=auto)
        return Mesh(np.asarray(devices[: self.size]).reshape(self.shape), AXES, axis_types=auto)


def axis_size(mesh: Mesh, axis) -> int:
    if axis is None:
        return 1
    names = axis if isinstance(axis, tuple) else (axis,)
    return int(np.prod([mesh.shape[n] for n in names]))


# a stacked layer parameter (model.layer_stack: "layers.self_attn.q_proj.kernel", no layer index) has a leading
# layer axis, kept whole on every device: each device holds its part of every layer
_STACKED = re.compile(r"(^|\.)layers\.(?!\d)")


def spec_for_path(path: str, ndim: int) -> P:
    for pattern, axes in PARAM_RULES:
        if re.search(pattern, path):
            if len(axes) + 1 == ndim and _STACKED.search(path):
                return P(None, *axes)
            if len(axes) != ndim:
                raise MeshError(f"partition rule {pattern!r} has {len(axes)} axes, parameter {path} has {ndim} dims")
            return P(*axes)
    raise MeshError(f"no partition rule matches parameter {path!r}; add one to medusa_jax.model.sharding.PARAM_RULES")


def checked_sharding(mesh: Mesh, spec: P, shape: Sequence[int], what: str) -> NamedSharding:
    """NamedSharding for an array of `shape`; a dimension the mesh axis does not divide is a clear error."""
    for dim, axis in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        size = axis_size(mesh, axis)
        if dim % size:
            raise MeshError(f"{what}: dimension of size {dim} is not divisible by mesh axis {axis!r} of size {size}")
    return NamedSharding(mesh, spec)


def dividing_spec(mesh: Mesh, spec: P, shape: Sequence[int]) -> P:
    """`spec` with every mesh axis that does not divide its dimension replaced by None (replicated)."""
    axes = tuple(spec) + (None,) * (len(shape) - len(spec))
    return P(*(a if dim % axis_size(mesh, a) == 0 else None for dim, a in zip(shape, axes)))


def sharding_for(mesh: Mesh):
    """The `sharding_for(path, shape)` callback of `hf.load.load_pretrained`: each device reads its slice."""
    def fn(path: tuple[str, ...], shape: tuple[int, ...]) -> NamedSharding:
        dotted = ".".join(path)
        spec = spec_for_path(dotted, len(shape))
        if REPLICATE_IF_INDIVISIBLE.search(dotted):
            spec = dividing_spec(mesh, spec, shape)
        return checked_sharding(mesh, spec, shape, f"parameter {dotted}")

    return fn


def param_shardings(state, mesh: Mesh):
    """A pytree (same structure as the NNX state) of NamedShardings from PARAM_RULES."""
    place = sharding_for(mesh)
    return fill_state(state, lambda path, leaf: place(path, tuple(leaf.shape)))


def validate_model_mesh(config: ModelConfig, mesh: Mesh) -> None:
    """Tensor parallelism splits whole attention heads: both head counts must divide by the tensor axis."""
    tensor = mesh.shape["tensor"]
    for name, count in (("num_heads", config.num_heads), ("num_kv_heads", config.num_kv_heads),
                        ("intermediate_size", config.intermediate_size), ("vocab_size", config.vocab_size)):
        if count % tensor:
            raise MeshError(f"mesh axis 'tensor' of size {tensor} does not divide the model's {name} ({count})")
    fsdp = mesh.shape["fsdp"]
    if config.hidden_size % fsdp:
        raise MeshError(f"mesh axis 'fsdp' of size {fsdp} does not divide the model's hidden_size "
                        f"({config.hidden_size})")


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Batch-major arrays [B, ...]: rows split over (data, fsdp)."""
    return NamedSharding(mesh, P(BATCH_AXES, *([None] * (ndim - 1))))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def _cache_specs(cache: KVCache) -> tuple:
    """The K and V buffers' specs in the cache's form: one per layer, or one for the stack (its layer axis
    whole on every device)."""
    if cache.stacked:
        return P(None, *_KV_SPEC), P(None, *_KV_SPEC)
    return (_KV_SPEC,) * cache.num_layers, (_KV_SPEC,) * cache.num_layers


def cache_shardings(mesh: Mesh, cache: KVCache) -> KVCache:
    """Per-layer K [B, K, H, S] and V [B, K, S, H] (or their stacks [L, ...], the layer axis whole): rows over
    (data, fsdp), KV heads over tensor; lengths [B] over (data, fsdp)."""
    k_spec, v_spec = _cache_specs(cache)
    lengths = checked_sharding(mesh, P(BATCH_AXES), cache.lengths_b.shape, "KV cache lengths (batch)")
    if cache.stacked:
        return KVCache(checked_sharding(mesh, k_spec, cache.k_bkhs.shape, "KV cache"),
                       checked_sharding(mesh, v_spec, cache.v_bksh.shape, "KV cache"), lengths)
    kv = checked_sharding(mesh, _KV_SPEC, cache.k_bkhs[0].shape, "KV cache")
    return KVCache((kv,) * cache.num_layers, (kv,) * cache.num_layers, lengths)


def map_cache_rows(fn, cache: KVCache, *rows):
    """fn(cache, *rows) -> KVCache, run shard by shard when traced under a mesh with our axes (`jax.set_mesh`,
    as `inference.sharded` does); plainly otherwise. `fn` must treat rows and KV heads independently (e.g.
    moving slots within each row): then each device works on its own rows and heads, with no collectives.
    XLA's partitioner cannot see that a gather/scatter indexed by explicit row ids stays within a row, and
    would all-reduce the moved K/V over the batch axes. `rows` are [B, ...] arrays."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not set(AXES) <= set(mesh.axis_names) or all(mesh.shape[a] == 1 for a in AXES):
        return fn(cache, *rows)
    cache_spec = KVCache(*_cache_specs(cache), P(BATCH_AXES))
    row_specs = tuple(P(BATCH_AXES, *([None] * (r.ndim - 1))) for r in rows)
    return jax.shard_map(fn, in_specs=(cache_spec, *row_specs), out_specs=cache_spec)(cache, *rows)


def constrain_rows(x: jax.Array) -> jax.Array:
    """Activations [B, ...] pinned to rows over (data, fsdp), the rest replicated, when traced under a mesh with
    our axes (`jax.set_mesh`); unchanged otherwise. Without it XLA split the residual stream of Medusa's
    tree verify over `tensor` and paid an extra all-gather and all-reduce per layer."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not set(AXES) <= set(mesh.axis_names):
        return x
    if x.shape[0] % (mesh.shape["data"] * mesh.shape["fsdp"]):
        return x
    return jax.lax.with_sharding_constraint(x, P(BATCH_AXES, *([None] * (x.ndim - 1))))


def gathered_over_fsdp(state):
    """One layer's parameters (an NNX state) all-gathered over `fsdp`, their `tensor` split kept, when traced
    under a mesh with our axes (`jax.sharding.use_abstract_mesh`, as the trainer traces); unchanged otherwise.
    FSDP's gather before a layer's products, pinned: without it XLA's partitioner may instead all-gather the
    activations over the batch axes inside the scan over layers (it did on a small model), which on a pod's
    batch is the larger transfer."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not set(AXES) <= set(mesh.axis_names) or mesh.shape["fsdp"] == 1:
        return state

    def gather(path, leaf):
        spec = spec_for_path(".".join(path), leaf.ndim)
        return jax.lax.with_sharding_constraint(leaf, P(*(None if a == "fsdp" else a for a in spec)))

    return fill_state(state, gather)


def check_rows_split(flag: str, rows: int, spec: str | None) -> None:
    """A batch of `rows` (given as `flag`) that must split evenly over the --mesh `spec`'s data x fsdp rows."""
    mesh = MeshConfig.parse(spec)
    if rows % (mesh.data * mesh.fsdp):
        raise MeshError(f"{flag} {rows} does not split over --mesh {spec} (data x fsdp = {mesh.data * mesh.fsdp}): "
                        f"use a multiple of {mesh.data * mesh.fsdp}")
