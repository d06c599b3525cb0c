"""The cache paths' attention settings (attention.cache_attention; issue 41 item 2): prefill and a tree's verify
through `jax.nn.dot_product_attention` or query blocks give the logits and KV cache of `grouped_attention` (the
path before them), the tree mask keeps siblings apart, and Medusa's greedy decoding stays token-identical to
plain decoding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from medusa_jax.heads.config import HeadsConfig
from medusa_jax.heads.init import init_heads
from medusa_jax.inference.api import generate, generate_medusa
from medusa_jax.model.attention import cache_attention, chunked_attention, grouped_attention
from medusa_jax.model.backbone import CausalLM, with_layer_execution
from medusa_jax.model.config import LayerExecution, ModelConfig
from medusa_jax.model.kv_cache import KVCache, attention_mask, causal_block
from medusa_jax.trees.tree import load_tree

CFG = ModelConfig(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=6, num_kv_heads=2, head_dim=16)
B, PROMPT, SLOTS, NODES = 2, 24, 64, 12
TREE = load_tree("mc_sim_7b_63")
BLOCK_TT = np.asarray(TREE.ancestor_mask_tt)[:NODES, :NODES]  # the first nodes: each one's ancestors come before it
DEPTH_T = np.asarray(TREE.depth_t)[:NODES]


def _close(ours, ref, rtol, atol_frac):
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(ref)):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol_frac * np.abs(b).max())


def _prefill_and_verify(model, tokens_bt):
    """(logits, cache) of a prefill of PROMPT tokens, then (logits, cache) of one verify of NODES tree tokens."""
    cache = KVCache.zeros(model.config, B, SLOTS)
    positions_bt = jnp.broadcast_to(jnp.arange(PROMPT), (B, PROMPT))
    hidden_btd, cache = model(tokens_bt[:, :PROMPT], positions_bt,
                              attention_mask(cache.lengths_b, causal_block(PROMPT), SLOTS), cache)
    prefilled = (model.logits(hidden_btd), cache)
    cache = cache.replace(lengths_b=jnp.asarray([PROMPT, PROMPT - 5], jnp.int32))  # ragged rows
    positions_bt = cache.lengths_b[:, None] + jnp.asarray(DEPTH_T)[None]  # depth-based positions
    hidden_btd, cache = model(tokens_bt[:, PROMPT:], positions_bt,
                              attention_mask(cache.lengths_b, jnp.asarray(BLOCK_TT), SLOTS), cache)
    return prefilled, (model.logits(hidden_btd), cache)


def _model(execution, dtype="float32"):
    model = CausalLM(CFG, nnx.Rngs(0))
    state = jax.tree.map(lambda x: x.astype(dtype), nnx.state(model))
    model = nnx.merge(nnx.graphdef(nnx.eval_shape(lambda: CausalLM(CFG.replace(dtype=dtype), nnx.Rngs(0)))), state)
    return with_layer_execution(model, execution)


FP32, BF16 = ("float32", 2e-5, 2e-6), ("bfloat16", 3e-2, 3e-2)  # dtype, rtol, atol as a fraction of the largest


@pytest.mark.parametrize("execution, dtype, rtol, atol_frac",
                         [(LayerExecution(attention="xla"), *FP32), (LayerExecution(attention="xla"), *BF16),
                          (LayerExecution(scan=True, attention="xla"), *FP32)],
                         ids=["xla-fp32", "xla-bf16", "scan-xla-fp32"])
def test_prefill_and_verify_equal_grouped_attention(execution, dtype, rtol, atol_frac):
    tokens_bt = jax.random.randint(jax.random.key(1), (B, PROMPT + NODES), 0, CFG.vocab_size)
    run = jax.jit(_prefill_and_verify)
    reference = LayerExecution(scan=execution.scan)  # the default kind: grouped_attention for these few tokens
    ours, ref = run(_model(execution, dtype), tokens_bt), run(_model(reference, dtype), tokens_bt)
    _close(ours, ref, rtol, atol_frac)


def test_query_blocks_over_the_cache_equal_grouped_attention():
    """Chunked attention over the stored cache layout (three blocks of 5 queries, the last padded), under a tree
    mask, without the backward's checkpoint, gives grouped_attention's output; the default kind runs decode and
    verify as one block, grouped_attention itself."""
    rs = np.random.RandomState(0)
    q = jnp.asarray(rs.randn(B, NODES, 2, 3, 16), jnp.float32)
    k_bkhs, v_bksh = jnp.asarray(rs.randn(B, 2, 16, SLOTS), jnp.float32), jnp.asarray(rs.randn(B, 2, SLOTS, 16))
    mask_bts = attention_mask(jnp.asarray([30, 9], jnp.int32), jnp.asarray(BLOCK_TT), SLOTS)
    ref = grouped_attention(q, k_bkhs, v_bksh, mask_bts)
    _close(chunked_attention(q, k_bkhs, v_bksh, mask_bts, chunk=5, recompute=False), ref, 2e-5, 2e-6)
    np.testing.assert_array_equal(np.asarray(cache_attention(q, k_bkhs, v_bksh, mask_bts, "chunked")),
                                  np.asarray(ref))


def test_a_tree_node_sees_its_ancestors_not_its_siblings():
    model = _model(LayerExecution(attention="xla"))
    tokens_bt = jax.random.randint(jax.random.key(3), (B, PROMPT + NODES), 0, CFG.vocab_size)
    parent_t = np.asarray(TREE.parent_t)[:NODES]
    node = next(i for i in range(1, NODES) if (parent_t[1:i] == parent_t[i]).any())  # one with an earlier sibling
    sibling = next(i for i in range(1, node) if parent_t[i] == parent_t[node])
    run = jax.jit(lambda t: _prefill_and_verify(model, t)[1][0])
    logits = run(tokens_bt)
    changed = run(tokens_bt.at[:, PROMPT + sibling].set((tokens_bt[:, PROMPT + sibling] + 1) % CFG.vocab_size))
    np.testing.assert_array_equal(np.asarray(changed[:, node]), np.asarray(logits[:, node]))
    assert not np.array_equal(np.asarray(changed[:, sibling]), np.asarray(logits[:, sibling]))
    parent = int(parent_t[node])  # the root's index is 0: an ancestor of every node
    changed = run(tokens_bt.at[:, PROMPT + parent].set((tokens_bt[:, PROMPT + parent] + 1) % CFG.vocab_size))
    assert not np.array_equal(np.asarray(changed[:, node]), np.asarray(logits[:, node]))


def test_greedy_medusa_equals_plain_decoding_under_xla_attention():
    base = _model(LayerExecution(attention="xla"))
    heads = init_heads(HeadsConfig(CFG.hidden_size, CFG.vocab_size, num_heads=3, num_layers=1, lm_head="shared"),
                       base)
    prompts = [list(range(3, 14)), list(range(40, 47))]
    plain = [r.token_ids for r in generate(base, prompts, max_new_tokens=16, eos_ids=())]
    medusa = [r.token_ids for r in generate_medusa(base, heads, prompts, tree="mc_sim_7b_16", max_new_tokens=16,
                                                   eos_ids=())]
    assert medusa == plain and all(len(tokens) == 16 for tokens in plain)
