"""Token Recycling (medusa_jax/heads/recycle.py): the table update and the drafts against NumPy references,
lossless greedy decoding (fresh and warm tables, batch 1 and ragged batches with a mid-run EOS, tiny Llama, Qwen2
and Mistral), the table kept warm across calls, table files, and the command line."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from medusa_jax.hf.load import load_pretrained
from medusa_jax.model.sharding import MeshConfig
from medusa_jax.heads.config import HeadsConfig
from medusa_jax.heads.init import init_heads
from medusa_jax.heads import recycle, recycle_file
from medusa_jax.heads.recycle import (TEMPLATES, RecycleConfig, RecycleDrafter, best_first_paths, draft_tokens,
                                      empty_table, recycle_update, template_tree)
from medusa_jax.trees.tree import build_tree, load_tree
from medusa_jax.inference.api import BatchSettings, generate, generate_batch, generate_medusa
from medusa_jax.inference.sharded import ShardedModel

N = 40
PROMPTS = {
    "batch1": [[5, 9, 2, 17, 33, 4]],
    "ragged4": [[11, 3, 8, 21, 7, 2], [40, 41, 9, 13, 5, 77, 61, 2, 19, 30, 8, 4, 99], [6, 1, 3],
                [50, 22, 16, 90, 4, 3, 8, 12, 70]],
}


def reference_update(table_vr, tokens_bt, logits_btv, active_b):
    """Writes in flat order b * T + t, so the last (largest index) write of a token id wins."""
    table_vr = table_vr.copy()
    top_btr = np.argsort(-logits_btv, axis=-1, kind="stable")[..., : table_vr.shape[1]]
    for b in range(tokens_bt.shape[0]):
        for t in range(tokens_bt.shape[1]):
            if active_b[b]:
                table_vr[tokens_bt[b, t]] = top_btr[b, t]
    return table_vr


def test_update_writes_each_nodes_top_k_and_the_largest_index_wins_a_shared_token():
    rng = np.random.default_rng(0)
    vocab, r = 12, 3
    tokens_bt = np.asarray([[1, 4, 4, 7], [4, 1, 9, 9], [2, 2, 2, 5]], np.int32)  # repeats within and across rows
    logits_btv = rng.normal(size=(3, 4, vocab)).astype(np.float32)
    active_b = np.asarray([True, True, False])
    table = rng.integers(0, vocab, (vocab, r)).astype(np.int32)
    got = np.asarray(jax.jit(recycle_update)(jnp.asarray(table), tokens_bt, logits_btv, active_b))
    want = reference_update(table, tokens_bt, logits_btv, active_b)
    np.testing.assert_array_equal(got, want)
    assert (got[4] == np.argsort(-logits_btv[1, 0])[:r]).all()  # row 1's node 0 is the last write of token 4
    assert (got[2] == table[2]).all() and (got[5] == table[5]).all()  # the inactive row wrote nothing


def test_drafts_follow_the_table_breadth_first():
    vocab, r = 20, 8
    table = np.random.default_rng(1).integers(0, vocab, (vocab, r)).astype(np.int32)
    tree = template_tree("recycle_16", r)
    root_b = np.asarray([3, 11], np.int32)
    got = np.asarray(draft_tokens(jnp.asarray(table), jnp.asarray(root_b), tree))
    for b in range(2):
        for t, path in enumerate(tree.paths, start=1):
            token = root_b[b]
            for rank in path:
                token = table[token, rank]
            assert got[b, t] == token
        assert got[b, 0] == root_b[b]


def test_templates_are_best_first_trees_that_narrow_with_depth():
    for name, paths in TEMPLATES.items():
        assert len(paths) == int(name.split("_")[1])
        assert all(p[:-1] in paths or len(p) == 1 for p in paths)  # prefix-closed
        assert all(p[:-1] + (p[-1] - 1,) in paths for p in paths if p[-1] > 0)  # a rank's better siblings too
    big = build_tree(TEMPLATES["recycle_64"])
    widths = np.bincount(big.depth_t)[1:]
    # depth 1 holds at most the table's 8 ranks; below it the template narrows with depth
    assert widths[0] == 8 and list(widths[1:]) == sorted(widths[1:], reverse=True) and widths[-1] < widths[0]
    assert best_first_paths((0.5, 0.25), 3) == ((0,), (0, 0), (1,))


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    """kind -> (base, {case: (eos_ids, plain greedy token ids per row)}).

    One plain greedy run of all five prompts gives every reference (rows decode independently): greedy decoding
    with an EOS is the run without it cut after the row's first EOS (test_loader checks that `generate` does
    exactly that), so one compile per model serves both cases."""
    made = {}

    def get(kind):
        if kind not in made:
            base = load_pretrained(tiny_model_dir(kind, initializer_range=0.3))
            first, *free = [r.token_ids for r in generate(base, PROMPTS["batch1"] + PROMPTS["ragged4"],
                                                          max_new_tokens=N, eos_ids=())]
            eos = next(int(t) for p, t in enumerate(free[1]) if p >= N // 3 and t not in free[1][:p])
            cut = [row[: row.index(eos) + 1] if eos in row else row for row in free]
            refs = {"batch1": ((), [first]), "ragged4": ((eos,), cut)}
            assert len(refs["ragged4"][1][1]) < N  # row 1 stops at the EOS, mid-generation
            made[kind] = (base, refs)
        return made[kind]

    return get


def drafter_for(base, table=None):
    return RecycleDrafter(RecycleConfig(base.config.hidden_size, base.config.vocab_size), table)


# each case: one compile, run twice (a fresh table, then the table the first call ended with)
CASES = [("llama", "recycle_16", "ragged4"), ("llama", "recycle_64", "batch1"), ("qwen2", "recycle_4", "ragged4"),
         ("mistral", "mc_sim_7b_8", "ragged4")]


@pytest.mark.parametrize("kind, tree_name, case", CASES)
def test_greedy_recycling_equals_plain_greedy_fresh_and_warm(tiny, kind, tree_name, case):
    base, refs = tiny(kind)
    eos_ids, want = refs[case]
    drafter = drafter_for(base)
    tree = template_tree(tree_name) if tree_name in TEMPLATES else load_tree(tree_name, num_heads=8, max_top_k=8)
    fresh = generate_medusa(base, drafter, PROMPTS[case], tree=tree, max_new_tokens=N, eos_ids=eos_ids)
    after_first = drafter.table
    assert (after_first != empty_table(base.config.vocab_size)).any(axis=1).sum() > 20  # the loop filled rows
    warm = generate_medusa(base, drafter, PROMPTS[case], tree=tree, max_new_tokens=N, eos_ids=eos_ids)
    assert [r.token_ids for r in fresh] == want and [r.token_ids for r in warm] == want
    # the second call started from the table the first one ended with (a drafter made from that table drafts
    # the same), and that table drafts differently from the empty one
    replay = generate_medusa(base, drafter_for(base, after_first), PROMPTS[case], tree=tree, max_new_tokens=N,
                             eos_ids=eos_ids)
    accepts = lambda results: [r.accept_lengths for r in results]  # noqa: E731
    assert accepts(replay) == accepts(warm) != accepts(fresh)
    assert max(max(r.accept_lengths) for r in fresh + warm) >= 1  # drafts were accepted


def test_a_restored_snapshot_decodes_as_the_call_it_was_taken_before(tiny):
    """ShardedModel.draft_snapshot / restore_draft: the table a call starts from, restored after two calls,
    gives the first call's steps again (lossless each time); a model that keeps no state snapshots None."""
    base, refs = tiny("llama")
    eos_ids, want = refs["ragged4"]
    model = ShardedModel(base, drafter_for(base), MeshConfig())
    settings = BatchSettings(batch_size=4, max_new_tokens=N, eos_ids=eos_ids, tree=template_tree("recycle_16"))
    decode = lambda: generate_batch(model, PROMPTS["ragged4"], settings, progress=False).results  # noqa: E731
    snapshot = model.draft_snapshot()
    first, warm = decode(), decode()
    model.restore_draft(snapshot)
    assert (model.heads.table == empty_table(base.config.vocab_size)).all()  # the heads object follows
    again = decode()
    accepts = lambda results: [r.accept_lengths for r in results]  # noqa: E731
    assert accepts(again) == accepts(first) != accepts(warm)
    assert [r.token_ids for r in first + warm + again] == want * 3
    medusa = init_heads(HeadsConfig(base.config.hidden_size, base.config.vocab_size, num_heads=2), base)
    for keeps_none in (ShardedModel(base, None, MeshConfig()), ShardedModel(base, medusa, MeshConfig())):
        assert keeps_none.draft_snapshot() is None
        keeps_none.restore_draft(None)  # changes nothing


