"""SmolLM2 on this CPU: the cache paths' attention settings (issue 41 item 2), interleaved in one run.

Times the backbone forward over a KV cache (the part `LayerExecution.attention` changes; the logits and heads
are the same for every setting) for each setting of --kinds, taking the kinds in turn within every round so that
load from other processes falls on all of them alike:
  prefill  B prompts of T tokens from slot 0 into a fresh cache of T slots (as `grouped_prefill` runs a group)
  verify   a tree's N nodes over a cache of --cache slots holding --committed tokens per row (mask: the tree
           mc_sim_7b_63's first N nodes, each seeing its ancestors only)
One JSON line per case: each kind's median seconds over --rounds and its ratio to the first kind. "grouped" is the
cache paths' attention before issue 41, timed only on prompts longer than PREFILL_QUERY_CHUNK (below, chunked is it).

  python bench/cache_attention.py --kinds chunked,xla,grouped --batches 1,4 --prompts 128,1024 --nodes 4,16,64
"""

from __future__ import annotations

import argparse
import json
import time
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from medusa_jax.demo_model import resolve_model_dir
from medusa_jax.hf.load import load_pretrained
from medusa_jax.model import backbone
from medusa_jax.model.attention import PREFILL_QUERY_CHUNK, grouped_attention
from medusa_jax.model.backbone import with_layer_execution
from medusa_jax.model.config import LayerExecution
from medusa_jax.model.kv_cache import KVCache, attention_mask, causal_block
from medusa_jax.trees.tree import load_tree


def jitted_forward(model, grouped: bool = False):
    """The backbone's forward over a cache, jitted with the weights as arguments (no per-call graph walk) and the
    cache donated (updated in place, as in the decode loop): returns (hidden, cache). grouped: traced with the
    cache paths' attention before issue 41 (`grouped_attention` over every query at once), the baseline."""
    graphdef, state = nnx.split(model)

    def forward(state, *inputs):
        if not grouped:
            return nnx.merge(graphdef, state)(*inputs)
        before = lambda q, k, v, mask, kind: grouped_attention(q, k, v, mask)
        with mock.patch.object(backbone, "cache_attention", before):
            return nnx.merge(graphdef, state)(*inputs)  # the patch holds while jit traces, the only time this runs

    run = jax.jit(forward, donate_argnums=(4,))
    return lambda *inputs: run(state, *inputs)


def tree_block(nodes: int) -> np.ndarray:
    """[N, N] bool: node i sees itself and its ancestors among the first N nodes of mc_sim_7b_63."""
    return np.asarray(load_tree("mc_sim_7b_63").ancestor_mask_tt)[:nodes, :nodes]


def case_inputs(config, batch: int, tokens: int, slots: int, committed: int, block_tt: np.ndarray):
    rng = np.random.default_rng(0)
    tokens_bt = jnp.asarray(rng.integers(0, config.vocab_size, (batch, tokens)), jnp.int32)
    depth_t = block_tt.sum(axis=1) - 1  # a node's depth: its ancestors (a causal block: its index)
    positions_bt = jnp.broadcast_to(jnp.asarray(committed + depth_t, jnp.int32), (batch, tokens))
    cache = KVCache.zeros(config, batch, slots)
    cache = cache.replace(lengths_b=jnp.full((batch,), committed, jnp.int32))
    mask_bts = attention_mask(cache.lengths_b, jnp.asarray(block_tt), slots)
    return tokens_bt, positions_bt, mask_bts, cache


def compare(models: dict, inputs, rounds: int) -> dict[str, float]:
    """Median seconds per kind, the kinds timed in turn in each round (after one compiling call each)."""
    *given, cache = inputs
    caches = {kind: jax.tree.map(jnp.copy, cache) for kind in models}  # each kind's own, donated and given back
    for kind, forward in models.items():
        caches[kind] = jax.block_until_ready(forward(*given, caches[kind]))[1]
    times = {kind: [] for kind in models}
    for _ in range(rounds):
        for kind, forward in models.items():
            start = time.perf_counter()
            caches[kind] = jax.block_until_ready(forward(*given, caches[kind]))[1]
            times[kind].append(time.perf_counter() - start)
    return {kind: float(np.median(t)) for kind, t in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kinds", default="chunked,xla,grouped", help="LayerExecution.attention settings, or grouped (the "
                   "path before them); ratios to the first")
    p.add_argument("--batches", default="1,4")
    p.add_argument("--prompts", default="128,1024", help="prefill prompt lengths")
    p.add_argument("--nodes", default="4,16,64", help="tree nodes per verify step")
    p.add_argument("--cache", type=int, default=512, help="cache slots of a verify step")
    p.add_argument("--committed", type=int, default=256, help="committed tokens per row in a verify step")
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    base = load_pretrained(resolve_model_dir("default"))
    kinds = args.kinds.split(",")
    models = {kind: jitted_forward(base, grouped=True) if kind == "grouped" else
              jitted_forward(with_layer_execution(base, LayerExecution(attention=kind))) for kind in kinds}
    cases = [("prefill", b, t, t, 0, causal_block(t)) for b in map(int, args.batches.split(","))
             for t in map(int, args.prompts.split(","))]
    cases += [("verify", b, n, args.cache, args.committed, tree_block(n)) for b in map(int, args.batches.split(","))
              for n in map(int, args.nodes.split(","))]
    for name, batch, tokens, slots, committed, block_tt in cases:
        # up to PREFILL_QUERY_CHUNK tokens chunked is grouped_attention itself: the baseline runs on longer prompts
        timed = {k: f for k, f in models.items() if k != "grouped" or tokens > PREFILL_QUERY_CHUNK}
        seconds = compare(timed, case_inputs(base.config, batch, tokens, slots, committed, block_tt), args.rounds)
        print(json.dumps({"case": name, "batch": batch, "tokens": tokens, "slots": slots,
                          "seconds": {k: round(v, 5) for k, v in seconds.items()},
                          "ratio": {k: round(v / seconds[kinds[0]], 3) for k, v in seconds.items()}}), flush=True)


if __name__ == "__main__":
    main()
