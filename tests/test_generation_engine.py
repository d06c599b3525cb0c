"""The generation engine (inference/generation_engine.py): requests admitted into free rows of a chunked jitted
decode make `generate`'s greedy tokens under either admission policy; per-row sampling draws from
`target_logits`'s distribution and depends on a request's seed only; cancellation frees the row; a full queue
refuses; stop strings end the streamed text."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from medusa_jax.compile_cache import CompileCounter
from medusa_jax.hf.load import load_pretrained
from medusa_jax.heads.config import HeadsConfig
from medusa_jax.heads.init import init_heads
from medusa_jax.trees.tree import load_tree
from medusa_jax.inference.api import generate, generate_medusa
from medusa_jax.inference.generation_engine import EngineConfig, GenerationEngine
from medusa_jax.inference.engine_requests import EngineClosed, QueueFull, RequestParams
from medusa_jax.inference.row_sampling import RowSampling, row_target_logits, sample_rows
from medusa_jax.inference.sampling import SamplingConfig, target_logits
from medusa_jax.inference.text_stream import TextStream
from decode_helpers import prompts_of, randomise_kernels


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_pretrained(tiny_model_dir("llama", seed=1))


@pytest.mark.parametrize("admission", ["fifo", "sorted"])
def test_engine_greedy_tokens_equal_generate(model, admission):
    """7 prompts through 3 rows (rows refilled mid-run), with an EOS that ends some replies early: every reply
    equals `generate`'s, EOS included; each finishes once, with the right reason."""
    prompts = prompts_of((5, 70, 9, 2, 33, 17, 4))
    eos = (generate(model, prompts[:1], max_new_tokens=11, eos_ids=())[0].token_ids[4],)
    want = [generate(model, [p], max_new_tokens=11, eos_ids=eos)[0].token_ids for p in prompts]
    assert any(t[-1] in eos and len(t) < 11 for t in want) and any(len(t) == 11 for t in want)
    engine = GenerationEngine(model, EngineConfig(rows=3, context=128, chunk_steps=4, admission=admission), eos_ids=eos)
    engine.warm_up()
    with CompileCounter() as compiles:
        assert engine.generate_all(prompts, RequestParams(max_tokens=11)) == want
    assert compiles.requests == 0  # every call shape was compiled ahead
    finished = engine.metrics.finished
    assert finished == {"stop": sum(t[-1] in eos for t in want), "length": sum(t[-1] not in eos for t in want)}
    assert engine.rows_busy == 0 and engine.queue_depth == 0
    assert engine.metrics.generated_tokens == sum(map(len, want))


def random_heads(model, head_type: str):
    heads = init_heads(HeadsConfig(model.config.hidden_size, model.config.vocab_size, num_heads=3,
                                   head_type=head_type), model, seed=0)
    randomise_kernels([linear for head in heads.heads
                       for linear in [block.linear for block in head.blocks] + [getattr(head, "input_proj", None)]
                       if linear is not None], 0)
    return heads


@pytest.mark.parametrize("head_type", ["medusa", "hydra"])
def test_engine_with_heads_decodes_trees_with_generates_greedy_tokens(model, head_type):
    """The engine's drafter: rows refilled mid-run decode with the heads' tree and still make `generate`'s greedy
    tokens (EOS, per-request budgets and stop ids cut a step's accepted run where they fall); the verify steps and
    accepted tokens are those of `generate_medusa`; sampled requests are refused."""
    heads = random_heads(model, head_type)
    tree = load_tree("mc_sim_7b_8", num_heads=3, max_top_k=heads.config.head_vocab_size)
    prompts = prompts_of((5, 70, 9, 2, 33, 17, 4))
    eos = (generate(model, prompts[:1], max_new_tokens=11, eos_ids=())[0].token_ids[4],)
    want = [generate(model, [p], max_new_tokens=11, eos_ids=eos)[0].token_ids for p in prompts]
    engine = GenerationEngine(model, EngineConfig(rows=3, context=128, chunk_steps=3), eos_ids=eos, heads=heads,
                              tree=tree)
    assert engine.warm_up() == 3 * 3 + 1  # admission sizes (1, 2, 3) x widths (64, 96, 128), and the chunk
    with CompileCounter() as compiles:  # every call shape was compiled ahead: requests wait for no compilation
        assert engine.generate_all(prompts, RequestParams(max_tokens=11)) == want
    assert compiles.requests == 0
    medusa = [generate_medusa(model, heads, [p], tree=tree, max_new_tokens=11, eos_ids=eos)[0] for p in prompts]
    assert engine.metrics.row_steps == sum(len(r.accept_lengths) for r in medusa)
    assert engine.metrics.step_tokens - engine.metrics.row_steps == sum(sum(r.accept_lengths) for r in medusa) > 0
    short = engine.generate_all(prompts[:2], RequestParams(max_tokens=4))
    assert short == [w[:4] for w in want[:2]]
    stop_at = want[1][2]
    assert engine.generate_all(prompts[1:2], RequestParams(max_tokens=11, stop_ids=(stop_at,)))[0] == \
        want[1][: want[1].index(stop_at) + 1]


