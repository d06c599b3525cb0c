"""Whole training runs on a tiny chat model: CLI, resume equivalence, NaN stop, a process killed while saving."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import signal
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from medusa_jax.heads.folder import load_native_heads
from medusa_jax.training import hidden_store
from medusa_jax.training import trainer as trainer_mod
from medusa_jax.training.self_distill import DistillConfig, self_distill

from event_reader import read_scalars
from training_helpers import build_tiny_chat_model, chat_records, write_json


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("run")
    model = build_tiny_chat_model(root / "model")
    data = write_json(root / "chat.json", chat_records(80, seed=1))
    return model, data, root


def _args(model, data, out, *extra):
    return ["--model", str(model), "--data", str(data), "--output", str(out), "--batch-size", "4", "--seq-len", "128",
            "--heldout-fraction", "0.1", "--log-every", "1", "--no-progress", "--num-proc", "1", *extra]


def _train(args, monkeypatch, tmp_path):
    from scripts_train_heads import main

    monkeypatch.setenv("MEDUSA_JAX_CACHE", str(tmp_path / "cache"))
    return main(args)


@pytest.fixture(autouse=True)
def _scripts_on_path(monkeypatch):
    spec = importlib.util.spec_from_file_location(
        "scripts_train_heads", Path(__file__).parents[1] / "scripts" / "train_heads.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setitem(sys.modules, "scripts_train_heads", module)


def _log(out: Path, kind: str) -> list[dict]:
    return [r for r in map(json.loads, (out / "train_log.jsonl").read_text().splitlines()) if r["kind"] == kind]


def test_help_explains_every_flag():
    from scripts_train_heads import build_parser

    parser = build_parser()
    for action in parser._actions:
        assert action.help and len(action.help) > 10, action.option_strings
    text = parser.format_help()
    for flag in ("--model", "--data", "--output", "--num-heads", "--num-layers", "--lm-head", "--max-steps",
                 "--resume", "--mesh", "--medusa2"):
        assert flag in text


@pytest.mark.parametrize("extra", [["--lm-head", "truncated:64"], ["--lm-head", "shared", "--cache-hidden",
                                                                   "--cached-batch-size", "64"]])
def test_cli_trains_and_writes_a_loadable_heads_folder(setup, tmp_path, monkeypatch, extra):
    model, data, _ = setup
    out = tmp_path / "heads"
    _train(_args(model, data, out, "--max-steps", "4", "--num-heads", "3", "--eval-every", "2", *extra),
           monkeypatch, tmp_path)
    heads = load_native_heads(out)
    assert heads.config.num_heads == 3 and heads.config.lm_head == extra[1].split(":")[0]
    train, evals = _log(out, "train"), _log(out, "eval")
    assert [r["step"] for r in train] == [1, 2, 3, 4] and [r["step"] for r in evals] == [2, 4]
    assert len(evals[-1]["top1"]) == 3 and all(0 <= a <= b <= 1 for a, b in zip(evals[-1]["top1"], evals[-1]["top5"]))
    assert all(np.isfinite(r["loss"]) and r["tokens_per_s"] > 0 for r in train)
    assert json.loads((out / "config.json").read_text())["training"]["steps"] == 4


@pytest.mark.parametrize("extra", [["--cache-hidden", "--cached-batch-size", "32", "--head-loss", "kl",
                                    "--lm-head", "truncated:64"],
                                   ["--head-loss", "ce+kl", "--kl-weight", "0.5", "--lm-head", "shared"],
                                   ["--cache-hidden", "--cached-batch-size", "32", "--head-type", "hydra",
                                    "--head-loss", "ce+kl", "--lm-head", "truncated:64"]])
def test_cli_trains_distilled_targets_from_the_arrow_store(setup, tmp_path, monkeypatch, extra):
    """The self-distilled Arrow store as --data: memory-mapped cached examples (Hydra heads' paths from its reply
    token ids), or its token ids packed into rows."""
    model, data, root = setup
    distilled = root / "distilled.jsonl"
    if not hidden_store.is_store(hidden_store.store_path(distilled)):
        self_distill(model, str(data), distilled, DistillConfig(max_new_tokens=16, batch_size=8, limit=24,
                                                                save_hidden=True), progress=False, log=lambda _: None)
    out = tmp_path / "heads"
    _train(_args(model, hidden_store.store_path(distilled), out, "--max-steps", "3", "--num-heads", "2",
                 "--eval-every", "3", *extra), monkeypatch, tmp_path)
    config = load_native_heads(out).config
    assert config.num_heads == 2 and config.head_type == ("hydra" if "hydra" in extra else "medusa")
    (final,) = _log(out, "eval")
    assert len(final["head_kl"]) == 2 and all(np.isfinite(final["head_kl"])) and min(final["head_kl"]) > 0
    assert all(np.isfinite(r["loss"]) for r in _log(out, "train"))


def test_scan_layers_run_loads_the_stacked_layout_and_saves_the_per_layer_backbone(setup, tmp_path, monkeypatch):
    """--scan-layers reads the backbone straight into the stacked layout (no per-layer form stacked afterwards) and
    the Medusa-2 run gives the unrolled run's losses and saved backbone (hf/save writes the stacks per layer)."""
    from medusa_jax.hf.tensor_files import SafetensorsFile
    from medusa_jax.model import layer_stack

    model, data, _ = setup
    stacked_copies = []
    real_stack = layer_stack._stack
    monkeypatch.setattr(layer_stack, "_stack", lambda leaves: stacked_copies.append(
        not isinstance(leaves[0], jax.core.Tracer) and not isinstance(leaves[0], jax.ShapeDtypeStruct))
        or real_stack(leaves))
    outs = {}
    for name, flags in (("unrolled", []), ("scanned", ["--scan-layers", "--remat", "full"])):
        outs[name] = tmp_path / name
        stacked_copies.clear()
        _train(_args(model, data, outs[name], "--max-steps", "2", "--num-heads", "2", "--eval-every", "2",
                     "--medusa2", "--lm-head", "shared", *flags), monkeypatch, tmp_path)
        assert not any(stacked_copies), name  # no concrete per-layer parameters were stacked
    losses = {name: [r["loss"] for r in _log(out, "train")] for name, out in outs.items()}
    np.testing.assert_allclose(losses["scanned"], losses["unrolled"], rtol=1e-4)
    ours, ref = (SafetensorsFile(outs[n] / "base_model" / "model.safetensors") for n in ("scanned", "unrolled"))
    assert sorted(ours.names) == sorted(ref.names) and any(".layers.1." in n for n in ref.names)
    for name in ref.names:
        np.testing.assert_allclose(ours.array(name), ref.array(name), rtol=1e-4, atol=1e-6, err_msg=name)


