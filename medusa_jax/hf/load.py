"""Load a local HF Llama/Mistral/Qwen2 folder into the NNX backbone, each device reading only its own slice of the
memory-mapped weights, per layer or straight into the stacked form; docs/modules.md."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable

import jax
import numpy as np
from flax import nnx

from medusa_jax.hub import hub_folder, is_hub_id
from medusa_jax.model.backbone import CausalLM
from medusa_jax.model.config import LayerExecution, ModelConfig
from medusa_jax.model.param_paths import fill_state, param_paths
from medusa_jax.hf.tensor_files import CheckpointError, TensorSource, find_model_weights

ShardingFn = Callable[[tuple[str, ...], tuple[int, ...]], "jax.sharding.Sharding | None"]


def read_hf_config(folder: str | os.PathLike) -> dict:
    path = Path(folder) / "config.json"
    if not path.exists():
        raise CheckpointError(f"{folder}: not a HF model folder (no config.json)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: corrupt config.json ({e})") from None


def hf_param_name(path: tuple[str, ...]) -> tuple[str, bool]:
    """Our NNX parameter path -> (HF tensor name, stored transposed?). Linear kernels are [in, out] here,
    [out, in] in PyTorch."""
    if path[0] == "embed_tokens":
        return "model.embed_tokens.weight", False
    if path[0] == "lm_head":
        return "lm_head.weight", True
    if path[-1] == "kernel":
        return "model." + ".".join(path[:-1]) + ".weight", True
    return "model." + ".".join(path), False


def stacked_param(path: tuple[str, ...]) -> bool:
    """A parameter of the stacked layers ("layers", "self_attn", ..., no layer index): [L, ...]."""
    return path[0] == "layers" and not path[1].isdigit()


def hf_layer_names(path: tuple[str, ...], num_layers: int) -> list[tuple[str, bool]]:
    """`hf_param_name` of each layer's tensor that a stacked parameter holds (one name for any other)."""
    if not stacked_param(path):
        return [hf_param_name(path)]
    return [hf_param_name(("layers", str(i)) + path[1:]) for i in range(num_layers)]


def lazy_array(read_layers: list[Callable[[], np.ndarray]], shape, dtype, sharding, transpose: bool,
               stacked: bool) -> jax.Array:
    """A (possibly sharded) jax.Array whose shards are read lazily from memmaps: `read_layers[0]()` the whole
    tensor, or (`stacked`, shape [L, ...]) `read_layers[i]()` layer i's, so a device's shard reads only its slice
    of its layers."""
    def part(src, index):
        return np.asarray(src[tuple(reversed(index))].T if transpose else src[index]).astype(dtype)

    def shard(index):
        if not stacked:
            return part(read_layers[0](), index)
        return np.stack([part(read_layers[i](), index[1:]) for i in range(len(read_layers))[index[0]]])

    return jax.make_array_from_callback(tuple(shape), sharding, shard)


def load_pretrained(folder: str | os.PathLike, dtype: str = "float32", sharding_for: ShardingFn | None = None,
                    layers: LayerExecution = LayerExecution()) -> CausalLM:
    """Loads a local HF folder (or a Hub id `ORG/NAME`, resolved in the Hugging Face cache by
    `medusa_jax.hub.hub_folder`) into a `CausalLM` running its layers as `layers` says (stacked for
    `layers.scan`); raises CheckpointError naming any mismatch, HubError for a Hub id that cannot be resolved."""
    if is_hub_id(folder):
        folder = hub_folder(str(folder))
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: model folder does not exist")
    config = ModelConfig.from_hf_config(read_hf_config(folder), dtype=dtype).replace(execution=layers)
    source = TensorSource.from_files(find_model_weights(folder))
    abstract = nnx.eval_shape(lambda: CausalLM(config, nnx.Rngs(0)))
    graphdef, abstract_state = nnx.split(abstract)

    expected = {}  # HF tensor name -> (parameter path, transposed?, the tensor's shape in our layout)
    for path, leaf in param_paths(abstract_state):
        shape = tuple(leaf.shape)[1:] if stacked_param(path) else tuple(leaf.shape)
        for name, transpose in hf_layer_names(path, config.num_layers):
            expected[name] = (path, transpose, shape)
    present = set(source.names)
    ignorable = {n for n in present if n.endswith("rotary_emb.inv_freq")}
    if config.tie_word_embeddings:
        ignorable.add("lm_head.weight")  # some tied checkpoints store the embedding twice
    missing = sorted(set(expected) - present)
    unexpected = sorted(present - set(expected) - ignorable)
    if missing or unexpected:
        raise CheckpointError(
            f"{folder}: weights do not match a {config.model_type} model with this config.json: "
            f"missing tensors {missing}; unexpected tensors {unexpected}")
    for name, (path, transpose, shape) in expected.items():
        stored = tuple(source.array(name).shape)
        want = tuple(reversed(shape)) if transpose else shape
        if stored != want:
            raise CheckpointError(f"{folder}: tensor {name!r} has shape {stored}, the config implies {want}")

    np_dtype = np.dtype(config.jnp_dtype)
    default = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])  # this process's first device

    def value(path, leaf):
        names = hf_layer_names(path, config.num_layers)
        transpose = names[0][1]
        sharding = (sharding_for(path, tuple(leaf.shape)) if sharding_for else None) or default
        readers = [lambda name=name: source.array(name) for name, _ in names]
        return lazy_array(readers, leaf.shape, np_dtype, sharding, transpose, stacked_param(path))

    return nnx.merge(graphdef, fill_state(abstract_state, value))
