"""Every command line over a table of bad inputs: one `error:` line naming the flag, exit status 2, no traceback,
and no file of the world changed, added or removed. Every case must fail before any model loads: the model
folder here is a fake (a config.json, a weights file of garbage and an empty tokenizer), so a case that got as
far as loading would fail with another message. The Hub is offline (HF_HUB_OFFLINE=1, an empty HF_HUB_CACHE)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
_MODULES: dict[str, object] = {}

LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 512,
         "rms_norm_eps": 1e-6, "tie_word_embeddings": False}
CHAT = [{"id": "a", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}]


def script(name: str):
    if name not in _MODULES:
        spec = importlib.util.spec_from_file_location(f"bad_inputs_{name}", SCRIPTS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _MODULES[name] = module
    return _MODULES[name]


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    w = tmp_path_factory.mktemp("world")
    for name, config in (("model", LLAMA), ("gpt2", {**LLAMA, "model_type": "gpt2"}), ("notok", LLAMA)):
        (w / name).mkdir()
        (w / name / "config.json").write_text(json.dumps(config))
        (w / name / "model.safetensors").write_bytes(b"not weights: never loaded by a bad-input case")
        if name != "notok":
            (w / name / "tokenizer.json").write_text("{}")
    (w / "heads").mkdir()
    (w / "heads" / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "medusa_num_layers": 1}))
    (w / "data.json").write_text(json.dumps(CHAT))
    (w / "prompts.jsonl").write_text('"hello"\n')
    (w / "garbage.txt").write_text("this is not JSON at all")
    (w / "afile").write_text("a regular file")
    (w / "taken.jsonl.arrow").write_text("a file where self_distill --save-hidden would put its store")
    (w / "empty").mkdir()
    (w / "full").mkdir()
    (w / "full" / "notes.txt").write_text("mine")
    (w / "log.jsonl").write_text(json.dumps({"kind": "train", "step": 1, "loss": 1.0, "head_loss": [1.0]}) + "\n")
    (w / "blank.jsonl").write_text("\n\n")
    (w / "nohead.jsonl").write_text(json.dumps({"kind": "train", "step": 1}) + "\n")
    return w


def snapshot(root: Path) -> dict[str, str]:
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        out[rel] = "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
    return out


M, G2, NT, H, D = "{w}/model", "{w}/gpt2", "{w}/notok", "{w}/heads", "{w}/data.json"
SV = ("serve", ["--model", M, "--port", "65533"])  # a port no case binds: each fails before listening
GEN = ("generate", ["--model", M, "--prompt", "hi"])
SD = ("self_distill", ["--model", M, "--data", D, "--output", "{w}/distilled.jsonl", "--no-progress"])
TR = ("train_heads", ["--model", M, "--data", D, "--output", "{w}/trained", "--no-progress"])
EX = ("export_heads", ["--heads", H, "--out", "{w}/exported"])
BT = ("build_tree", ["--model", M, "--heads", H])
BF = ("build_features", ["--model", M, "--data", D, "--output", "{w}/features", "--no-progress"])
PL = ("plan", ["--model", "llama3-8b"])
BM = ("benchmark", ["--model", M, "--heads", H])
BB = ("benchmark_batch", ["--model", M, "--heads", H])
BX = ("benchmark_mixed", ["--model", M, "--heads", H])

CASES = [  # (command, extra args, text the error line must hold)
    (GEN, ["--temperature", "nan"], "--temperature nan"), (GEN, ["--temperature", "inf"], "--temperature"),
    (GEN, ["--temperature", "-1"], "--temperature"), (GEN, ["--top-p", "0"], "--top-p"),
    (GEN, ["--top-p", "1.5"], "--top-p"), (GEN, ["--top-p", "nan"], "--top-p"), (GEN, ["--top-k", "-1"], "--top-k"),
    (GEN, ["--seed", "-1"], "--seed"), (GEN, ["--seed", str(2**40)], "--seed"),
    (GEN, ["--max-new-tokens", "0"], "--max-new-tokens"), (GEN, ["--max-new-tokens", "100000000"], "--max-new-tokens"),
    (GEN, ["--max-new-tokens", "abc"], "--max-new-tokens"), (GEN, ["--batch-size", "0"], "--batch-size"),
    (GEN, ["--mesh", "data=0"], "--mesh"), (GEN, ["--mesh", "foo=2"], "--mesh"),
    (GEN, ["--mesh", "data=64"], "needs 64 devices"), (GEN, ["--attention", "cudnn"], "--attention cudnn: needs an NVIDIA GPU"),
    (TR, ["--attention", "cudnn"], "--attention cudnn: needs an NVIDIA GPU"), (GEN, ["--output", M + "/config.json"], "inside the --model"),
    (GEN, ["--output", H + "/out.jsonl", "--heads", H], "inside the --heads"),
    (GEN, ["--output", "{w}/afile/x.jsonl"], "is a file, not a folder"), (GEN, ["--output", "{w}/empty"], "is a folder"),
    (("generate", ["--model", M, "--input", D, "--output", D]), [], "is the --input file"),
    (GEN, ["--num-processes", "0"], "--num-processes"), (GEN, ["--process-id", "-1"], "--process-id"),
    (GEN, ["--tree", "mc_sim_7b_63"], "need --heads"), (GEN, ["--calibration", "redo"], "need --heads"),
    (GEN, ["--heads", H, "--calibration", "sometimes"], "--calibration"), (GEN, ["--heads", H, "--tree", "{w}/nope.json"], "--tree"),
    (GEN, ["--heads", H, "--acceptance", "greedy", "--temperature", "0.5"], "--acceptance"),
    (GEN, ["--heads", "{w}/nope"], "--heads"), (GEN, ["--heads", "{w}/empty"], "no config.json"),
    (BX, ["--budgets", "0"], "--budgets"), (BX, ["--mixes", "lookup@0"], "budget after @"),
    (BX, ["--mixes", "lookup+lokup"], "neither a drafter"), (BX, ["--questions", "-1"], "--questions"),
    (BX, ["--questions", "2", "--second-turns", "3"], "--second-turns 3: at most --questions"),
    (BX, ["--batch-size", "0"], "--batch-size"), (BX, ["--humaneval", "-1"], "--humaneval"),
    (BX, ["--repeats", "0"], "--repeats"), (BX, ["--mixes", "nope@4"], "--mixes nope: heads folder does not exist"),
    (BX, ["--mixes", "{w}/afile@4"], "--mixes {w}/afile: heads folder does not exist"),
    (GEN, ["--heads", "default+lokup"], "'lokup' is neither a drafter"), (GEN, ["--heads", "lookup++default"], "no empty part"),
    (GEN, ["--heads", "{w}/nope+lookup"], "neither a drafter"), (GEN, ["--heads", "lookup+lookup"], "named twice"),
    (GEN, ["--heads", "{w}/empty+lookup"], "no config.json"), (GEN, ["--heads", "lookup", "--tree", "mc_sim_7b_63"], "drop --tree"),
    (("generate", ["--model", "{w}/nope", "--prompt", "hi"]), [], "does not exist"),
    (("generate", ["--model", "{w}/afile", "--prompt", "hi"]), [], "is a file"),
    (("generate", ["--model", "{w}/empty", "--prompt", "hi"]), [], "no config.json"),
    (("generate", ["--model", G2, "--prompt", "hi"]), [], "gpt2"),
    (("generate", ["--model", NT, "--prompt", "hi"]), [], "no tokenizer"),
    (("generate", ["--model", "NoOrg/NoModel", "--prompt", "hi"]), [], "HF_HUB_OFFLINE"),
    (("generate", ["--model", M, "--input", "{w}/nope.jsonl", "--output", "{w}/o.jsonl"]), [], "--input"),
    (("generate", ["--model", M, "--input", "{w}/garbage.txt", "--output", "{w}/o.jsonl"]), [], "garbage.txt:1"),
    (("generate", ["--model", M, "--input", "{w}/prompts.jsonl"]), [], "--output"),
    (("generate", ["--model", M]), [], "--prompt"),
    (SD, ["--temperature", "nan"], "--temperature"), (SD, ["--temperature", "-0.5"], "--temperature"),
    (SD, ["--limit", "-1"], "--limit"), (SD, ["--limit", "0"], "--limit"),
    (SD, ["--max-new-tokens", "0"], "--max-new-tokens"), (SD, ["--batch-size", "0"], "--batch-size"),
    (SD, ["--chunk-steps", "0"], "--chunk-steps"), (SD, ["--turns", "0"], "--turns"),
    (SD, ["--max-prompt-tokens", "0"], "--max-prompt-tokens"), (SD, ["--seed", str(2**40)], "--seed"),
    (SD, ["--num-shards", "0"], "--num-shards"), (SD, ["--num-shards", "2", "--shard-index", "2"], "--shard-index"),
    (SD, ["--mesh", "data=0"], "--mesh"), (SD, ["--mesh", "data=64"], "needs 64 devices"),
    (SD, ["--max-new-tokens", "1000"], "positions"), (SD, ["--turns", "3"], "positions"),
    (("self_distill", ["--model", M, "--data", D, "--output", D]), [], "is the --data file"),
    (("self_distill", ["--model", M, "--data", D, "--output", M + "/d.jsonl"]), [], "inside the --model"),
    (("self_distill", ["--model", M, "--data", D, "--output", "{w}/afile/d.jsonl"]), [], "is a file"),
    (("self_distill", ["--model", M, "--data", D, "--output", "{w}/empty"]), [], "is a folder"),
    (("self_distill", ["--model", M, "--data", "{w}/nope.json", "--output", "{w}/d.jsonl"]), [], "--data"),
    (("self_distill", ["--model", M, "--data", "{w}/empty", "--output", "{w}/d.jsonl"]), [], "not a saved dataset"),
    (("self_distill", ["--model", M, "--data", "{w}/garbage.txt", "--output", "{w}/d.jsonl"]), ["--max-new-tokens", "16"], "is not JSON"),
    (("self_distill", ["--model", M, "--data", "NoOrg/NoData", "--output", "{w}/d.jsonl"]), ["--max-new-tokens", "16"], "NoOrg/NoData"),
    (("self_distill", ["--model", "{w}/nope", "--data", D, "--output", "{w}/d.jsonl"]), [], "--model"),
    (("self_distill", ["--model", M, "--data", D, "--output", "{w}/taken.jsonl", "--save-hidden"]), [], "is a file"),
    (TR, ["--learning-rate", "nan"], "--learning-rate"), (TR, ["--learning-rate", "0"], "--learning-rate"),
    (TR, ["--learning-rate", "inf"], "--learning-rate"), (TR, ["--max-conversations", "0"], "--max-conversations"),
    (TR, ["--heldout-fraction", "1"], "--heldout-fraction"), (TR, ["--heldout-fraction", "nan"], "--heldout-fraction"),
    (TR, ["--seed", "-5"], "--seed"), (TR, ["--batch-size", "0"], "--batch-size"), (TR, ["--max-steps", "0"], "--max-steps"),
    (TR, ["--seq-len", "4"], "--seq-len"), (TR, ["--num-heads", "0"], "--num-heads"),
    (TR, ["--warmup-steps", "-1"], "--warmup-steps"), (TR, ["--clip-norm", "nan"], "--clip-norm"),
    (TR, ["--weight-decay", "-1"], "--weight-decay"), (TR, ["--loss-decay", "0"], "--loss-decay"),
    (TR, ["--head-lr-multiplier", "0"], "--head-lr-multiplier"), (TR, ["--memory-limit", "-1"], "--memory-limit"),
    (TR, ["--eagle-noise", "nan"], "--eagle-noise"), (TR, ["--eagle-train-depth", "0"], "--eagle-train-depth"),
    (TR, ["--eagle-feature-weight", "0", "--eagle-ce-weight", "0"], "nothing to train"),
    (TR, ["--head-loss", "kl", "--kl-weight", "0"], "--head-loss"), (TR, ["--lm-head", "bogus"], "--lm-head"),
    (TR, ["--lm-head", "truncated:0"], "--lm-head"), (TR, ["--medusa2", "--head-type", "hydra"], "--head-type"),
    (TR, ["--medusa2", "--cache-hidden"], "--cache-hidden"), (TR, ["--distill-kl"], "--medusa2"),
    (TR, ["--remat", "some"], "--remat"), (TR, ["--attention", "flash"], "--attention"),
    (TR, ["--backbone-dtype", "float8"], "--backbone-dtype"), (TR, ["--medusa2", "--backbone-dtype", "bfloat16"],
                                                                 "--backbone-dtype"),
    (TR, ["--optimizer-dtype", "float16"], "--optimizer-dtype"), (TR, ["--loss-chunk", "-1"], "--loss-chunk"),
    (TR, ["--mesh", "data=2", "--batch-size", "3"], "does not split"), (TR, ["--wandb", "proj"], "--wandb"),
    (TR, ["--max-tokens", "0"], "--max-tokens"), (TR, ["--save-every", "0"], "--save-every"),
    (TR, ["--checkpoint-dir", M + "/ckpt"], "inside the --model"), (TR, ["--mesh", "tensor=64"], "needs 64 devices"),
    (("train_heads", ["--model", M, "--data", D, "--output", M]), [], "is the --model folder"),
    (("train_heads", ["--model", M, "--data", D, "--output", "{w}/afile"]), [], "is a file"),
    (("train_heads", ["--model", M, "--data", D, "--output", "{w}/afile/sub"]), [], "is a file, not a folder"),
    (("train_heads", ["--model", M, "--data", "{w}/empty", "--output", "{w}/t"]), [], "not a saved dataset"),
    (("train_heads", ["--model", M, "--data", "{w}/nope.jsonl", "--output", "{w}/t"]), [], "--data"),
    (("train_heads", ["--model", G2, "--data", D, "--output", "{w}/t"]), [], "gpt2"),
    (("train_heads", ["--model", "NoOrg/NoModel", "--data", D, "--output", "{w}/t"]), [], "HF_HUB_OFFLINE"),
    (EX, ["--format", "bogus"], "--format"), (EX, ["--dtype", "int8"], "--dtype"),
    (EX, ["--model", G2], "gpt2"), (EX, ["--model", "{w}/nope"], "--model"),
    (("export_heads", ["--heads", H, "--out", H]), [], "is the --heads folder"),
    (("export_heads", ["--heads", H, "--out", H + "/sub"]), [], "inside the --heads"),
    (("export_heads", ["--heads", H, "--out", "{w}/afile"]), [], "is a file"),
    (("export_heads", ["--heads", H, "--out", "{w}/full"]), [], "--overwrite"),
    (("export_heads", ["--heads", H, "--out", M, "--model", M]), [], "is the --model folder"),
    (("export_heads", ["--heads", "{w}/nope", "--out", "{w}/x"]), [], "--heads"),
    (("export_heads", ["--heads", "{w}/empty", "--out", "{w}/x"]), [], "no config.json"),
    (BT, ["--batch-sizes", "0"], "--batch-sizes"), (BT, ["--accuracy-scale", "0"], "--accuracy-scale"),
    (BT, ["--accuracy-scale", "nan"], "--accuracy-scale"), (BT, ["--min-speedup", "0"], "--min-speedup"),
    (BT, ["--tree-tokens", "1"], "--tree-tokens"), (BT, ["--repeats", "0"], "--repeats"),
    (BT, ["--context", "0"], "--context"), (BT, ["--heldout", "0"], "--heldout"), (BT, ["--top-k", "0"], "--top-k"),
    (BT, ["--continuation-tokens", "2"], "--continuation-tokens"), (BT, ["--max-nodes", "0"], "--max-nodes"),
    (BT, ["--out", M + "/trees.json"], "inside the --model"), (BT, ["--out", "{w}/afile/t.json"], "is a file"),
    (BT, ["--data", "{w}/nope.json"], "--data"),
    (("build_tree", ["--model", M, "--heads", "{w}/nope"]), [], "--heads"),
    (BF, ["--max-tokens", "0"], "--max-tokens"), (BF, ["--seq-len", "4"], "--seq-len"),
    (BF, ["--rows-per-call", "0"], "--rows-per-call"), (BF, ["--chunk-tokens", "0"], "--chunk-tokens"),
    (BF, ["--seed", "-1"], "--seed"), (BF, ["--limit", "0"], "--limit"), (BF, ["--seq-len", "100000"], "--seq-len"),
    (BF, ["--mesh", "data=2", "--rows-per-call", "3"], "does not split"), (BF, ["--mesh", "data=0"], "--mesh"),
    (("build_features", ["--model", M, "--data", D, "--output", M + "/f"]), [], "inside the --model"),
    (("build_features", ["--model", M, "--data", D, "--output", "{w}/afile"]), [], "is a file"),
    (("build_features", ["--model", M, "--data", "{w}/empty", "--output", "{w}/f"]), [], "not a saved dataset"),
    (PL, ["--remat", "all"], "--remat"), (PL, ["--attention", "flash"], "--attention"),
    (PL, ["--loss-chunk", "-1"], "--loss-chunk"), (PL, ["--optimizer-dtype", "int8"], "--optimizer-dtype"),
    (PL, ["--batch", "0"], "--batch"), (PL, ["--batch", str(10**12)], "--batch"), (PL, ["--seq", "0"], "--seq"),
    (PL, ["--seq", "100000"], "--seq"), (PL, ["--cache", str(10**9)], "--cache"), (PL, ["--headroom", "1"], "--headroom"),
    (PL, ["--headroom", "nan"], "--headroom"), (PL, ["--heads", "0"], "--heads"), (PL, ["--mesh", "data=0"], "--mesh"),
    (PL, ["--job", "bogus"], "--job"), (PL, ["--device", "bogus"], "bogus"),
    (("plan", ["--model", "{w}/nope"]), [], "--model"), (("plan", ["table", "--out", "{w}/afile"]), [], "is a file"),
    (("plan", ["table", "--out", "{w}/x", "--headroom", "-1"]), [], "--headroom"),
    (BM, ["--questions", "0"], "--questions"), (BM, ["--temperatures", "0"], "--temperatures"),
    (BM, ["--temperatures", "nan"], "--temperatures"), (BM, ["--temperatures", "x"], "--temperatures"),
    (BM, ["--max-new-tokens", "0"], "--max-new-tokens"), (BM, ["--batch-size", "0"], "--batch-size"),
    (BM, ["--batched-sizes", "0"], "--batched-sizes"), (BM, ["--hf-threads", "-1"], "--hf-threads"),
    (BM, ["--seed", "-1"], "--seed"), (BM, ["--out", M], "is the --model folder"), (BM, ["--out", "{w}/afile"], "is a file"),
    (BM, ["--question-file", "{w}/nope.jsonl"], "--question-file"),
    (("benchmark", ["quick", "--batch-sizes", "5"]), [], "--batch-sizes"),
    (("benchmark", ["quick", "--repeats", "0"]), [], "--repeats"),
    (("benchmark", ["teacher-mass", "--model", M, "--data", D, "--heldout-fraction", "0"]), [], "--heldout-fraction"),
    (("benchmark", ["teacher-mass", "--model", M, "--data", D, "--sizes", "0"]), [], "--sizes"),
    (("benchmark", ["heads", "--heads", "nolabel"]), [], "LABEL=FOLDER"),
    (("benchmark", ["heads", "--heads", "a=" + H, "--questions", "0"]), [], "--questions"),
    (("benchmark", ["heads", "--heads", "a=" + H, "--out", H]), [], "is the --heads folder"),
    (("benchmark", ["heads", "--heads", "a=" + H, "--chains", "0"]), [], "--chains"),
    (("benchmark", ["calibration", "--model", M, "--heads", H]), [], "--out"),
    (("benchmark", ["calibration", "--model", M, "--heads", H, "--out", "{w}/c", "--questions", "0"]), [], "--questions"),
    (("benchmark", ["calibration", "--model", M, "--heads", H, "--out", "{w}/c", "--batch-sizes", "0"]), [],
     "--batch-sizes"),
    (("benchmark", ["calibration", "--model", M, "--heads", H, "--out", H + "/c"]), [], "inside the --heads"),
    (("benchmark", ["calibration", "--model", M, "--heads", "{w}/nope", "--out", "{w}/c"]), [], "--heads"),
    (("benchmark", ["calibration", "--model", "{w}/nope", "--heads", H, "--out", "{w}/c"]), [], "--model"),
    (BM, ["--calibration", "bogus"], "--calibration"),
    (BB, ["--prompts", "0"], "--prompts"), (BB, ["--batch-sizes", "0"], "--batch-sizes"),
    (BB, ["--max-new-tokens", "0"], "--max-new-tokens"), (BB, ["--chunk-steps", "0"], "--chunk-steps"),
    (BB, ["--random-heads", "0"], "--random-heads"), (BB, ["--out", M], "is the --model folder"),
    (BB, ["--mesh", "data=3"], "needs 3 devices"), (BB, ["--question-file", "{w}/nope.jsonl"], "--question-file"),
    (("benchmark_batch", ["scaling", "--context-fraction", "1"]), [], "--context-fraction"),
    (("benchmark_batch", ["scaling", "--rounds", "0"]), [], "--rounds"),
    (("benchmark_batch", ["scaling", "--cache-sizes", "0"]), [], "--cache-sizes"),
    (("benchmark_batch", ["decode", "--bandwidth-mib", "0"]), [], "--bandwidth-mib"),
    (("benchmark_batch", ["decode", "--torch-threads", "0"]), [], "--torch-threads"),
    (("benchmark_batch", ["gpu", "--budget-seconds", "nan"]), [], "--budget-seconds"),
    (("benchmark_batch", ["gpu", "--out", "{w}/afile"]), [], "is a file"),
    (("benchmark_loading", ["--runs", "8:data=0:sharded"]), [], "--runs"),
    (("benchmark_loading", ["--runs", "x"]), [], "--runs"),
    (("benchmark_loading", ["--runs", "2:data=4:sharded"]), [], "--runs"),
    (("benchmark_loading", ["--runs", "1::bogus"]), [], "--runs"),
    (("benchmark_loading", ["--out", "{w}/afile"]), [], "is a file"),
    (("prepare_model", ["--out", "{w}/afile"]), [], "is a file"),
    (("prepare_model", ["--out", "{w}/afile/sub"]), [], "is a file"),
    (("plot_training", ["{w}/nope.jsonl"]), [], "no such file"),
    (("plot_training", ["{w}/garbage.txt"]), [], "not JSON"),
    (("plot_training", ["{w}/log.jsonl", "--output", "{w}/log.jsonl"]), [], "is the log file"),
    (("plot_training", ["{w}/blank.jsonl"]), [], "no training records"),
    (("plot_training", ["{w}/nohead.jsonl"]), [], "head_loss"),
    (SV, ["--model", "{w}/nope"], "does not exist"), (SV, ["--model", G2], "gpt2"),
    (SV, ["--model", NT], "tokenizer"), (SV, ["--context", "1"], "--context 1: must be >= 2"),
    (SV, ["--context", "4096"], "--context 4096: the model has 512 positions"),
    (SV, ["--port", "70000"], "--port 70000"), (SV, ["--port", "x"], "--port"),
    (SV, ["--batch-size", "0"], "--batch-size 0"), (SV, ["--chunk-steps", "0"], "--chunk-steps 0"),
    (SV, ["--max-queue", "0"], "--max-queue 0"), (SV, ["--host", ""], "--host"),
    (SV, ["--host", "no.such.host.invalid"], "--host no.such.host.invalid: cannot be resolved"),
    (SV, ["--served-model-name", " "], "--served-model-name"), (SV, ["--dtype", "float16"], "--dtype"),
    (SV, ["--tree", "mc_sim_7b_8"], "--tree mc_sim_7b_8: needs --heads"), (SV, ["--heads", ""], "--heads"),
    (SV, ["--heads", H, "--tree", "no_such_preset"], "--tree"), (SV, ["--heads", "{w}/nope"], "--heads"),
    (SV, ["--attention", "cudnn"], "--attention cudnn: needs an NVIDIA GPU"), (SV, ["--attention", "flash"], "--attention"),
    (SV, ["--heads", "recycle+lookup", "--attention", "xla"], "--attention xla: a mix of drafters"),
]


def run_case(world: Path, name: str, argv: list[str], capsys) -> tuple[int, str]:
    capsys.readouterr()
    try:
        code = script(name).main(argv)
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


@pytest.fixture
def offline_hub(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("MEDUSA_JAX_CACHE", str(tmp_path / "cache"))


@pytest.mark.parametrize("command, extra, expected", CASES,
                         ids=[f"{c[0]}:{' '.join(c[1][-2:] + e)}"[:90] for c, e, _ in CASES])
def test_a_bad_input_is_one_error_line_and_changes_nothing(world, offline_hub, capsys, command, extra, expected):
    name, base = command
    argv = [a.replace("{w}", str(world)) for a in base + extra]
    before = snapshot(world)
    code, err = run_case(world, name, argv, capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err
    assert expected.replace("{w}", str(world)) in errors[0], errors[0]
    assert snapshot(world) == before, "an input or output changed"


def test_the_table_covers_every_command_and_more_than_150_inputs():
    names = {c[0][0] for c in CASES}
    assert names == {"generate", "self_distill", "train_heads", "export_heads", "build_tree", "build_features", "plan",
                     "benchmark", "benchmark_batch", "benchmark_loading", "prepare_model", "plot_training", "serve",
                     "benchmark_mixed"}
    assert len(CASES) > 150


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere: permissions cannot be tested")
def test_unwritable_outputs_are_refused(world, offline_hub, capsys, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        code, err = run_case(world, "generate", ["--model", str(world / "model"), "--prompt", "hi", "--output",
                                                 str(locked / "o.jsonl")], capsys)
        assert code == 2 and "cannot write" in err
    finally:
        locked.chmod(0o755)


@pytest.mark.parametrize("variable, value", [("MEDUSA_JAX_CALIBRATION", "sometimes"),
                                             ("MEDUSA_JAX_CALIBRATION_SECONDS", "soon"),
                                             ("MEDUSA_JAX_CALIBRATION_SECONDS", "-1")])
@pytest.mark.parametrize("command", [GEN, ("generate", ["--model", M, "--prompt", "hi", "--heads", "lookup"]),
                                     BX, SV], ids=lambda c: " ".join(c[1][-2:]) if isinstance(c, tuple) else c)
def test_a_bad_calibration_variable_stops_the_command_before_the_model_loads(world, offline_hub, capsys, monkeypatch,
                                                                            command, variable, value):
    """The calibration's environment is read late (on the first drafted step of a mix), so every command checks
    it with its flags: one line naming the variable, where a model load would otherwise come first."""
    monkeypatch.setenv(variable, value)
    name, base = command
    code, err = run_case(world, name, [a.replace("{w}", str(world)) for a in base], capsys)
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err
    assert errors[0].startswith(f"error: ${variable} must be") and repr(value) in errors[0], errors[0]