def test_resumed_run_matches_an_uninterrupted_one(setup, tmp_path, monkeypatch):
    model, data, _ = setup
    common = ["--max-steps", "7", "--save-every", "3", "--eval-every", "100", "--learning-rate", "3e-3",
              "--warmup-steps", "2"]
    _train(_args(model, data, tmp_path / "a", *common), monkeypatch, tmp_path)
    expected = {r["step"]: r["loss"] for r in _log(tmp_path / "a", "train")}

    real_step = trainer_mod.Trainer.train_step

    def crash_after_five(self, batch):
        if self.step == 5:
            raise KeyboardInterrupt("simulated crash")
        return real_step(self, batch)

    monkeypatch.setattr(trainer_mod.Trainer, "train_step", crash_after_five)
    with pytest.raises(KeyboardInterrupt):
        _train(_args(model, data, tmp_path / "b", *common), monkeypatch, tmp_path)
    monkeypatch.setattr(trainer_mod.Trainer, "train_step", real_step)
    _train(_args(model, data, tmp_path / "b", *common, "--resume"), monkeypatch, tmp_path)
    resumed = [r for r in _log(tmp_path / "b", "train")]
    # steps 1-3 from the first attempt (its steps 4-5 after the step-3 checkpoint are dropped), then 4-7 again
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6, 7]
    for r in resumed[3:]:
        assert r["loss"] == pytest.approx(expected[r["step"]], abs=1e-6), r["step"]
    assert resumed[-1]["epoch"] == _log(tmp_path / "a", "train")[-1]["epoch"]