def random_drafter(model, head_type: str):
    """An EAGLE-1 or EAGLE-3 drafter (a state built from the prompt) with random weights that vary its drafts."""
    extra = dict(feature_layers=(0, 1, 2)) if head_type == "eagle3" else {}
    drafter = init_heads(HeadsConfig(model.config.hidden_size, model.config.vocab_size, num_heads=3,
                                     head_type=head_type, **extra), model, seed=0)
    rng = np.random.RandomState(0)
    for path, var in nnx.iter_graph(drafter):
        if isinstance(var, nnx.Param) and var[...].ndim == 2 and "lm_head" not in map(str, path):
            var[...] = jnp.asarray(rng.normal(0, 0.3, var[...].shape), var[...].dtype)
    return drafter


@pytest.mark.parametrize("head_type", ["eagle", "eagle3"])
def test_engine_with_a_drafter_state_per_row_decodes_generates_greedy_tokens(model, head_type):
    """Drafters that keep a state (EAGLE, EAGLE-3): each admitted row's state is built from its prompt, rows are
    refilled mid-run, and every reply equals `generate`'s greedy tokens (EOS included); the accepted tokens are
    `generate_medusa`'s."""
    drafter = random_drafter(model, head_type)
    tree = load_tree("mc_sim_7b_8", num_heads=3)
    prompts = prompts_of((5, 70, 9, 2, 33))
    eos = (generate(model, prompts[:1], max_new_tokens=10, eos_ids=())[0].token_ids[4],)
    want = [generate(model, [p], max_new_tokens=10, eos_ids=eos)[0].token_ids for p in prompts]
    engine = GenerationEngine(model, EngineConfig(rows=2, context=128, chunk_steps=3), eos_ids=eos, heads=drafter,
                              tree=tree)
    assert engine.generate_all(prompts, RequestParams(max_tokens=10)) == want
    medusa = [generate_medusa(model, drafter, [p], tree=tree, max_new_tokens=10, eos_ids=eos)[0] for p in prompts]
    assert engine.metrics.step_tokens - engine.metrics.row_steps == sum(sum(r.accept_lengths) for r in medusa)


