"""scripts/train_heads.py on first use: output folders it may write, one run per folder, one-line errors for bad
flags and data, and the memory plan that refuses a run that would not fit (all before any heavy work)."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

from medusa_jax.model.config import ModelConfig
from medusa_jax.training.memory_plan import GIB, MemoryPlanError, check_cache_fits, estimate_run
from medusa_jax.training.output_folder import OutputLock

from training_helpers import build_tiny_chat_model, chat_records, write_json


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("first-train")
    return build_tiny_chat_model(root / "model"), write_json(root / "chat.json", chat_records(40, seed=2))


@pytest.fixture
def train(monkeypatch, tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("train_heads_script", Path(__file__).parents[1] / "scripts" /
                                                  "train_heads.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setenv("MEDUSA_JAX_CACHE", str(tmp_path / "cache"))

    def run(model, data, out, *extra) -> tuple[int, str]:
        capsys.readouterr()
        try:  # flag errors exit from the parser (status 2), the others return 2
            code = module.main(["--model", str(model), "--data", str(data), "--output", str(out), "--batch-size",
                                "2", "--seq-len", "64", "--max-steps", "2", "--log-every", "1", "--no-progress",
                                "--num-proc", "1", "--num-heads", "2", *extra])
        except SystemExit as e:
            code = e.code
        return code, capsys.readouterr().err
    return run


def one_error(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_the_model_folder_and_foreign_folders_are_refused(setup, train, tmp_path):
    model, data = setup
    config = (model / "config.json").read_text()
    code, err = train(model, data, model)
    assert code == 2 and "is the --model folder" in one_error(err)
    assert (model / "config.json").read_text() == config and not (model / ".medusa_jax_train").exists()
    other = tmp_path / "other-model"
    shutil.copytree(model, other)
    code, err = train(model, data, other)
    assert code == 2 and "holds a model" in one_error(err)
    assert (other / "config.json").read_text() == config and not (other / ".medusa_jax_train").exists()
    foreign = tmp_path / "notes"
    foreign.mkdir()
    (foreign / "config.json").write_text('{"mine": true}')
    (foreign / "train_log.jsonl").write_text('{"step": 99}\n')
    code, err = train(model, data, foreign)
    assert code == 2 and "--force-output" in one_error(err)
    assert (foreign / "config.json").read_text() == '{"mine": true}'
    code, err = train(model, data, foreign, "--force-output")  # still never deletes an existing log
    assert code == 2 and "--resume" in one_error(err) and (foreign / "train_log.jsonl").read_text() == '{"step": 99}\n'
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    code, err = train(model, data, a_file)
    assert code == 2 and "is a file" in one_error(err)


def test_a_second_run_on_a_locked_folder_gets_one_line(setup, train, tmp_path):
    model, data = setup
    out = tmp_path / "heads"
    with OutputLock(out):  # another run holds the folder
        code, err = train(model, data, out)
    assert code == 2 and "in use by another training run" in one_error(err)
    assert not (out / "train_log.jsonl").exists()
    code, _ = train(model, data, out)  # the lock went with the first holder
    assert code == 0 and (out / "heads.safetensors").exists() and (out / ".medusa_jax_train").exists()


@pytest.mark.parametrize("extra, flag", [(["--max-steps", "0"], "--max-steps"), (["--batch-size", "0"], "--batch-size"),
                                         (["--lm-head", "truncated:x"], "--lm-head"),
                                         (["--seq-len", "1"], "--seq-len")])
def test_bad_flags_are_one_error_line_naming_the_flag(setup, train, tmp_path, extra, flag):
    model, data = setup
    code, err = train(model, data, tmp_path / "out", *extra)
    assert code == 2 and flag in one_error(err) and not (tmp_path / "out").exists()


def test_data_errors_are_one_line(setup, train, tmp_path):
    model, data = setup
    bad = tmp_path / "bad.json"
    bad.write_text("[{\"conversations\": 3}]")
    code, err = train(model, bad, tmp_path / "out")
    assert code == 2 and "bad.json" in one_error(err)
    code, err = train(model / "config.json", data, tmp_path / "out2")  # (bad data would be named first)
    assert code == 2 and "is a file, not a model folder" in one_error(err)


def test_memory_plan_refuses_with_advice_before_loading(setup, train, tmp_path):
    model, data = setup
    code, err = train(model, data, tmp_path / "out", "--lm-head", "own", "--memory-limit", "1")
    line = one_error(err)
    assert code == 2 and "--lm-head truncated:" in line and "--cache-hidden" in line and "--batch-size" in line
    assert not (tmp_path / "out").exists()


def test_old_default_is_refused_on_24_gib_and_the_new_default_fits(smollm2_dir_config):
    from medusa_jax.training.run import RunConfig

    r = RunConfig("", "")
    common = dict(num_heads=r.num_heads, num_layers=r.num_layers, batch_size=r.batch_size, seq_len=1024,
                  cached_batch_size=r.cached_batch_size, cache_hidden=False, medusa2=False, distill_kl=False,
                  freeze_lm_heads=False)
    smollm2 = ModelConfig.from_hf_config(smollm2_dir_config)
    old = estimate_run(smollm2, head_vocab=smollm2.vocab_size, **common)
    new = estimate_run(smollm2, head_vocab=int(r.lm_head.split(":")[1]), **common)
    assert old.total > 20 * GIB  # measured: 23.9 GB peak, killed by the OOM killer on a 24 GB machine
    assert new.total < 6 * GIB and r.lm_head.startswith("truncated:")


@pytest.fixture
def smollm2_dir_config():
    """SmolLM2-135M's architecture (the HF config's numbers that the estimate reads)."""
    return {"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "vocab_size": 49152,
            "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "tie_word_embeddings": True}


def test_cache_hidden_refuses_a_cache_larger_than_memory():
    check_cache_fits(1 * GIB, limit_gib=4)
    check_cache_fits(100 * GIB, limit_gib=0)  # 0: no check
    with pytest.raises(MemoryPlanError, match="--max-conversations"):
        check_cache_fits(3 * GIB, limit_gib=4)