def test_checkpoints_refuse_a_different_run_and_an_accidental_restart(setup, tmp_path, monkeypatch, capsys):
    model, data, _ = setup
    assert _train(_args(model, data, tmp_path / "c", "--max-steps", "2", "--save-every", "1"), monkeypatch,
                  tmp_path) == 0
    capsys.readouterr()
    log = (tmp_path / "c" / "train_log.jsonl").read_text()
    assert _train(_args(model, data, tmp_path / "c", "--max-steps", "3"), monkeypatch, tmp_path) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "--resume" in err and len(err.strip().splitlines()) == 1
    assert (tmp_path / "c" / "train_log.jsonl").read_text() == log  # nothing deleted
    assert _train(_args(model, data, tmp_path / "c", "--max-steps", "3", "--num-heads", "2", "--resume"),
                  monkeypatch, tmp_path) == 2
    assert "different ['heads'" in capsys.readouterr().err


def test_nan_loss_stops_with_a_clear_error_and_keeps_the_last_good_checkpoint(setup, tmp_path, monkeypatch,
                                                                             capsys):
    from medusa_jax.training.checkpointing import Checkpoints, all_finite

    model, data, _ = setup
    out = tmp_path / "nan"
    # an absurd learning rate blows the heads up within a few steps
    code = _train(_args(model, data, out, "--max-steps", "50", "--save-every", "1", "--learning-rate", "1e30",
                        "--warmup-steps", "0", "--clip-norm", "0"), monkeypatch, tmp_path)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert code == 1 and len(lines) == 1, lines
    err = lines[0]
    assert "NaN" in err or "nan" in err or "inf" in err
    good = int(err.split("last good checkpoint is step ")[1].split(" ")[0])
    ckpt = Checkpoints(out / "checkpoints", save_every=1)
    assert ckpt.all_steps() and max(ckpt.all_steps()) == good  # the diverged state was never saved
    assert bool(all_finite(ckpt.manager.restore(good).state["params"]))  # and it is finite
    losses = [r["loss"] for r in _log(out, "train")]
    assert all(np.isfinite(losses)) and len(losses) >= good


def test_resume_skips_a_checkpoint_with_nan_weights(setup, tmp_path, monkeypatch, capsys):
    """A checkpoint holding NaN weights (as an older version could save) is skipped on --resume."""
    import orbax.checkpoint as ocp

    from medusa_jax.training.checkpointing import Checkpoints

    model, data, _ = setup
    out = tmp_path / "skip"
    assert _train(_args(model, data, out, "--max-steps", "2", "--save-every", "1"), monkeypatch, tmp_path) == 0
    ckpt = Checkpoints(out / "checkpoints", save_every=1)
    restored = ckpt.manager.restore(2)
    state = jax.tree.map(lambda x: jnp.full_like(x, jnp.nan) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                         restored.state)
    meta = dict(restored.meta, step=3)
    ckpt.manager.save(3, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
                      force=True)
    ckpt.close()
    capsys.readouterr()
    assert _train(_args(model, data, out, "--max-steps", "4", "--save-every", "1", "--resume"), monkeypatch,
                  tmp_path) == 0
    captured = capsys.readouterr()
    assert "checkpoints/3 holds NaN/inf weights: skipped" in captured.out
    assert "resumed from" in captured.out and "/2 (" in captured.out
    assert [r["step"] for r in _log(out, "train")] == [1, 2, 3, 4]