def test_table_files_round_trip_and_bad_files_are_refused(tmp_path):
    table = np.random.default_rng(2).integers(0, 300, (300, 8)).astype(np.int32)
    path = recycle_file.save_table(tmp_path / "t.npz", table, model="m", note="n")
    loaded, meta = recycle_file.load_table(path, 300)
    assert (loaded == table).all() and loaded.dtype == np.int32 and meta["model"] == "m"
    with np.load(path) as archive:
        assert archive["table"].dtype == np.uint16
    with pytest.raises(recycle_file.RecycleFileError, match="vocabulary of 300 tokens; the model has 301"):
        recycle_file.load_table(path, 301)
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(recycle_file.RecycleFileError, match="not a recycling table"):
        recycle_file.load_table(tmp_path / "junk.npz")
    np.savez(tmp_path / "other.npz", weights=np.zeros(3))
    with pytest.raises(recycle_file.RecycleFileError, match="entries"):
        recycle_file.load_table(tmp_path / "other.npz")
    bad = recycle_file.save_table(tmp_path / "bad.npz", np.full((4, 2), 4), model="m")
    with pytest.raises(recycle_file.RecycleFileError, match="token id 4 >= its vocab_size 4"):
        recycle_file.load_table(bad)


def test_shipped_table_fits_smollm2_and_its_size():
    path = recycle_file.shipped_table_path()
    assert path.is_file() and path.stat().st_size <= 2 * 1024 * 1024
    table, meta = recycle_file.load_table(path, 49152)
    assert table.shape == (49152, 8) and meta["model"].startswith("llama-v49152-d576-")
    assert (table != empty_table(49152)).any(axis=1).sum() > 3000  # rows filled from the base's logits


