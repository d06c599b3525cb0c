"""medusa-jax: MEDUSA speculative decoding in pure JAX / Flax NNX.

Public API (imported lazily, so `import medusa_jax` stays cheap and core modules never pull in the decoders):

    from medusa_jax import load_pretrained, load_heads, generate, generate_medusa
    model = load_pretrained(folder)                     # a Flax NNX CausalLM from a local HF folder
    heads = load_heads("heads/", base=model)            # native, FasterDecoding/TGI or vLLM layout
    out = generate_medusa(model, heads, [prompt_ids], max_new_tokens=64)

Layers, lowest first: the core (medusa_jax/: model, hf, trees, heads, root modules), inference/, training/, bench/,
scripts/; each imports only its own floor and those below (tests/test_layers.py). The picture, where each folder
installs and this file's one exemption (the lazy table below) are in docs/architecture.md.

Axis legend: an array's name ends in one letter per axis, outermost first (`v_bksh` is indexed
[batch, kv_head, slot, head_width]). One letter means one axis everywhere in the project.

    b  batch rows                       t  query tokens of one call (prompt positions, verify-tree nodes,
    s  KV-cache slots (key positions)      training positions)
    d  model width (hidden size)        f  MLP width (intermediate size)
    n  query heads                      k  KV heads
    g  query heads per KV head          h  head width (head_dim)
    v  vocabulary                       u  a truncated head vocabulary (token_map)
    l  layers                           o  generated output tokens per row
    x  any flattened leading axes
    i  query blocks of chunked attention (medusa_jax/model/attention.py)
  Medusa:
    m  Medusa / Hydra heads             r  top-k ranks of a head
    c  candidate paths (tree leaves, rows of the retrieve table)
    e  depth along a path (0 = the root)
    j  the children of one tree node, in rank order (columns of exact acceptance's children table)
    w  a dynamic tree's frontier: the K best nodes of one depth, expanded next (medusa_jax/trees/dynamic_tree.py)
    a  a dynamic tree's drafted candidates of one step (K + (D - 1) K^2, depth by depth), reranked to N nodes

Examples: one layer of the KV cache k_bkhs / v_bksh; hidden states hidden_btd; logits logits_btv; the heads' top-k ids
ids_mbr; a head's lm_head weight lm_head_dv; generated tokens out_bo; the retrieve table retrieve_ce (for
each candidate path, its node at each depth); an attention mask over the cache mask_bts.
"""

from __future__ import annotations

import importlib

# name -> module that defines it. Every entry is a user-facing name; tests/test_api.py resolves them all.
_API = {
    # models and heads
    "ModelConfig": "medusa_jax.model.config",
    "CausalLM": "medusa_jax.model.backbone",
    "KVCache": "medusa_jax.model.kv_cache",
    "HeadsConfig": "medusa_jax.heads.config",
    "MedusaHeads": "medusa_jax.heads.medusa",
    "init_heads": "medusa_jax.heads.init",
    "MeshConfig": "medusa_jax.model.sharding",
    # loading and saving (HF folders, heads in every layout, trees)
    "load_pretrained": "medusa_jax.hf.load",
    "save_pretrained": "medusa_jax.hf.save",
    "load_heads": "medusa_jax.heads.load",
    "save_heads": "medusa_jax.heads.folder",
    "export_heads": "medusa_jax.heads.export",
    "load_tree": "medusa_jax.trees.tree",
    "build_tree": "medusa_jax.trees.tree",
    "TreeBuffers": "medusa_jax.trees.tree",
    "prepare_smollm2": "medusa_jax.demo_model",
    "resolve_model_dir": "medusa_jax.demo_model",
    "resolve_heads_dir": "medusa_jax.assets",
    # text
    "load_tokenizer": "medusa_jax.text",
    "encode_prompt": "medusa_jax.text",
    "eos_token_ids": "medusa_jax.text",
    # decoding: one front-end (inference/api.py); a single device is a mesh of one
    "generate": "medusa_jax.inference.api",
    "generate_medusa": "medusa_jax.inference.api",
    "generate_batch": "medusa_jax.inference.api",
    "BatchSettings": "medusa_jax.inference.api",
    "GenerationResult": "medusa_jax.inference.api",
    "load_sharded": "medusa_jax.inference.sharded",
    "SamplingConfig": "medusa_jax.inference.sampling",
    "AcceptanceConfig": "medusa_jax.inference.acceptance",
    "DecodeConfig": "medusa_jax.inference.acceptance",
}

__all__ = sorted(_API)


def __getattr__(name: str):
    module = _API.get(name)
    if module is None:
        raise AttributeError(f"module 'medusa_jax' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
