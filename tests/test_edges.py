"""Trust at the edges (issue 27), beyond the bad-input table: Hub ids resolved offline from a Hub cache the test
builds, one self-distillation per output, the README's export of the shipped Medusa heads, benchmarks that
keep away from the committed results, the final files' one-step commit, no folder left by a failed run, and the
progress heartbeat."""

from __future__ import annotations

import functools
import importlib.util
import io
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from medusa_jax import atomic
from medusa_jax.assets import resolve_heads_dir
from medusa_jax.heads.config import HeadsConfig
from medusa_jax.heads.folder import save_heads
from medusa_jax.heads.init import init_heads
from medusa_jax.hf.load import load_pretrained
from medusa_jax.progress import heartbeat
from medusa_jax.scripts.cli_args import ArgumentParser
from medusa_jax.training.output_folder import FileLock

from training_helpers import build_tiny_chat_model, chat_records, write_json

ROOT = Path(__file__).resolve().parents[1]


def script(name: str):
    spec = importlib.util.spec_from_file_location(f"edges_{name}", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(name: str, argv: list[str], capsys) -> tuple[int, str, str]:
    return run_module(script(name), argv, capsys)


def run_module(module, argv: list[str], capsys) -> tuple[int, str, str]:
    capsys.readouterr()
    try:
        code = module.main(argv)
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def hub_cache(cache: Path, repo_id: str, folder: Path, revision: str = "0123456789abcdef") -> Path:
    """huggingface_hub's cache layout around a local folder: blobs, snapshots/<rev>/ links, refs/main."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for f in folder.iterdir():
        if f.is_file():
            blob = repo / "blobs" / f"{f.name}.blob"
            shutil.copy(f, blob)
            (snapshot / f.name).symlink_to(Path("..") / ".." / "blobs" / blob.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return snapshot


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return build_tiny_chat_model(tmp_path_factory.mktemp("edges") / "model")


@pytest.fixture
def offline(monkeypatch, tmp_path):
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("MEDUSA_JAX_CACHE", str(tmp_path / "cache"))
    return cache


def test_hub_ids_load_from_the_hub_cache_offline(chat_model, offline, capsys, tmp_path):
    snapshot = hub_cache(offline, "TinyOrg/tiny-chat", chat_model)
    by_id, by_path = load_pretrained("TinyOrg/tiny-chat"), load_pretrained(chat_model)
    assert np.array_equal(np.asarray(by_id.embed_tokens.embedding[...]), np.asarray(by_path.embed_tokens.embedding[...]))
    heads = init_heads(HeadsConfig(by_path.config.hidden_size, by_path.config.vocab_size, 3), by_path, seed=0)  # the default tree's depth
    save_heads(heads, tmp_path / "heads")
    hub_cache(offline, "TinyOrg/tiny-heads", tmp_path / "heads")
    assert resolve_heads_dir("TinyOrg/tiny-heads").resolve() == (offline / "models--TinyOrg--tiny-heads" / "snapshots"
                                                                 / "0123456789abcdef").resolve()
    code, out, err = run("generate", ["--model", "TinyOrg/tiny-chat", "--heads", "TinyOrg/tiny-heads", "--chat",
                                      "--prompt", "tell me a story", "--max-new-tokens", "4", "--json"], capsys)
    assert code == 0, err
    assert json.loads(out.strip().splitlines()[-1])["new_tokens"] >= 1
    assert snapshot.is_dir()  # read in place, nothing copied or downloaded


def test_an_uncached_hub_id_offline_is_one_line_at_once(chat_model, offline, capsys):
    start = time.perf_counter()
    code, _, err = run("generate", ["--model", "NoOrg/not-cached", "--prompt", "hi"], capsys)
    assert code == 2 and err.count("error: ") == 1 and "HF_HUB_OFFLINE" in err
    assert time.perf_counter() - start < 10


def test_one_self_distillation_per_output(chat_model, tmp_path, capsys):
    data = write_json(tmp_path / "chat.json", chat_records(6, seed=3))
    out = tmp_path / "d.jsonl"
    out.write_text('{"id": "c0", "conversations": []}\n')
    before = out.read_text()
    with FileLock(out):  # another run writes this output
        code, _, err = run("self_distill", ["--model", str(chat_model), "--data", str(data), "--output", str(out),
                                            "--max-new-tokens", "4", "--batch-size", "2", "--no-progress"], capsys)
    assert code == 2 and "being written by another run" in err and err.count("error: ") == 1
    assert out.read_text() == before and sorted(p.name for p in tmp_path.iterdir()) == ["chat.json", "d.jsonl"]


def test_a_failed_self_distillation_leaves_no_folder(chat_model, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"conversations": 3}\n')
    code, _, err = run("self_distill", ["--model", str(chat_model), "--data", str(bad), "--output",
                                        str(tmp_path / "new" / "deeper" / "d.jsonl"), "--max-new-tokens", "16",
                                        "--no-progress"], capsys)
    assert code == 2 and "bad.jsonl" in err and not (tmp_path / "new").exists()


def test_the_readme_export_of_the_shipped_medusa_heads_works(tmp_path, capsys):
    code, out, err = run("export_heads", ["--heads", "default-medusa", "--out", str(tmp_path / "exported")], capsys)
    assert code == 0, err
    assert (tmp_path / "exported" / "medusa_lm_head.safetensors").is_file()
    assert json.loads((tmp_path / "exported" / "config.json").read_text())["medusa_num_heads"] == 4


@pytest.mark.parametrize("name, mode", [("benchmark", None), ("benchmark", "heads"), ("benchmark_batch", None),
                                        ("benchmark_batch", "scaling"), ("benchmark_batch", "decode"),
                                        ("benchmark_batch", "gpu"), ("benchmark_loading", None)])
def test_benchmarks_write_into_the_repo_results_only_when_told(name, mode, capsys):
    with pytest.raises(SystemExit):
        script(name).main(([mode] if mode else []) + ["--help"])
    text = " ".join(capsys.readouterr().out.split())
    default = text.split("--out OUT")[-1].split("(default: ")[1].split(")")[0]
    assert default.startswith("artifacts/") and not default.startswith("bench")


def test_the_final_files_are_one_commit(tmp_path, monkeypatch):
    out, staging = tmp_path / "heads", tmp_path / "heads" / ".final.1.tmp"
    staging.mkdir(parents=True)
    (out / "config.json").write_text("old config")
    (out / "heads.safetensors").write_text("old weights")
    (staging / "config.json").write_text("new config")
    (staging / "heads.safetensors").write_text("new weights")
    real = os.replace

    def killed_before_config(src, dst):  # the process dies after the weights, before config.json
        if Path(dst).name == "config.json":
            raise KeyboardInterrupt
        return real(src, dst)

    monkeypatch.setattr(atomic.os, "replace", killed_before_config)
    with pytest.raises(KeyboardInterrupt):
        atomic.commit_entries(staging, out, "config.json")
    assert not (out / "config.json").exists()  # never new weights under the old config
    monkeypatch.setattr(atomic.os, "replace", real)
    (staging / "heads.safetensors").write_text("new weights")
    atomic.commit_entries(staging, out, "config.json")
    assert (out / "config.json").read_text() == "new config" and (out / "heads.safetensors").read_text() == "new weights"
    assert not staging.exists()


def test_a_failed_training_run_leaves_no_folder(chat_model, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MEDUSA_JAX_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "bad.json"
    bad.write_text('[{"conversations": 3}]')
    code, _, err = run("train_heads", ["--model", str(chat_model), "--data", str(bad), "--output",
                                       str(tmp_path / "fresh" / "out"), "--no-progress", "--num-proc", "1"], capsys)
    assert code == 2 and "bad.json" in err and not (tmp_path / "fresh").exists()


def test_the_heartbeat_shows_progress_only_for_long_jobs():
    quiet, loud = io.StringIO(), io.StringIO()
    with heartbeat("fast", delay=1.0, stream=quiet):
        pass
    with heartbeat("compiling", delay=0.05, every=0.05, stream=loud):
        time.sleep(0.3)
    assert quiet.getvalue() == ""
    assert "compiling: 0 s so far" in loud.getvalue() and "compiling: done in" in loud.getvalue()


def test_every_numeric_flag_has_a_rule():
    """cli_args refuses a numeric flag without check= at parse time; every command's help parses."""
    p = ArgumentParser(prog="t")
    p.add_argument("--n", type=int, default=1)
    with pytest.raises(RuntimeError, match="--n has no check"):
        p.parse_args([])


def test_plan_shows_progress_while_it_compiles(monkeypatch, capsys):
    """plan.py wraps its compilation in the heartbeat: a compile longer than the delay prints elapsed time."""
    plan = script("plan")

    def slow_compile(config):
        time.sleep(0.4)
        raise ValueError("stopped after the compile (the test's stand-in)")

    monkeypatch.setattr(plan, "heartbeat", functools.partial(heartbeat, delay=0.05, every=0.1))
    monkeypatch.setattr(plan, "compile_plan", slow_compile)
    monkeypatch.setattr(plan, "force_host_devices", lambda count: None)  # keep this process's JAX as it is
    code, _, err = run_module(plan, ["--model", "llama3-8b", "--job", "decode", "--batch", "1", "--seq", "64",
                                     "--cache", "256"], capsys)
    assert code == 2 and "error: stopped after the compile" in err
    assert "compiling the decode step for mesh of one device: 0 s so far" in err
    assert "compiling the decode step for mesh of one device: done in" in err