def test_metrics_go_to_tensorboard_beside_the_jsonl_log(setup, tmp_path, monkeypatch):
    model, data, _ = setup
    out = tmp_path / "tb"
    assert _train(_args(model, data, out, "--max-steps", "3", "--eval-every", "3"), monkeypatch, tmp_path) == 0
    events = read_scalars(out / "tensorboard")
    train = _log(out, "train")
    assert [step for step, _ in events["train/loss"]] == [r["step"] for r in train]
    assert np.allclose([v for _, v in events["train/loss"]], [r["loss"] for r in train], rtol=1e-6)
    heldout = _log(out, "eval")[-1]
    assert np.allclose(events["eval/top1/0"][-1][1], heldout["top1"][0], rtol=1e-6)
    assert not (out / ".final.tmp").exists() and not list(out.glob(".final.*"))


def test_wandb_gets_the_same_metrics_when_asked_for(setup, tmp_path, monkeypatch):
    calls = {"init": [], "log": [], "finish": 0}

    class Run:
        def log(self, values, step):
            calls["log"].append((step, values))

        def finish(self):
            calls["finish"] += 1

    def init(**kw):
        calls["init"].append(kw)
        return Run()

    stub = types.ModuleType("wandb")
    stub.init = init
    stub.__spec__ = importlib_spec("wandb")
    monkeypatch.setitem(sys.modules, "wandb", stub)
    model, data, _ = setup
    out = tmp_path / "wb"
    assert _train(_args(model, data, out, "--max-steps", "2", "--wandb", "medusa-test"), monkeypatch, tmp_path) == 0
    assert calls["init"][0]["project"] == "medusa-test" and calls["finish"] == 1
    logged = {step: values for step, values in calls["log"] if "train/loss" in values}
    assert sorted(logged) == [1, 2]
    assert logged[2]["train/loss"] == pytest.approx(_log(out, "train")[-1]["loss"])


def importlib_spec(name):
    return importlib.machinery.ModuleSpec(name, None)


KILLER = textwrap.dedent("""
    import os, signal, sys
    import jax, jax.numpy as jnp
    from medusa_jax.training.checkpointing import Checkpoints

    class State:  # what Checkpoints.save reads from a Trainer
        def __init__(self, step, value):
            self.step = step
            self.params = {"w": jnp.full((4096, 4096), value, jnp.float32)}  # 64 MB: the save takes a while
            self.opt_state = {"m": jnp.zeros((8,))}

    ckpt = Checkpoints(sys.argv[1], save_every=1, keep=3, async_save=True)
    ckpt.save(State(1, 1.0), {"epoch": 0, "index": 1}, {"run": "x"})
    ckpt.wait()
    ckpt.save(State(2, 2.0), {"epoch": 0, "index": 2}, {"run": "x"})  # returns while the write goes on
    # kill it once the write has begun (its temporary folder exists): on a loaded machine the background
    # write may not have started when save returns
    import time
    from pathlib import Path
    deadline = time.monotonic() + 60
    while not any(not p.name.isdigit() for p in Path(sys.argv[1]).iterdir()) and time.monotonic() < deadline:
        time.sleep(0.001)
    os.kill(os.getpid(), signal.SIGKILL)
""")


def test_a_process_killed_while_saving_leaves_the_previous_checkpoint_usable(tmp_path):
    from medusa_jax.training.checkpointing import Checkpoints

    folder = tmp_path / "ckpt"
    proc = subprocess.run([sys.executable, "-c", KILLER, str(folder)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    leftovers = [p.name for p in folder.iterdir() if not p.name.isdigit()]
    ckpt = Checkpoints(folder, save_every=1)
    assert ckpt.latest_step() == 1, (sorted(p.name for p in folder.iterdir()))
    assert leftovers, "the kill should have interrupted the second save"

    class Target:
        step = 0
        params = {"w": jnp.zeros((4096, 4096), jnp.float32)}
        opt_state = {"m": jnp.ones((8,))}

    target = Target()
    meta = ckpt.restore(target, {"run": "x"})
    assert meta["data_position"] == {"epoch": 0, "index": 1} and target.step == 1
    assert float(target.params["w"].min()) == float(target.params["w"].max()) == 1.0