def test_a_model_of_another_fingerprint_starts_empty(tiny):
    base, _ = tiny("llama")
    drafter = recycle.recycle_drafter(base)
    assert "empty" in drafter.origin and (drafter.table == empty_table(base.config.vocab_size)).all()


@pytest.fixture(scope="module")
def script_and_model(tiny_model_dir, tmp_path_factory):
    import transformers  # lazy: only the command-line tests build a tokenizer
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = tmp_path_factory.mktemp("recycle-cli") / "model"
    shutil.copytree(tiny_model_dir("llama", initializer_range=0.3), folder)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(100)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", eos_token="</s>",
                                         pad_token="<unk>").save_pretrained(folder)
    spec = importlib.util.spec_from_file_location("generate", Path(__file__).parents[1] / "scripts/generate.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script, folder


def test_generate_script_heads_recycle(script_and_model, tmp_path, capsys):
    """--heads recycle: plain greedy's tokens; --save-recycle-table then --recycle-table starts warm."""
    script, folder = script_and_model
    common = ["--model", str(folder), "--prompt", "w1 w2 w3 w4 w1 w2", "--max-new-tokens", "24", "--json"]
    assert script.main(common) == 0
    plain = json.loads(capsys.readouterr().out)
    saved = tmp_path / "table.npz"
    assert script.main(common + ["--heads", "recycle", "--save-recycle-table", str(saved)]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["token_ids"] == plain["token_ids"] and "recycle_4" in row["tree"]  # the default template
    assert script.main(common + ["--heads", "recycle", "--recycle-table", str(saved), "--tree", "recycle_16"]) == 0
    warm = json.loads(capsys.readouterr().out)
    assert warm["token_ids"] == plain["token_ids"] and warm["steps"] < row["steps"]


@pytest.mark.parametrize("extra, message", [
    (["--heads", "recycle", "--tree", "dynamic:10"], "static template, not a dynamic tree"),
    (["--heads", "recycle", "--tree", "mc_sim_7b_63"], "but top-k is at most 8 (Token Recycling"),
    (["--heads", "recycle", "--calibration", "auto"], "drop --calibration"),
    (["--recycle-table", "t.npz"], "need --heads recycle"),
    (["--heads", "recycle", "--recycle-table", "BAD"], "not a recycling table file"),
])
def test_bad_recycling_flags_are_one_error_line(script_and_model, tmp_path, capsys, extra, message):
    script, folder = script_and_model
    (tmp_path / "BAD").write_text("nonsense")
    extra = [str(tmp_path / "BAD") if x == "BAD" else x for x in extra]
    with pytest.raises(SystemExit) as refused:
        script.main(["--model", str(folder), "--prompt", "w1", "--max-new-tokens", "4"] + extra)
    err = capsys.readouterr().err.strip()
    assert refused.value.code == 2 and message in err and len(err.splitlines()) == 1, err


def test_a_table_of_another_vocabulary_is_one_error_line(script_and_model, tmp_path, capsys):
    script, folder = script_and_model
    path = recycle_file.save_table(tmp_path / "big.npz", empty_table(500), model="other")
    assert script.main(["--model", str(folder), "--prompt", "w1", "--max-new-tokens", "4", "--heads", "recycle",
                        "--recycle-table", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --recycle-table") and "vocabulary of 500 tokens; the model has" in err and len(err.splitlines()) == 1, err


@pytest.mark.slow
def test_teacher_forced_table_holds_each_tokens_last_top_k_and_counts_ranks(tiny):
    from medusa_jax.training.recycle_table import TableBuildConfig, table_from_sequences

    base, _ = tiny("llama")
    sequences = [([5, 9, 2, 9, 33, 4, 9], [0, 0, 1, 1, 1, 1, 1]), ([9, 7, 5], [1, 1, 1])]
    built = table_from_sequences(base, sequences, TableBuildConfig(batch_size=2, seq_len=8, warmup=0))
    logits_tv = {}  # the last position of each token, in text order: its logits' top-8 is the token's row
    for ids, _ in sequences:
        for p, token in enumerate(ids):
            logits_tv[token] = np.asarray(base.logits(plain_hidden(base, ids[: p + 1])))
    for token, logits_v in logits_tv.items():
        assert (built.table_vr[token] == np.argsort(-logits_v, kind="stable")[:8]).all()
    untouched = sorted(set(range(base.config.vocab_size)) - set(logits_tv))
    assert (built.table_vr[untouched] == empty_table(base.config.vocab_size)[untouched]).all()
    assert built.counted == 8 and built.tokens == 10 and built.rank_hits_r.sum() <= built.counted


def test_prompt_update_writes_each_prompt_positions_top_k_later_positions_winning(tiny):
    from medusa_jax.model.kv_cache import KVCache
    from medusa_jax.inference.autoregressive import prefill_states

    base, _ = tiny("llama")
    width = recycle.PROMPT_CHUNK + 6  # two chunks: the second one's writes win over the first's
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, 30, (1, width)).astype(np.int32)  # token ids repeat within and across chunks
    lens = np.asarray([width - 2], np.int32)  # the last two positions are padding: no writes
    _, _, hidden_btd = prefill_states(base, jnp.asarray(prompt), jnp.asarray(lens),
                                      KVCache.zeros(base.config, 1, width))
    table = empty_table(base.config.vocab_size)
    got = np.asarray(recycle.prompt_update(jnp.asarray(table), base, jnp.asarray(prompt), jnp.asarray(lens),
                                           hidden_btd))
    logits_btv = np.asarray(base.logits(hidden_btd))
    want = reference_update(table, prompt[:, : lens[0]], logits_btv[:, : lens[0]], [True])
    np.testing.assert_array_equal(got, want)
    assert (got != table).any(axis=1).sum() == len(set(prompt[0, : lens[0]].tolist()))


def test_prompt_update_of_short_prompts_padded_wide_reads_only_their_chunks(tiny):
    """Two prompts (70 and 9 tokens) padded to 4 chunks: the loop stops after the longest prompt's 2 chunks,
    and the table is the one written from the prompt positions alone."""
    from medusa_jax.model.kv_cache import KVCache
    from medusa_jax.inference.autoregressive import prefill_states

    base, _ = tiny("llama")
    width = 4 * recycle.PROMPT_CHUNK
    rng = np.random.default_rng(4)
    prompt = rng.integers(0, 30, (2, width)).astype(np.int32)
    lens = np.asarray([70, 9], np.int32)
    _, _, hidden_btd = prefill_states(base, jnp.asarray(prompt), jnp.asarray(lens),
                                      KVCache.zeros(base.config, 2, width))
    table = empty_table(base.config.vocab_size)
    got = np.asarray(jax.jit(lambda t, p, n, h: recycle.prompt_update(t, base, p, n, h))(
        jnp.asarray(table), jnp.asarray(prompt), jnp.asarray(lens), hidden_btd))
    logits_btv = np.asarray(base.logits(hidden_btd))
    want = table
    for i in range(0, 2 * recycle.PROMPT_CHUNK, recycle.PROMPT_CHUNK):  # chunk by chunk: row 0's writes, then row 1's
        for b, n in enumerate(lens):
            last = min(n, i + recycle.PROMPT_CHUNK)
            if last > i:
                want = reference_update(want, prompt[b: b + 1, i: last], logits_btv[b: b + 1, i: last], [True])
    np.testing.assert_array_equal(got, want)
    assert (got != table).any()


def plain_hidden(base, ids):
    from medusa_jax.model.kv_cache import KVCache
    from medusa_jax.inference.autoregressive import prefill

    last_bd, _ = prefill(base, jnp.asarray([ids], jnp.int32), jnp.asarray([len(ids)], jnp.int32),
                         KVCache.zeros(base.config, 1, 8))
    return last_bd[0]


@pytest.mark.parametrize("lens", [[40, 9], [0, 0]])
def test_prompt_update_of_one_chunk_runs_no_loop_and_writes_its_positions(tiny, lens):
    """A prompt width of one chunk (most chat prompts) is one update, no loop: in a loop XLA:CPU hoisted the
    one-chunk body and its top_k became a full sort of every position's logits (20x the time on SmolLM2); empty
    prompts write nothing, as the loop's zero trips did."""
    from medusa_jax.model.kv_cache import KVCache
    from medusa_jax.inference.autoregressive import prefill_states

    base, _ = tiny("llama")
    width = recycle.PROMPT_CHUNK
    prompt = np.random.default_rng(5).integers(0, 30, (2, width)).astype(np.int32)
    lens = np.asarray(lens, np.int32)
    _, _, hidden_btd = prefill_states(base, jnp.asarray(prompt), jnp.asarray(lens),
                                      KVCache.zeros(base.config, 2, width))
    table = empty_table(base.config.vocab_size)
    update = jax.jit(lambda t, p, n, h: recycle.prompt_update(t, base, p, n, h))
    args = (jnp.asarray(table), jnp.asarray(prompt), jnp.asarray(lens), hidden_btd)
    assert "stablehlo.while" not in update.lower(*args).as_text()
    got = np.asarray(update(*args))
    logits_btv = np.asarray(base.logits(hidden_btd))
    want = table
    for b, n in enumerate(lens):
        if n:
            want = reference_update(want, prompt[b: b + 1, :n], logits_btv[b: b + 1, :n], [True])
    np.testing.assert_array_equal(got, want)
    assert (got != table).any() == bool(lens.any())


def test_prompt_update_computes_logits_only_at_each_tokens_winning_position(tiny):
    """A 200-token prompt of 10 distinct ids (4 chunks wide): one chunk of logits, those of each id's winning
    position, not one per 64 prompt positions; the table is still the chunk-by-chunk one."""
    from medusa_jax.model.kv_cache import KVCache
    from medusa_jax.inference.autoregressive import prefill_states

    base, _ = tiny("llama")
    width = 200
    prompt = np.random.default_rng(6).integers(0, 10, (1, width)).astype(np.int32)
    lens = np.asarray([width], np.int32)
    _, _, hidden_btd = prefill_states(base, jnp.asarray(prompt), jnp.asarray(lens),
                                      KVCache.zeros(base.config, 1, width))
    projections = []

    class CountingBase:  # the base's vocabulary projection, counted as the jitted update runs it
        def logits(self, hidden_xd):
            jax.debug.callback(lambda: projections.append(1))
            return base.logits(hidden_xd)

    table = empty_table(base.config.vocab_size)
    got = np.asarray(jax.jit(lambda t, p, n, h: recycle.prompt_update(t, CountingBase(), p, n, h))(
        jnp.asarray(table), jnp.asarray(prompt), jnp.asarray(lens), hidden_btd))
    assert len(projections) == 1
    logits_btv = np.asarray(base.logits(hidden_btd))
    np.testing.assert_array_equal(got, reference_update(table, prompt, logits_btv, [True]))
