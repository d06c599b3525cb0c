"""Self-distillation on a tiny chat model: ShareGPT output, resume, saved hidden states -> training examples."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np

from medusa_jax.training.hidden_store import load_distilled_examples, store_for
from medusa_jax.training.self_distill import DistillConfig, done_ids, hidden_store_path, self_distill
from training_helpers import build_tiny_chat_model, chat_records, write_json


def test_self_distill_writes_sharegpt_resumes_and_keeps_hidden_states(tmp_path):
    from medusa_jax.hf_import import load_pretrained
    from medusa_jax.training.sharegpt import read_conversation_file
    from medusa_jax.training.trainer import backbone_hidden
    from transformers import AutoTokenizer

    model = build_tiny_chat_model(tmp_path / "m")
    source = write_json(tmp_path / "src.json", chat_records(12, seed=2, turns=2))
    out = tmp_path / "distill.jsonl"
    cfg = DistillConfig(max_new_tokens=6, batch_size=4, turns=2, limit=5, save_hidden=True)
    first = self_distill(model, str(source), out, cfg, progress=False, log=lambda _: None)
    assert first["conversations"] == 5 and len(done_ids(out)) == 5
    with open(out, "a") as f:  # a run killed in the middle of writing a line
        f.write('{"id": "half')
    second = self_distill(model, str(source), out, DistillConfig(**{**cfg.__dict__, "limit": 8}), progress=False,
                          log=lambda _: None)
    assert second["conversations"] == 3
    records, report = read_conversation_file(out)
    assert report.truncated_at_byte is None and len({r["id"] for r in records}) == 8 == len(records)
    src = {r["id"]: r for r in json.loads(source.read_text())}
    conv = json.loads(out.read_text().splitlines()[0])["conversations"]
    for r in records:  # the human turns are the source's, the replies are regenerated
        assert [m["role"] for m in r["messages"]] == ["user", "assistant", "user", "assistant"]
        assert [m["content"] for m in r["messages"][::2]] == [t["value"] for t in src[r["id"]]["conversations"][::2]]
    assert conv[0]["from"] == "human" and conv[1]["from"] == "gpt"

    assert store_for(str(out)) == hidden_store_path(out)
    ex = load_distilled_examples(str(out), num_heads=2, heldout_fraction=0.25, seed=0)
    assert ex.num_conversations == (6, 2)
    assert ex.train["hidden"].dtype == np.float16 and ex.train["targets"].shape[1] == 2
    # the saved hidden states are the backbone's: recompute one reply's with a full forward
    base = load_pretrained(model)
    tok = AutoTokenizer.from_pretrained(model)
    z = np.load(sorted(hidden_store_path(out).glob("batch-*.npz"))[0])
    rid, turn = str(z["ids"][0]), int(z["turns"][0])
    rec = next(r for r in records if r["id"] == rid)
    prompt = tok.apply_chat_template(rec["messages"][: 2 * turn + 1], add_generation_prompt=True, tokenize=True,
                                     return_dict=True)["input_ids"]
    reply = z["tokens"][z["offsets"][0]: z["offsets"][1]].tolist()
    full = list(prompt) + reply
    h = backbone_hidden(base, {"tokens": jnp.asarray([full]), "positions": jnp.arange(len(full))[None],
                               "segment_ids": jnp.ones((1, len(full)), jnp.int32)})[0]
    expected = np.asarray(h[len(prompt) - 1: len(prompt) - 1 + len(reply)])
    np.testing.assert_allclose(z["hidden"][: len(reply)], expected, atol=2e-2)


def test_refilled_slots_generate_what_the_engine_generates(tmp_path):
    """Prompts admitted into free slots mid-run (next to rows still decoding) get the engine's greedy tokens,
    and each token comes with the hidden state that produced it."""
    import jax
    from flax import nnx

    from medusa_jax.hf_import import load_pretrained
    from medusa_jax.inference.engine import generate
    from medusa_jax.inference.sampling import SamplingConfig
    from medusa_jax.training.distill_decode import Slots, admit, run_chunk
    from medusa_jax.training.trainer import backbone_hidden

    base = load_pretrained(build_tiny_chat_model(tmp_path / "m", seed=3))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 300, n).tolist() for n in (5, 17, 9, 30, 3)]
    expected = [r.token_ids for r in generate(base, prompts, max_new_tokens=20, eos_ids=(), pad_id=0)]
    graphdef, params = nnx.split(base)
    slots = Slots.empty(base.config, 2, 64)
    got = {i: ([], []) for i in range(len(prompts))}
    queue, rows = list(range(len(prompts))), [None, None]
    greedy = SamplingConfig()
    while queue or any(r is not None for r in rows):
        free = [r for r in range(2) if rows[r] is None]
        take = [(r, queue.pop(0)) for r in free if queue]
        if take:
            width = max(len(prompts[i]) for _, i in take)
            p = np.zeros((len(take), width), np.int32)
            for j, (_, i) in enumerate(take):
                p[j, : len(prompts[i])] = prompts[i]
            slots, first, h0 = admit(graphdef, params, slots, jnp.asarray([r for r, _ in take]), jnp.asarray(p),
                                     jnp.asarray([len(prompts[i]) for _, i in take]), jax.random.key(0),
                                     sampling=greedy, eos_ids=())
            for j, (r, i) in enumerate(take):
                rows[r] = i
                got[i][0].append(int(first[j]))
                got[i][1].append(np.asarray(h0[j: j + 1]))
        slots, toks, hid, emitted = run_chunk(graphdef, params, slots, jax.random.key(1), steps=7,
                                              max_new_tokens=20, sampling=greedy, eos_ids=(), pad_id=0)
        for r, i in enumerate(rows):
            if i is None:
                continue
            e = int(emitted[r])
            got[i][0].extend(np.asarray(toks[r, :e]).tolist())
            got[i][1].append(np.asarray(hid[r, :e]))
            if len(got[i][0]) >= 20:
                rows[r] = None
    for i, prompt in enumerate(prompts):
        assert got[i][0] == expected[i], i
        full = prompt + got[i][0]
        h = backbone_hidden(base, {"tokens": jnp.asarray([full]), "positions": jnp.arange(len(full))[None],
                                   "segment_ids": jnp.ones((1, len(full)), jnp.int32)})[0]
        np.testing.assert_allclose(np.concatenate(got[i][1]), np.asarray(h[len(prompt) - 1: len(full) - 1]),
                                   atol=1e-4)
