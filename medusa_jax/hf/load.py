"""Load a local HF Llama/Mistral/Qwen2 folder (config.json + weights) into the NNX backbone (its inverse,
`save_pretrained`, is the neighbour `medusa_jax.hf.save`; both name tensors with `hf_param_name`).

Every parameter is built with `jax.make_array_from_callback`, so under a mesh each device reads only its
own slice from the memory-mapped file: pass `sharding_for(param_path, shape) -> Sharding` (see
`medusa_jax.model.sharding`). Without it everything lands on the first device.
"""

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
from medusa_jax.model.config import ModelConfig
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


def sliced_array(read_full: Callable[[], np.ndarray], shape, dtype, sharding, transpose: bool) -> jax.Array:
    """Builds a (possibly sharded) jax.Array whose shards are read lazily from `read_full()` (a memmap)."""
    def shard(index):
        src = read_full()
        part = src[tuple(reversed(index))].T if transpose else src[index]
        return np.asarray(part).astype(dtype)

    return jax.make_array_from_callback(tuple(shape), sharding, shard)


def load_pretrained(folder: str | os.PathLike, dtype: str = "float32",
                    sharding_for: ShardingFn | None = None) -> CausalLM:
    """Loads a local HF folder (or a Hub id `ORG/NAME`, resolved in the Hugging Face cache by
    `medusa_jax.hub.hub_folder`) into a `CausalLM`; raises CheckpointError naming any mismatch, HubError for a
    Hub id that cannot be resolved."""
    if is_hub_id(folder):
        folder = hub_folder(str(folder))
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: model folder does not exist")
    config = ModelConfig.from_hf_config(read_hf_config(folder), dtype=dtype)
    source = TensorSource.from_files(find_model_weights(folder))
    abstract = nnx.eval_shape(lambda: CausalLM(config, nnx.Rngs(0)))
    graphdef, abstract_state = nnx.split(abstract)

    expected = {}
    for path, leaf in param_paths(abstract_state):
        name, transpose = hf_param_name(path)
        expected[name] = (path, transpose, tuple(leaf.shape))
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
    by_path = {path: (name, transpose) for name, (path, transpose, _) in expected.items()}

    def value(path, leaf):
        name, transpose = by_path[path]
        sharding = (sharding_for(path, tuple(leaf.shape)) if sharding_for else None) or default
        return sliced_array(lambda: source.array(name), leaf.shape, np_dtype, sharding, transpose)

    return nnx.merge(graphdef, fill_state(abstract_state, value))
