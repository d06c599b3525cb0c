"""Benchmark plumbing (scripts/benchmark.py and its quick mode), tree construction (medusa_jax.trees.policy.tree_choice,
scripts/build_tree.py) and the GPU step-cost mode's CPU smoke test (scripts/benchmark_batch.py gpu --tiny), on
tiny models."""

from __future__ import annotations

import importlib.util
import itertools
import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

from medusa_jax.heads.config import HeadsConfig
from medusa_jax.heads.folder import save_heads
from medusa_jax.heads.init import init_heads
from medusa_jax.trees.tree import DynamicTree, build_tree, load_tree
from medusa_jax.trees.trees_file import read_trees, read_trees_file, trees_document
from medusa_jax.hf.load import load_pretrained
from medusa_jax.trees.policy import tree_choice
from medusa_jax.bench import heads_comparison
from medusa_jax.paths import command_line
from medusa_jax.bench.benchmark import greedy_order_of
from medusa_jax.trees.search.head_accuracy import count_hits, count_hits_by_sequence

ROOT = Path(__file__).resolve().parent.parent
WORDS = ["the", "a", "cat", "dog", "sat", "on", "mat", "write", "poem", "about", "why", "is", "sky", "blue",
         "explain", "math", "two", "plus", "three", "code", "python", "list", "sort", "story", "short", "tell"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|> {% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}")


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"script_{name}", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- tree construction -------------------------------------------------------------------------------

def prefix_closed_subsets(nodes, size):
    for subset in itertools.combinations(nodes, size):
        chosen = set(subset)
        if all(len(p) == 1 or p[:-1] in chosen for p in subset):
            yield subset


def test_expected_tokens_and_greedy_order_on_a_toy_table():
    acc = [[0.5, 0.2], [0.4, 0.1]]
    # 1 (bonus) + P([0]) + P([1]) + P([0,0]) = 1 + 0.5 + 0.2 + 0.5 * 0.4
    assert tree_choice.expected_tokens_per_step([[0], [1], [0, 0]], acc) == pytest.approx(1.9)
    order = tree_choice.greedy_tree(acc, 6)
    # [1] and [0, 0] tie at 0.2: the shorter path goes first
    assert [p for p, _ in order] == [(0,), (1,), (0, 0), (1, 0), (0, 1), (1, 1)]
    assert [v for _, v in order] == pytest.approx([0.5, 0.2, 0.2, 0.08, 0.05, 0.02])


def test_greedy_tree_values_never_increase_prefixes_are_valid_and_optimal():
    rng = np.random.RandomState(3)
    acc = np.sort(rng.uniform(0, 0.6, (3, 3)), axis=1)[:, ::-1]
    order = tree_choice.greedy_tree(acc, 39)  # every node of 3 heads x top-3: 3 + 9 + 27
    values = [v for _, v in order]
    assert len(order) == 39 and all(a >= b for a, b in zip(values, values[1:]))
    all_nodes = [p for p, _ in order]
    for n in range(1, 40):
        buffers = build_tree(all_nodes[:n], num_heads=3, max_top_k=3)  # a valid tree that the decoder accepts
        assert buffers.num_tokens == n + 1
    for n in (1, 2, 3, 4):  # brute force over every valid tree of n nodes
        greedy = tree_choice.expected_tokens_per_step(all_nodes[:n], acc)
        best = max(tree_choice.expected_tokens_per_step(s, acc) for s in prefix_closed_subsets(all_nodes, n))
        assert greedy == pytest.approx(best)


def test_choose_tree_maximises_tokens_per_second_and_gives_a_loadable_tree(tmp_path):
    acc = np.array([[0.6, 0.1, 0.05], [0.4, 0.08, 0.04], [0.3, 0.06, 0.03]])
    cost = tree_choice.StepCost((2, 4, 8, 16, 32), (1.0, 1.02, 1.1, 1.4, 2.4))
    choice = tree_choice.fastest_greedy_tree(acc, cost, 31)
    order = tree_choice.greedy_tree(acc, 31)
    by_hand = [tree_choice.expected_tokens_per_step([p for p, _ in order[:n]], acc) / cost(n + 1)
               for n in range(1, 32)]
    assert choice.best_num_nodes == int(np.argmax(by_hand)) + 1
    assert choice.predicted_tokens_per_step == pytest.approx(
        tree_choice.expected_tokens_per_step(choice.paths, acc))
    path = tmp_path / "tree.json"
    path.write_text(json.dumps({"medusa_choices": [list(p) for p in choice.paths],
                                "greedy_order": [list(p) for p in choice.order]}))
    loaded = load_tree(path, num_heads=3, max_top_k=3)
    assert set(loaded.paths) == set(choice.paths)
    assert greedy_order_of(json.loads(path.read_text()))[: choice.best_num_nodes] == list(choice.paths)


def test_nondecreasing_fit_pools_noisy_dips():
    assert tree_choice.nondecreasing_fit([1.0, 3.0, 2.0, 4.0]) == pytest.approx([1.0, 2.5, 2.5, 4.0])
    assert tree_choice.nondecreasing_fit([5.0, 1.0, 1.0]) == pytest.approx([7 / 3] * 3)
    assert tree_choice.nondecreasing_fit([1.0, 2.0]) == [1.0, 2.0]


def test_step_cost_and_accuracy_table_reject_bad_input():
    cost = tree_choice.StepCost((2, 8), (1.0, 2.0))
    assert cost(5) == pytest.approx(1.5)
    with pytest.raises(ValueError, match="outside the measured range"):
        cost(9)
    with pytest.raises(ValueError, match="strictly increasing"):
        tree_choice.StepCost((8, 2), (1.0, 2.0))
    with pytest.raises(ValueError, match="probabilities"):
        tree_choice.greedy_tree([[1.5]], 3)
    with pytest.raises(ValueError, match="outside"):
        tree_choice.expected_tokens_per_step([[0, 0, 0]], [[0.5], [0.5]])


def test_count_hits_scores_head_d_against_the_token_at_p_plus_2_plus_d():
    seq = [7, 1, 2, 3, 4, 5, 6]
    start = 1  # the last prompt token: positions 1.. are scored
    top = np.zeros((2, 1, len(seq), 2), np.int64)
    for p in range(len(seq)):
        top[0, 0, p] = [seq[p + 2] if p + 2 < len(seq) else 0, 99]  # head 0 always right at rank 0
        top[1, 0, p] = [99, seq[p + 3] if p + 3 < len(seq) else 0]  # head 1 always right at rank 1
    top[1, 0, 2, 1] = 98  # ... except once
    hits, counted = count_hits(top, [seq], [start])
    assert counted.tolist() == [4, 3]  # head 0: p = 1..4 (target p+2 <= 6); head 1: p = 1..3
    assert hits.tolist() == [[4, 0], [0, 2]]
    # two sequences: per-sequence counts, and their sums are the pooled ones
    top2 = np.concatenate([top, np.full_like(top, 99)], axis=1)  # the second sequence: every guess wrong
    hits_b, counted_b = count_hits_by_sequence(top2, [seq, seq[:5]], [start, start])
    assert counted_b.tolist() == [[4, 3], [2, 1]] and hits_b[1].sum() == 0
    assert hits_b[0].tolist() == [[4, 0], [0, 2]]
    assert [x.tolist() for x in count_hits(top2, [seq, seq[:5]], [start, start])] == [[[4, 0], [0, 2]], [6, 4]]


# ---- tiny model with a tokenizer -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_chat_model(tiny_model_dir, tmp_path_factory):
    """A tiny Llama folder with a word-level tokenizer and chat template, plus random heads."""
    import tokenizers  # lazy, with transformers: seconds to import, and only this fixture builds a tokenizer
    import transformers


    specials = ["<unk>", "<|im_start|>", "<|im_end|>", "user", "assistant", "system"]
    vocab = {w: i for i, w in enumerate(specials + WORDS)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>",
                                                pad_token="<unk>", additional_special_tokens=specials[1:3])
    fast.chat_template = CHAT_TEMPLATE
    src = tiny_model_dir("llama", seed=1, eos_token_id=2)
    folder = tmp_path_factory.mktemp("tiny-chat")
    for f in src.iterdir():
        shutil.copy(f, folder / f.name)
    fast.save_pretrained(folder)
    heads_dir = folder.parent / (folder.name + "-heads")
    save_heads(init_heads(HeadsConfig(64, 128, num_heads=3, lm_head="own"), load_pretrained(folder), seed=2),
               heads_dir)
    return folder, heads_dir


def write_questions(path: Path):
    rows = [(1, "writing", "write a short poem about the cat"), (2, "math", "explain two plus three"),
            (3, "coding", "sort a list in python")]
    path.write_text("".join(json.dumps({"question_id": i, "category": c, "turns": [t, "tell why"]}) + "\n"
                            for i, c, t in rows))
    return path


def test_benchmark_cli_writes_results_markdown_and_plots(tiny_chat_model, tmp_path):
    folder, heads_dir = tiny_chat_model
    out = tmp_path / "bench"
    rc = load_script("benchmark").main([
        "--model", str(folder), "--heads", str(heads_dir), "--tree", "mc_sim_7b_8",
        "--question-file", str(write_questions(tmp_path / "q.jsonl")), "--questions", "3",
        "--max-new-tokens", "6", "--batched-sizes", "2", "--sweep-sizes", "2", "--sweep-questions", "1",
        "--hf", "--out", str(out)])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    for key in ("speedup", "acceleration_rate", "step_overhead", "mismatches", "tokens_per_s"):
        assert key in res
    assert set(res["tokens_per_s"]) == {"plain", "medusa", "hf"} and all(v > 0 for v in res["tokens_per_s"].values())
    assert res["mismatches"] == 0  # Medusa greedy reproduces plain greedy
    rows = res["per_question"]
    assert len(rows) == 3 and {r["category"] for r in rows} == {"writing", "math", "coding"}
    tokens, steps = sum(r["medusa"]["tokens"] for r in rows), sum(r["medusa"]["steps"] for r in rows)
    assert res["acceleration_rate"] == pytest.approx(tokens / steps)
    plain_tps = sum(r["plain"]["tokens"] for r in rows) / sum(r["plain"]["seconds"] for r in rows)
    assert res["speedup"] == pytest.approx(res["tokens_per_s"]["medusa"] / plain_tps)
    assert sum(res["accept_length_histogram"]) == sum(len(r["medusa"]["accept_lengths"]) for r in rows)
    assert [b["batch_size"] for b in res["batched"]] == [1, 2]
    assert {s["num_nodes"] for s in res["tree_sweep"]} == {2, 8}
    assert set(res["targets"]) == {"acceleration_rate", "speedup_batch1", "speedup_batch8"}
    prof = res["step_profile"]
    assert set(prof["pieces_ms"]) == {"verify_forward", "base_logits", "acceptance", "heads_top_k",
                                      "cache_compaction"}
    assert prof["medusa_step_ms"] > 0 and prof["plain_step_ms"] > 0
    md = (out / "results.md").read_text()
    assert "| Medusa (ours) |" in md and "| writing |" in md and "Command: `python scripts/benchmark.py" in md
    for name in ("speedup_by_category", "accept_lengths", "speedup_vs_tree_size", "batched_throughput"):
        assert (out / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_benchmark_sampling_mode_writes_exact_typical_and_plain(tiny_chat_model, tmp_path):
    folder, heads_dir = tiny_chat_model
    out = tmp_path / "sampling"
    args = ["--model", str(folder), "--heads", str(heads_dir), "--tree", "mc_sim_7b_8", "--question-file",
            str(write_questions(tmp_path / "q.jsonl")), "--questions", "2", "--max-new-tokens", "6",
            "--temperatures", "0.7", "--out", str(out)]
    assert load_script("benchmark").main(args) == 0
    res = json.loads((out / "sampling.json").read_text())
    row = res["by_temperature"]["0.7"]
    assert set(row) == {"plain", "exact", "typical", "exact_over_greedy_tokens_per_step"}
    assert row["plain"]["tokens_per_step"] == pytest.approx(1.0)  # one token per plain step, prefill included
    for m in ("plain", "exact", "typical"):
        assert 0 < row[m]["tokens"] <= 2 * 6 and row[m]["tokens_per_s"] > 0
        assert row[m]["tokens_per_step"] == pytest.approx(row[m]["tokens"] / row[m]["steps"])
    assert row["exact_over_greedy_tokens_per_step"] == pytest.approx(
        row["exact"]["tokens_per_step"] / res["greedy_medusa"]["tokens_per_step"])
    md = (out / "sampling.md").read_text()
    assert "| Medusa, exact acceptance |" in md and "Command: `python scripts/benchmark.py" in md
    with pytest.raises(SystemExit):
        load_script("benchmark").main(args[:-4] + ["--temperatures", "0,1"])


def test_build_tree_cli_writes_the_heads_trees_per_batch_size(tiny_chat_model, tmp_path, capsys):
    folder, heads_dir = tiny_chat_model
    heads = tmp_path / "heads"
    shutil.copytree(heads_dir, heads)
    data = tmp_path / "conv.jsonl"
    data.write_text("".join(json.dumps({"id": str(i), "conversations": [
        {"from": "human", "value": f"tell a short story about the {w}"}, {"from": "gpt", "value": "the cat sat"}]})
        + "\n" for i, w in enumerate(["cat", "dog", "mat"])))
    common = ["--model", str(folder), "--heads", str(heads), "--data", str(data), "--heldout", "2",
              "--continuation-tokens", "12", "--top-k", "3", "--max-nodes", "7", "--tree-tokens", "2,4,8",
              "--repeats", "1", "--context", "16", "--batch-sizes", "1,2"]
    assert load_script("build_tree").main(common + ["--min-speedup", "0.01"]) == 0  # any tree "pays"
    doc = json.loads((heads / "trees.json").read_text())
    trees = read_trees(heads)  # valid, and every tree fits the heads (3 heads over the 128-token vocabulary)
    trees.check_heads(3, 128)
    assert trees.backends() == ["cpu"] and set(trees.batches("cpu")) == {1, 2}
    built = doc["built"]["cpu"]
    acc = np.asarray(built["head_accuracy"])
    assert acc.shape == (3, 3) and np.all((acc >= 0) & (acc <= 1))
    # the dynamic tree of 4 nodes (7 nodes at most here, so not 16): decoded on the held-out prompts beside the
    # static tree of 4 nodes, timed at each batch size, and weighed against the static trees
    [gain] = built["dynamic"]
    dynamic = DynamicTree.from_json({"dynamic": gain["dynamic"]})
    assert dynamic.nodes == 4 and gain["heldout_tokens_per_step"] >= 1 and gain["static_heldout_tokens_per_step"] >= 1
    for batch, paths in trees.batches("cpu").items():
        record = built["batches"][str(batch)]
        [dyn] = record["dynamic"]
        assert dyn["tree"] == dynamic.name and dyn["step_seconds"] > 0
        if isinstance(paths, DynamicTree):  # the dynamic tree predicted the most tokens/s
            assert paths == dynamic and record["tree"] == dynamic.name and record["num_nodes"] == 4
            assert record["predicted_speedup_vs_plain"] == dyn["predicted_speedup_vs_plain"]
            assert dyn["predicted_speedup_vs_plain"] >= max(x for x in record["predicted_speedup_by_size"] if x)
            continue
        assert record["predicted_speedup_vs_plain"] >= dyn["predicted_speedup_vs_plain"]
        assert 1 <= len(paths) == record["num_nodes"] <= 7  # min_speedup 0.01: a tree every time
        assert max(rank for path in paths for rank in path) < 3  # the --top-k 3 ranks measured per head
        # each sequence's own accuracy, discounted per drafted token, a batch waiting for its slowest row
        per_sequence = np.asarray(built["head_accuracy_per_sequence"]) * built["accuracy_scale"]
        assert per_sequence.shape == (2, 3, 3) and built["accuracy_scale"] == 0.72
        predicted = tree_choice.batch_tokens_per_step(paths, per_sequence, batch)[-1]
        assert record["predicted_tokens_per_step"] == pytest.approx(predicted)
        assert predicted <= tree_choice.expected_tokens_per_step(paths, acc) + 1e-9
        fitted = record["step_seconds"]["fitted"]
        assert record["step_seconds"]["tree_tokens"] == [2, 4, 8] and fitted == sorted(fitted) and min(fitted) > 0
        assert record["plain_step_seconds"] > 0
    assert built["model"] == folder.name and str(tmp_path) not in json.dumps({k: v for k, v in built.items()
                                                                               if k != "command"})

    # where no tree pays (build_tree's pick_for_batch, tested in test_calibration), the record holds no paths: every
    # batch size decodes plainly, exactly like plain greedy (written as build_tree writes it, without a second run)
    plain_doc = trees_document(read_trees_file(heads / "trees.json"), "cpu", {1: (), 2: ()}, built)
    (heads / "trees.json").write_text(json.dumps(plain_doc))
    assert all(p == () for p in read_trees(heads).batches("cpu").values())
    capsys.readouterr()
    prompt = ["--model", str(folder), "--prompt", "tell a story", "--chat", "--max-new-tokens", "8", "--json"]
    assert load_script("generate").main(prompt) == 0
    plain = json.loads(capsys.readouterr().out)
    assert load_script("generate").main(prompt + ["--heads", str(heads)]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["decoder"] == "plain" and "no tree pays" in row["tree"] and row["token_ids"] == plain["token_ids"]

    (heads / "trees.json").write_text('{"format": "medusa-jax-trees", "version": 1, "trees": {"cpu": {"1": [[0, 1]]}}}')
    assert load_script("generate").main(prompt + ["--heads", str(heads)]) == 2
    assert "trees.json" in capsys.readouterr().err  # a clear error, before any decoding
    assert load_script("build_tree").main(common) == 2  # build_tree refuses to overwrite what it cannot read


def test_benchmark_uses_the_heads_trees_per_batch_size(tiny_chat_model, tmp_path):
    folder, heads_dir = tiny_chat_model
    heads = tmp_path / "heads"
    shutil.copytree(heads_dir, heads)
    (heads / "trees.json").write_text(json.dumps({"format": "medusa-jax-trees", "version": 1, "trees": {
        "cpu": {"1": [[0], [1], [0, 0]], "2": []}}, "built": {"cpu": {"greedy_order": [[0], [1], [0, 0], [2]]}}}))
    out = tmp_path / "bench"
    rc = load_script("benchmark").main([
        "--model", str(folder), "--heads", str(heads), "--question-file", str(write_questions(tmp_path / "q.jsonl")),
        "--questions", "2", "--max-new-tokens", "6", "--batched-sizes", "2", "--sweep-sizes", "1,4",
        "--sweep-questions", "1", "--no-profile", "--out", str(out)])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    assert res["tree"]["num_nodes"] == 3 and "3 nodes" in res["tree"]["origin"] and res["mismatches"] == 0
    assert [(b["batch_size"], b["tree_nodes"]) for b in res["batched"]] == [(1, 3), (2, 0)]
    assert res["batched"][1]["acceleration_rate"] == pytest.approx(1.0)  # batch 2: plain decoding
    assert {s["num_nodes"] for s in res["tree_sweep"]} == {1, 3, 4}  # prefixes of the stored greedy order


def test_gpu_bench_tiny_mode_on_cpu(tmp_path):
    rc = load_script("benchmark_batch").main(["gpu", "--tiny", "--out", str(tmp_path)])
    assert rc == 0
    res = json.loads((tmp_path / "gpu_bench.json").read_text())
    (entry,) = res["models"]
    assert set(entry["plain_ms"]) == {"1", "2"}
    assert set(entry["medusa_ms"]) == {"B=1,T=4", "B=1,T=8", "B=2,T=4", "B=2,T=8"}
    for key, ms in entry["medusa_ms"].items():
        batch = key.split(",")[0].split("=")[1]
        assert entry["overhead"][key] == pytest.approx(ms / entry["plain_ms"][batch])
    assert "| batch | plain ms/step |" in (tmp_path / "gpu_bench.md").read_text()
    # a spent budget skips everything and still writes a report
    rc = load_script("benchmark_batch").main(["gpu", "--tiny", "--budget-seconds", "0", "--out",
                                              str(tmp_path / "none")])
    assert rc == 0 and json.loads((tmp_path / "none" / "gpu_bench.json").read_text())["models"] == []


def test_benchmark_quick_mode_reports_plain_heads_and_oracle(tiny_chat_model, capsys):
    folder, heads_dir = tiny_chat_model
    args = ["quick", "--model", str(folder), "--heads", str(heads_dir), "--trees", "mc_sim_7b_8",
            "--batch-sizes", "1,2", "--max-new-tokens", "6", "--repeats", "1", "--json"]
    assert load_script("benchmark").main(args) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["batch"], r["config"]) for r in rows] == [
        (b, c) for b in (1, 2) for c in ("plain", "medusa mc_sim_7b_8 heads", "medusa mc_sim_7b_8 oracle")]
    for r in rows:  # EOS ignored: every row makes exactly --max-new-tokens
        assert r["tokens"] == 6 * r["batch"] and r["tokens_per_s"] > 0
    plain, oracle = rows[0], rows[2]
    assert plain["tokens_per_step"] == pytest.approx(6 / 6)  # the prefill is a step too
    assert oracle["tokens_per_step"] > plain["tokens_per_step"]  # the planted continuation is accepted
    with pytest.raises(SystemExit):  # more rows than the four fixed prompts
        load_script("benchmark").main(args[:7] + ["--batch-sizes", "5"])


@pytest.mark.parametrize("script, mode", [("benchmark", "quick"), ("benchmark", "teacher-mass"),
                                          ("benchmark_batch", "scaling"), ("benchmark_batch", "decode"),
                                          ("benchmark_batch", "gpu")])
def test_every_benchmark_mode_has_its_own_help(script, mode, capsys):
    with pytest.raises(SystemExit) as exit_info:
        load_script(script).main([mode, "--help"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: {script}.py {mode} ")


def test_teacher_mass_refuses_data_that_is_not_a_store(tmp_path, capsys):
    (tmp_path / "data.jsonl").write_text("{}\n")
    with pytest.raises(SystemExit) as exit_info:
        load_script("benchmark").main(["teacher-mass", "--model", "smollm2", "--data", str(tmp_path / "data.jsonl")])
    assert exit_info.value.code == 2 and "is not a self-distilled Arrow store" in capsys.readouterr().err


def test_batch_decode_mode_matches_transformers_and_records_its_command(tiny_chat_model, tmp_path):
    folder, _ = tiny_chat_model
    out = tmp_path / "decode"
    args = ["decode", "--model", str(folder), "--prompts", "2", "--rounds", "1", "--max-new-tokens", "4",
            "--torch-threads", "1", "--bandwidth-mib", "1", "--out", str(out)]
    assert load_script("benchmark_batch").main(args) == 0
    res = json.loads((out / "results.json").read_text())
    assert len(res["records"]) == 2 and all(r["ours_tokens"] == 4 for r in res["records"])
    assert res["same_tokens_prefix_min"] == 4  # greedy float32: transformers makes the same 4 tokens
    assert set(res["tokens_per_s"]) == {"ours", "ours_decode_steps", "transformers", "floor"}
    portable = [folder.name if a == str(folder) else "decode" if a == str(out) else a for a in args[1:]]
    assert res["command"] == "python scripts/benchmark_batch.py decode " + " ".join(portable)  # no local paths
    assert (out / "results.md").read_text()


def test_batch_scaling_mode_times_plain_and_medusa_steps(tiny_chat_model, tmp_path):
    folder, heads_dir = tiny_chat_model
    out = tmp_path / "scaling"
    args = ["scaling", "--model", str(folder), "--heads", str(heads_dir), "--tree", "mc_sim_7b_8",
            "--batch-sizes", "1,2", "--cache-sizes", "32", "--rounds", "1", "--out", str(out)]
    assert load_script("benchmark_batch").main(args) == 0
    res = json.loads((out / "results.json").read_text())
    assert [(r["cache"], r["batch"], r["context"]) for r in res["rows"]] == [(32, 1, 24), (32, 2, 24)]
    for r in res["rows"]:
        assert r["plain_ms"] > 0 and r["medusa_ms"] > 0
        assert r["medusa_overhead"] == pytest.approx(r["medusa_ms"] / r["plain_ms"])
        assert r["floor_kv_ms"] > r["floor_ms"] and r["of_floor_kv"] == pytest.approx(r["floor_kv_ms"] / r["plain_ms"])
    assert res["tree_tokens"] == 9 and res["command"].startswith("python scripts/benchmark_batch.py scaling ")
    assert (out / "scaling.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_benchmark_heads_mode_compares_heads_side_by_side(tiny_chat_model, tmp_path, monkeypatch):
    folder, heads_dir = tiny_chat_model
    other = tmp_path / "other-heads"
    save_heads(init_heads(HeadsConfig(64, 128, num_heads=2, lm_head="truncated", truncated_vocab_size=16),
                          load_pretrained(folder), seed=5), other)
    data = tmp_path / "conv.jsonl"
    data.write_text("".join(json.dumps({"id": str(i), "conversations": [
        {"from": "human", "value": f"tell a short story about the {w}"}, {"from": "gpt", "value": "the cat"}]})
        + "\n" for i, w in enumerate(["cat", "dog", "mat"])))
    out = tmp_path / "cmp"
    argv = ["heads", "--model", str(folder), "--heads", f"a={heads_dir}", "--heads", f"b={other}",
            "--question-file", str(write_questions(tmp_path / "q.jsonl")), "--questions", "3",
            "--max-new-tokens", "10", "--tree-sizes", "1,3", "--batch-sizes", "1", "--heldout", "2",
            "--continuation-tokens", "8", "--chains", "2,3", "--data", str(data), "--out", str(out),
            "--dynamic-nodes", "3,5", "--dynamic-top-k", "1,2"]
    calls, real = [], heads_comparison.generate_batch

    def recording(model, prompts, settings, **kw):
        calls.append(("medusa" if settings.tree is not None else "plain", len(prompts)))
        return real(model, prompts, settings, **kw)

    monkeypatch.setattr(heads_comparison, "generate_batch", recording)
    assert load_script("benchmark").main(argv) == 0
    # per heads: the plain reference (once), the counted trees, then the timed runs interleaved batch by batch
    timed = [c for c in calls if c[1] == 1]
    assert timed == [("plain", 1), ("medusa", 1), ("medusa", 1), ("plain", 1), ("plain", 1), ("medusa", 1)] * 2
    doc = json.loads((out / "heads.json").read_text())
    assert set(doc["heads"]) == {"a", "b"} and doc["questions"] == 3
    for label, num_heads in (("a", 3), ("b", 2)):
        h = doc["heads"][label]
        assert len(h["heldout_top1"]) == num_heads and len(h["heldout_top5"]) == num_heads
        assert all(0 <= t1 <= t5 <= 1 for t1, t5 in zip(h["heldout_top1"], h["heldout_top5"]))
        assert [r["nodes"] for r in h["tree_sizes"]] == [1, 3]
        assert all(r["tokens_per_step"] >= 1 and r["mismatches"] == 0 for r in h["tree_sizes"])  # lossless
        assert [r["batch"] for r in h["timed"]] == [1] and h["timed"][0]["mismatches"] == 0
        # chains as deep as the heads reach: a has 3 heads (chains of 2 and 3), b has 2 (the chain of 2 only)
        assert [r["chain"] for r in h["chains"]] == [2, 3][:num_heads - 1]
        assert all(r["tokens_per_step"] >= 1 and r["mismatches"] == 0 for r in h["chains"])
        # dynamic trees: N = 3 with K = 1 (1 + (D - 1) >= 3 needs D = 3) or 2, N = 5 with K = 2 only
        depth = min(4, num_heads)
        assert [r["tree"] for r in h["dynamic"]] == ([f"dynamic:3,k=1,d={depth}"] if depth >= 3 else []) + [
            f"dynamic:3,k=2,d={depth}", f"dynamic:5,k=2,d={depth}"]
        assert all(r["mismatches"] == 0 and r["static_nodes"] == r["nodes"] for r in h["dynamic"])
        assert all(r["ratio_to_static"] == pytest.approx(r["tokens_per_step"] / r["static_tokens_per_step"])
                   for r in h["dynamic"])
    md = (out / "heads.md").read_text()
    assert "chain of 3" in md and "tokens/step @3" in md and "| a |" in md and "| b |" in md
    assert "dynamic:5,k=2" in md
    assert (out / "heads.png").stat().st_size > 0


def test_benchmark_heads_mode_adds_training_free_drafts_and_mixes_to_the_table(tiny_chat_model, tmp_path, capsys,
                                                                              monkeypatch):
    """`--heads mix=HEADS+recycle+lookup --heads recycle=recycle` beside a heads folder: the same table, their rows
    counted within each node budget and timed against plain, lossless, no held-out accuracy ('-'). The mix's draft
    sizes get given step costs (growing with the size): timing them compiles a step per size of each of its three
    budgets, most of this test's time (test_mixed_drafts tests the timing)."""
    folder, heads_dir = tiny_chat_model
    budgets, build_mix = [], heads_comparison.build_mix

    def given_costs(base, untrained, trained, budget, **kw):
        budgets.append((untrained, budget, kw["batch"]))
        return build_mix(base, untrained, trained, budget, **kw, costs=lambda sizes: tuple(1.0 + 0.02 * s
                                                                                              for s in sizes))

    monkeypatch.setattr(heads_comparison, "build_mix", given_costs)
    out = tmp_path / "cmp"
    argv = ["heads", "--model", str(folder), "--heads", f"a={heads_dir}", "--heads", f"mix={heads_dir}+recycle+lookup",
            "--heads", "recycle=recycle", "--question-file", str(write_questions(tmp_path / "q.jsonl")),
            "--questions", "3", "--max-new-tokens", "10", "--tree-sizes", "4,8", "--batch-sizes", "1",
            "--heldout", "2", "--continuation-tokens", "8", "--chains", "", "--out", str(out)]
    assert load_script("benchmark").main(argv) == 0
    doc = json.loads((out / "heads.json").read_text())
    assert list(doc["heads"]) == ["mix", "recycle", "a"]
    for label in ("mix", "recycle"):
        h = doc["heads"][label]
        assert h["heldout_top1"] == [] and h["origin"] == {"mix": f"{heads_dir.name}+recycle+lookup"}.get(label, label)
        assert [r["nodes"] for r in h["tree_sizes"]] == [4, 8]
        assert all(r["tokens_per_step"] >= 1 and r["mismatches"] == 0 for r in h["tree_sizes"])  # lossless
        assert [r["batch"] for r in h["timed"]] == [1] and h["timed"][0]["mismatches"] == 0
    assert doc["heads"]["recycle"]["timed"][0]["tree"].startswith("tree recycle_4")  # --heads recycle's default
    assert [r["tree"] for r in doc["heads"]["recycle"]["tree_sizes"]] == ["recycle_4", "recycle_8"]
    assert all(r["tree"].startswith("mixed:0/") for r in doc["heads"]["mix"]["tree_sizes"])
    assert "mixed" in doc["heads"]["mix"]["timed"][0]["tree"]
    # counted at each node budget at the counting batch (3 questions), timed within the default budget at batch 1
    assert budgets == [(("recycle", "lookup"), 4, 3), (("recycle", "lookup"), 8, 3), (("recycle", "lookup"), 16, 1)]
    md = (out / "heads.md").read_text()
    assert "| mix | - | - |" in md and "| recycle | - | - |" in md and "| a |" in md
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        load_script("benchmark").main(["heads", "--model", str(folder), "--heads", "m=lookup+lookup", "--out",
                                       str(tmp_path / "bad")])
    assert e.value.code == 2 and "named twice" in capsys.readouterr().err and not (tmp_path / "bad").exists()


def test_benchmark_heads_mode_rejects_a_heads_flag_without_a_label(capsys):
    with pytest.raises(SystemExit) as e:
        load_script("benchmark").main(["heads", "--heads", "just-a-folder"])
    assert e.value.code == 2 and "LABEL=FOLDER" in capsys.readouterr().err


def test_recorded_commands_name_no_absolute_path_of_this_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("MEDUSA_JAX_CACHE", str(tmp_path))
    line = command_line("scripts/benchmark.py heads", ["--heads", f"kl={tmp_path}/heads/kl", "--out",
                                                      str(ROOT / "bench" / "heads"), "--questions", "16"])
    assert line == "python scripts/benchmark.py heads --heads 'kl=$MEDUSA_JAX_CACHE/heads/kl' --out bench/heads " \
                   "--questions 16"


def test_batch_throughput_mode_compares_refill_with_sorted_batches(tiny_chat_model, tmp_path):
    folder, _ = tiny_chat_model
    out = tmp_path / "refill"
    args = ["--model", str(folder), "--methods", "plain,refill", "--prompts", "5", "--batch-sizes", "2,4",
            "--max-new-tokens", "6", "--chunk-steps", "3", "--no-progress", "--out", str(out)]
    assert load_script("benchmark_batch").main(args) == 0
    res = json.loads((out / "batch.json").read_text())
    assert [(r["batch_size"], r["method"]) for r in res["rows"]] == [(2, "plain"), (2, "refill"), (4, "plain"),
                                                                     (4, "refill")]
    for plain, refill in zip(res["rows"][::2], res["rows"][1::2]):
        assert refill["new_tokens"] == plain["new_tokens"] and refill["rows_differing_from_plain"] == 0
        assert refill["chunks"] >= 2 and 0 < refill["slot_use"] <= 2
    md = (out / "batch.md").read_text()
    assert "Refill / plain tokens/s" in md and "Refill slot-steps that produced a token" in md


def test_benchmark_calibration_mode_sets_predictions_beside_measurements(tiny_chat_model, tmp_path, monkeypatch):
    folder, heads_dir = tiny_chat_model
    heads = tmp_path / "heads"
    shutil.copytree(heads_dir, heads)
    accuracy = np.zeros((3, 4))
    accuracy[:, 0], accuracy[:, 1] = [0.6, 0.5, 0.4], 0.1
    built = {"head_accuracy": accuracy.tolist(), "greedy_order": [[0], [1], [0, 0]], "accuracy_scale": 1.0,
             "min_speedup": 1.0, "timing": {"tree_tokens": [2, 4]},
             "batches": {"1": {"predicted_speedup_vs_plain": 1.3, "predicted_tokens_per_step": 1.6}}}
    (heads / "trees.json").write_text(json.dumps(
        trees_document(None, jax.default_backend(), {1: [[0]], 2: []}, built)))
    monkeypatch.setenv("MEDUSA_JAX_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "cal"
    argv = ["calibration", "--model", str(folder), "--heads", str(heads), "--batch-sizes", "1,2",
            "--question-file", str(write_questions(tmp_path / "q.jsonl")), "--questions", "3",
            "--max-new-tokens", "8", "--out", str(out)]
    assert load_script("benchmark").main(argv) == 0
    doc = json.loads((out / "calibration.json").read_text())
    assert [r["batch"] for r in doc["batches"]] == [1, 2] and doc["questions"] == 3
    first = doc["batches"][0]
    assert first["calibrate_seconds"] > 0  # timed on first use (an empty cache)
    assert "calibrated on this machine" in first["calibrated"]["tree"]
    assert first["shipped"]["nodes"] == 1 and first["shipped"]["predicted_speedup"] == 1.3
    for row in doc["batches"]:
        for name in ("calibrated", "shipped"):
            assert row[name]["mismatches"] == 0 and row[name]["tokens_per_step"] >= 1  # greedy: lossless
    assert doc["batches"][1]["shipped"]["nodes"] == 0  # trees.json says plain at batch 2
    assert len(list((tmp_path / "cache" / "calibration").glob("*.json"))) == 2
    md = (out / "calibration.md").read_text()
    assert "| 1 | calibrated |" in md and "| 2 | shipped |" in md and "predicted speedup" in md
    assert load_script("benchmark").main(argv) == 0  # a second run reads the cache
    assert json.loads((out / "calibration.json").read_text())["batches"][0]["calibrate_seconds"] == 0.0
