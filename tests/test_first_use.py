"""First use and reliability of the decoding CLI: prompts past max_position_embeddings, generate.py's output
file rules, a tensor=3 mesh with heads that do not divide by 3, bucketed shapes and the persistent compile cache."""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from medusa_jax.mtbench import load_mtbench_questions
from medusa_jax.compile_cache import CompileCounter
from medusa_jax.inference.api import BatchSettings, plan_batches
from medusa_jax.inference.autoregressive import prefill_widths
from medusa_jax.inference.engine import bucket_length, cache_size_for, pad_prompts, width_ladder
from medusa_jax.text import encode_prompt, load_tokenizer

from training_helpers import build_tiny_chat_model

ROOT = Path(__file__).parents[1]


def test_tensor3_mesh_suits_the_heads(tiny_model_dir, tmp_path):
    folder = tiny_model_dir("llama", num_attention_heads=6, num_key_value_heads=3, hidden_size=96,
                               intermediate_size=192, vocab_size=129)
    out = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "mesh3_worker.py"), str(folder), str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["mesh"] == report["reference"] and all(len(t) == 12 for t in report["mesh"])
    assert report["one"] == report["reference"][:1]  # one prompt on data=2 x tensor=3 equals one device
    assert report["one_plain"] == report["reference_plain"]
    # the 64-token truncated lm_head is replicated over tensor; the 96-wide ResBlock stays split over it
    assert report["specs"]["lm_head"][1] is None and report["specs"]["block"][1] == "tensor"


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return build_tiny_chat_model(tmp_path_factory.mktemp("first-use") / "model")


def run_generate(capsys, *args: str) -> tuple[int, str, str]:
    spec = importlib.util.spec_from_file_location("generate_script", ROOT / "scripts" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    try:
        code = module.main(list(args))
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_prompt_past_max_position_embeddings_is_refused(chat_model, tmp_path, capsys):
    long_prompt = " ".join(["the cat sat on a mat"] * 100)  # 600 words; the model has 512 positions
    code, out, err = run_generate(capsys, "--model", str(chat_model), "--prompt", long_prompt, "--max-new-tokens", "4")
    assert code == 2 and "max_position_embeddings=512" in err and not out
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps("the cat") + "\n" + json.dumps(long_prompt) + "\n")
    code, _, err = run_generate(capsys, "--model", str(chat_model), "--input", str(src), "--output",
                                str(tmp_path / "o.jsonl"), "--max-new-tokens", "4")
    assert code == 2 and "max_position_embeddings=512" in err and not (tmp_path / "o.jsonl").exists()
    # a prompt that fits with its budget still runs
    code, _, _ = run_generate(capsys, "--model", str(chat_model), "--prompt", "the cat", "--max-new-tokens", "4")
    assert code == 0


def test_generate_output_rules(chat_model, tmp_path, capsys):
    out = tmp_path / "answer.jsonl"
    code, printed, _ = run_generate(capsys, "--model", str(chat_model), "--prompt", "the cat", "--output", str(out),
                                    "--max-new-tokens", "4")
    assert code == 0 and out.exists()
    row = json.loads(out.read_text())
    assert row["prompt"] == "the cat" and row["text"] in printed and len(row["token_ids"]) == row["new_tokens"]
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps("the cat") + "\n")
    code, _, err = run_generate(capsys, "--model", str(chat_model), "--input", str(src), "--output", str(src))
    assert code == 2 and "is the --input file" in err and err.count("error: ") == 1
    assert src.read_text() == json.dumps("the cat") + "\n"
    code, _, err = run_generate(capsys, "--model", str(chat_model / "config.json"), "--prompt", "the cat")
    assert code == 2 and "is a file, not a model folder" in err


def test_prompt_widths_and_caches_come_from_a_short_ladder():
    """smallest * 2**k and 1.5 times each: a prompt pads by less than half its width; the widths a decode call's
    prefill may run at (prefill_widths) and the engine's admission widths (bucket_length, capped at the
    context: what `GenerationEngine.warm_up` compiles) are the same ladder."""
    assert list(itertools.islice(width_ladder(), 9)) == [64, 96, 128, 192, 256, 384, 512, 768, 1024]
    assert list(itertools.islice(width_ladder(1), 6)) == [1, 2, 3, 4, 6, 8]  # no repeated width
    assert [bucket_length(n) for n in (1, 64, 65, 97, 129, 300, 385, 600, 700)] == [64, 64, 96, 128, 192, 384, 512,
                                                                                     768, 768]
    assert bucket_length(17, 16) == 24 and bucket_length(25, 16) == 32
    assert prefill_widths(512) == (64, 96, 128, 192, 256, 384, 512) and prefill_widths(300, 128) == (128, 192, 256, 300)
    assert prefill_widths(64) == (64,) and prefill_widths(40) == (40,)
    for context in (64, 100, 384, 1000):
        assert {min(bucket_length(n), context) for n in range(1, context + 1)} == set(prefill_widths(context))
    assert pad_prompts([[1] * 130, [2] * 3], pad_id=0).tokens_bt.shape == (2, 192)
    assert cache_size_for(256, 100, 16) == 256 + 128  # the prompt width + budget and tree block, rounded


@pytest.mark.slow
def test_mtbench_at_batch_8_needs_three_shapes(smollm2_dir):
    tok = load_tokenizer(smollm2_dir)
    prompts = [encode_prompt(tok, q.first_turn, chat=True) for q in load_mtbench_questions(limit=64)]
    shapes = set()
    for indices in plan_batches([len(p) for p in prompts], 8):
        bucket = BatchSettings().bucket
        width = pad_prompts([prompts[i] for i in indices], 0, 8, bucket).tokens_bt.shape[1]
        shapes.add((width, cache_size_for(width, 128, 64, bucket)))
    assert len(shapes) <= 3, shapes


def test_second_process_hits_the_persistent_compile_cache(chat_model, tmp_path):
    env = {**os.environ, "MEDUSA_JAX_COMPILE_CACHE": str(tmp_path / "jax_cache"), "JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, str(ROOT / "scripts" / "generate.py"), "--model", str(chat_model), "--prompt", "the cat",
           "--max-new-tokens", "4", "--json"]
    rows = []
    for _ in range(2):
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert rows[0]["compiles"] > 0 and rows[0]["compile_cache_hits"] == 0
    assert rows[1]["compiles"] == 0 and rows[1]["compile_cache_hits"] == rows[0]["compiles"]
    assert any((tmp_path / "jax_cache").iterdir())


def test_nested_compile_counters_each_count_their_own_block():
    with CompileCounter() as outer:
        with CompileCounter() as inner:  # equal fields on entry: must still leave as two distinct counters
            pass
        jax.jit(lambda x: x * 3 + 1)(jnp.arange(5.0))
    assert inner.requests == 0 and outer.requests >= 1
