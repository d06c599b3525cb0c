"""Tied-embedding logits of a few rows (a tree verify, the heads' drafts) keep the [V, x] product on a CPU
(`backbone.FEW_ROWS`, `CausalLM.logits`): the same logits as one row at a time, and the compiled dot has the
embedding as its left operand; a plain step's one row and many rows compile as before."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from medusa_jax.model.backbone import FEW_ROWS, CausalLM
from medusa_jax.model.config import ModelConfig

CFG = ModelConfig(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=1,
                  num_heads=4, num_kv_heads=2, head_dim=16, tie_word_embeddings=True)
_DOT = re.compile(r"f32\[(\d+),(\d+)\]\{[\d,]+\} dot\(")


def _logits_fn():
    model = CausalLM(CFG, nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    return jax.jit(lambda state, hidden: nnx.merge(graphdef, state).logits(hidden)), state, model


@pytest.mark.parametrize("rows", [2, 5, 17, FEW_ROWS, FEW_ROWS + 1])
def test_few_rows_equal_float64_and_one_row_at_a_time(rows):
    logits, state, model = _logits_fn()
    hidden_btd = jax.random.normal(jax.random.key(rows), (1, rows, CFG.hidden_size)) * 3.0
    got_btv = np.asarray(logits(state, hidden_btd))
    embedding_vd = np.asarray(model.embed_tokens.embedding[...], np.float64)
    want_tv = np.asarray(hidden_btd[0], np.float64) @ embedding_vd.T
    # float32 accumulation over D terms: tolerance from the magnitudes of the products summed
    scale = np.abs(np.asarray(hidden_btd[0], np.float64)) @ np.abs(embedding_vd).T
    np.testing.assert_array_less(np.abs(got_btv[0] - want_tv), 1e-5 * scale + 1e-6)
    one_row_tv = np.concatenate([np.asarray(logits(state, hidden_btd[:, t:t + 1]))[0] for t in range(rows)])
    np.testing.assert_allclose(got_btv[0], one_row_tv, rtol=1e-5, atol=1e-5 * float(scale.max()))


@pytest.mark.parametrize("rows, embedding_left", [(1, True), (2, True), (5, True), (FEW_ROWS, True),
                                                  (FEW_ROWS + 1, False)])
def test_compiled_dot_keeps_the_embedding_left_for_few_rows(rows, embedding_left):
    """[V, x] out of the dot (the embedding its left operand) for 1..FEW_ROWS rows; above, XLA's own choice
    ([x, V], the transpose folded into the dot), as before."""
    if jax.default_backend() != "cpu":
        pytest.skip("the few-row layout is a CPU choice")
    logits, state, _ = _logits_fn()
    hlo = logits.lower(state, jnp.zeros((1, rows, CFG.hidden_size))).compile().as_text()
    dots = [tuple(int(x) for x in m.groups()) for m in _DOT.finditer(hlo)]
    assert dots == [(CFG.vocab_size, rows) if embedding_left else (rows, CFG.vocab_size)]


@pytest.mark.parametrize("rows", [1, 2])
def test_engine_tree_steps_compile_without_ynnpack_for_one_row_and_its_prefill_with(rows):
    """The engine's tree-step chunk over one row compiles with `TREE_STEP_COMPILER_OPTIONS` (XLA's own dots:
    YNNPACK's fusion costs a one-row tree step more), over more rows with YNNPACK (a plain step's dots are then
    YNNPACK's, and a mixed step that skips the drafting is a plain step; backbone.py); its admission (the prefill,
    hundreds of rows) keeps YNNPACK."""
    if jax.default_backend() != "cpu":
        pytest.skip("the option chooses among XLA:CPU's dot emitters")
    from medusa_jax.heads.config import HeadsConfig
    from medusa_jax.heads.init import init_heads
    from medusa_jax.trees.tree import load_tree
    from medusa_jax.inference.drafted_rows import DraftedDecoder, drafted_admit, drafted_chunk
    from medusa_jax.inference.row_sampling import RowSampling

    base = CausalLM(CFG, nnx.Rngs(0))
    heads = init_heads(HeadsConfig(CFG.hidden_size, CFG.vocab_size, num_heads=3), base, seed=0)
    tree = load_tree("mc_sim_7b_8", num_heads=3, max_top_k=CFG.vocab_size)
    decoder = DraftedDecoder(base, heads, tree, rows=rows, context=64, steps=2, eos_ids=(), pad_id=0)
    chunk = drafted_chunk(rows).lower(*decoder._chunk_args(np.zeros((rows,), np.int32), False), tree=tree, steps=2,
                                      eos_ids=(), pad_id=0, proposer=decoder.proposer).compile().as_text()
    zeros_n = np.zeros((rows,), np.int32)
    admit = drafted_admit.lower(decoder.graphdef, decoder.params, decoder.state, decoder.sampling, zeros_n,
                                np.zeros((rows, 64), np.int32), zeros_n + 1, RowSampling.greedy(rows), tree=tree,
                                eos_ids=()).compile().as_text()
    if rows == 1:
        assert " dot(" in chunk and "__ynn_fusion" not in chunk
    else:
        assert "__ynn_fusion" in chunk
    assert "__ynn_fusion" in admit