def test_engine_with_heads_shares_steps_between_greedy_and_sampled_rows(model):
    """Sampling with heads: greedy and sampled requests share the drafted steps; greedy rows still equal
    `generate`, a sampled request's tokens depend on its seed only (not on its row or neighbours: the same
    alone), another seed draws another reply, and at a near-zero temperature exact acceptance gives greedy's
    tokens (the law of sampled rows: tests/test_exact_sampling.py's per-row check)."""
    heads = random_heads(model, "medusa")
    tree = load_tree("mc_sim_7b_8", num_heads=3, max_top_k=heads.config.head_vocab_size)
    prompts = prompts_of((6, 12, 3, 20))
    greedy = RequestParams(max_tokens=12)
    sampled = RequestParams(max_tokens=12, sampling=SamplingConfig(0.8, 0.95, 20), seed=5)
    engine = GenerationEngine(model, EngineConfig(rows=4, context=64, chunk_steps=3), eos_ids=(), heads=heads,
                              tree=tree)
    mixed = [engine.submit(p, greedy if i % 2 else sampled) for i, p in enumerate(prompts)]
    while any(r.finish_reason is None for r in mixed):
        engine.run_once()
    assert engine.metrics.step_tokens > engine.metrics.row_steps  # some candidates were accepted
    assert [r.tokens for r in mixed[1::2]] == [generate(model, [p], max_new_tokens=12, eos_ids=())[0].token_ids
                                               for p in prompts[1::2]]
    alone = [engine.generate_all([p], sampled)[0] for p in prompts[::2]]
    assert [r.tokens for r in mixed[::2]] == alone and all(len(t) == 12 for t in alone)
    assert engine.generate_all(prompts[::2], sampled) == alone
    assert engine.generate_all(prompts[:1], RequestParams(12, sampled.sampling, seed=6))[0] != alone[0]
    cold = RequestParams(12, SamplingConfig(1e-4), seed=3)  # exact acceptance of a near point mass: greedy's tokens
    assert engine.generate_all(prompts[:2], cold) == [generate(model, [p], max_new_tokens=12, eos_ids=())[0].token_ids
                                                      for p in prompts[:2]]


def test_engine_rows_keep_their_own_settings(model):
    """Greedy and sampled requests share the steps: greedy rows still equal `generate`; a sampled request's tokens
    depend on its seed only (not on its row or neighbours), a per-request stop id and budget end it."""
    prompts = prompts_of((6, 12, 3, 20))
    greedy = RequestParams(max_tokens=9)
    sampled = RequestParams(max_tokens=9, sampling=SamplingConfig(1.2, 0.9, 30), seed=7)
    engine = GenerationEngine(model, EngineConfig(rows=4, context=64, chunk_steps=3), eos_ids=())
    mixed = [engine.submit(p, greedy if i % 2 else sampled) for i, p in enumerate(prompts)]
    while any(r.finish_reason is None for r in mixed):
        engine.run_once()
    alone = [engine.generate_all([p], sampled)[0] for p in prompts[::2]]
    assert [r.tokens for r in mixed[::2]] == alone
    assert [r.tokens for r in mixed[1::2]] == [generate(model, [p], max_new_tokens=9, eos_ids=())[0].token_ids
                                               for p in prompts[1::2]]
    other_seed = engine.generate_all(prompts[:1], RequestParams(9, sampled.sampling, seed=8))[0]
    assert other_seed != alone[0]
    stop_at = alone[0][3]
    stopped = engine.generate_all(prompts[:1], RequestParams(9, sampled.sampling, 7, stop_ids=(stop_at,)))[0]
    assert stopped == alone[0][: alone[0].index(stop_at) + 1]


def test_row_sampling_is_target_logits_row_by_row():
    """Each row's distribution is `sampling.target_logits` with that row's settings (ties at the k-th kept)."""
    rng = np.random.RandomState(0)
    logits_bv = jnp.asarray(rng.normal(size=(5, 50)) * 3, jnp.float32).at[3, :6].set(4.0)
    configs = [SamplingConfig(0.7), SamplingConfig(1.0, top_k=5), SamplingConfig(1.3, top_p=0.6),
               SamplingConfig(0.9, top_p=0.8, top_k=4), SamplingConfig(1.0, top_p=0.3, top_k=10)]
    got = np.asarray(row_target_logits(logits_bv, RowSampling.of(configs, range(5))))
    for i, config in enumerate(configs):
        want = np.asarray(target_logits(logits_bv[i: i + 1], config))[0]
        np.testing.assert_array_equal(np.isinf(got[i]), np.isinf(want))
        np.testing.assert_allclose(got[i][~np.isinf(got[i])], want[~np.isinf(want)], rtol=1e-6, atol=1e-6)
    # greedy rows take the argmax; the draw of token i depends on (seed, i) only
    rows = RowSampling.of([SamplingConfig(), SamplingConfig(1.0)], [0, 11])
    index_b = jnp.asarray([0, 4])
    first = sample_rows(logits_bv[:2], rows, index_b)
    assert int(first[0]) == int(jnp.argmax(logits_bv[0]))
    swapped = sample_rows(logits_bv[1::-1], RowSampling.of([SamplingConfig(1.0), SamplingConfig()], [11, 0]),
                          index_b[::-1])
    assert int(swapped[0]) == int(first[1])
    assert jax.device_get(sample_rows(logits_bv[:2], RowSampling.greedy(2), index_b)).tolist() == \
        np.argmax(np.asarray(logits_bv[:2]), axis=1).tolist()


def test_cancel_frees_the_row_and_a_full_queue_refuses(model):
    engine = GenerationEngine(model, EngineConfig(rows=1, context=64, chunk_steps=2, max_queue=3), eos_ids=())
    running = engine.submit([5, 6, 7], RequestParams(max_tokens=40))
    waiting = engine.submit([8, 9], RequestParams(max_tokens=3))
    third = engine.submit([8, 9, 10], RequestParams(max_tokens=3))
    with pytest.raises(QueueFull, match="3 requests are waiting"):
        engine.submit([1], RequestParams(max_tokens=3))
    engine.run_once()  # admits `running` only: one row
    assert engine.rows_busy == 1 and engine.queue_depth == 2 and 0 < len(running.tokens) < 40
    engine.cancel(running)
    engine.cancel(third)
    engine.run_once()  # the row is freed and `waiting` takes it: its first token + one chunk of 2 = 3 tokens
    assert running.finish_reason == "cancelled" and third.finish_reason == "cancelled"
    assert waiting.finish_reason == "length" and engine.queue_depth == 0 and engine.rows_busy == 0
    assert waiting.tokens == generate(model, [[8, 9]], max_new_tokens=3, eos_ids=())[0].token_ids
    events = []
    while not running.events.empty():
        events.append(running.events.get())
    assert sum(e.finish_reason is not None for e in events) == 1 and events[-1].finish_reason == "cancelled"
    for bad, match in (([], "empty"), ([500], r"token ids must be in \[0, 128\)")):
        with pytest.raises(ValueError, match=match):
            engine.submit(bad, RequestParams())
    with pytest.raises(ValueError, match="lower max_tokens to at most 61"):
        engine.submit([1, 2, 3], RequestParams(max_tokens=62))
    with pytest.raises(ValueError, match="shorten the prompt to at most 63 tokens"):
        engine.submit([1] * 64, RequestParams(max_tokens=1))
    with pytest.raises(ValueError, match="top_k must be at most the vocabulary size 128"):  # not int32's overflow
        engine.submit([1], RequestParams(sampling=SamplingConfig(0.5, top_k=2**40)))
    engine.close()
    with pytest.raises(EngineClosed):
        engine.submit([1], RequestParams())


class WordTokenizer:
    """decode: ids -> words joined by spaces; id 9 decodes to a half character (U+FFFD) until id 10 follows."""

    def decode(self, ids, skip_special_tokens=True):
        text = " ".join(f"w{i}" for i in ids if i not in (9, 10))
        return text + ("\ufffd" if ids and ids[-1] == 9 else "é" if 9 in ids else "")


def test_text_stream_holds_back_partial_characters_and_stop_strings():
    stream = TextStream(WordTokenizer(), stop=("w3 w4",))
    assert stream.push([1, 2]) == "w1 w2"
    assert stream.push([3]) == " "  # "w3" may start the stop string
    assert stream.push([5]) == "w3 w5"
    assert stream.token_count == 4
    assert stream.push([3, 4, 6]) == " " and stream.stopped  # text ends before the stop string
    assert stream.push([7]) == "" and stream.finish() == ""
    assert stream.token_count == 6  # the reply's usage: through the 4 that completed the stop string, not the 6
    partial = TextStream(WordTokenizer())
    assert partial.push([1, 9]) == "w1"  # half a character waits
    assert partial.push([10]) == "é" and partial.finish() == "" and partial.token_count == 3
