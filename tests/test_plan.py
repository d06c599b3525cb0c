"""Memory plans (medusa_jax.training.plan): compiled on abstract inputs over 8 forced CPU devices, they match the real
Trainer's device buffers and the analytic estimate; the Llama-3-8B plans compile without allocating weights.

The JAX work runs in subprocesses (tests/plan_worker.py, scripts/plan.py): the device count is fixed before JAX
starts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from medusa_jax.training.hlo_collectives import (entry_upcast_bytes, executed_collectives, loop_upcast_bytes,
                                                 shape_bytes)
from medusa_jax.training.plan import PRESETS, device_capacity, model_config
from medusa_jax.training.memory_plan import backbone_params
from medusa_jax.training.plan_report import markdown_table, table_rows
from medusa_jax.scripts import plan

ROOT = Path(__file__).parents[1]
WORKER = Path(__file__).with_name("plan_worker.py")
# The analytic total is a working-set model (no liveness analysis): it must be within this factor of XLA's.
# Parameters, optimiser state and KV cache are exact (up to Adam's step counters and padding).
TOTAL_FACTOR = 1.5
EXACT_SLACK = 64  # bytes


def run_worker(mode: str, out: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if mode == "small" and "--xla_cpu_use_fusion_emitters" not in env.get("XLA_FLAGS", ""):
        # the scaled-down model compiles ~20% faster with XLA:CPU's legacy fusion emitters (27.5 -> 22.4 s) and
        # XLA's memory figures move by < 1% (the assertions allow 1.5x); the 8B plans keep the default emitters
        # (tests/conftest.py), which compile large programs faster
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_cpu_use_fusion_emitters=false").strip()
    proc = subprocess.run([sys.executable, str(WORKER), mode, str(out)], capture_output=True, text=True,
                          timeout=1800, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return run_worker("small", tmp_path_factory.mktemp("plan") / "small.json")


@pytest.mark.parametrize("case", ["train_m1", "train_m2", "train_m2_lean"])
def test_plan_state_equals_the_real_trainer_on_device(small, case):
    plan = small[case]["plan"]
    assert plan["arguments"]["params"] + plan["arguments"]["optimizer"] == small[case]["real_state_bytes"]
    assert plan["replicated_optimizer_bytes"] == 0


@pytest.mark.parametrize("case", ["train_m1", "train_m2", "train_m2_lean", "decode", "decode_stacked"])
def test_analytic_estimate_agrees(small, case):
    plan, est = small[case]["plan"], small[case]["estimate"]
    for name in ("params", "optimizer", "kv_cache"):
        assert abs(plan["arguments"][name] - est[name]) <= EXACT_SLACK, (name, plan["arguments"], est)
    # XLA counts only the arguments the program reads (Medusa-1 never reads the base lm_head)
    assert 0.9 * sum(plan["arguments"].values()) <= plan["argument_bytes"] <= sum(plan["arguments"].values())
    ratio = est["total"] / plan["device_bytes"]
    assert 1 / TOTAL_FACTOR <= ratio <= TOTAL_FACTOR, (ratio, est, plan["device_bytes"])


def test_medusa2_trains_the_backbone(small):
    m1, m2 = small["train_m1"]["plan"]["arguments"], small["train_m2"]["plan"]["arguments"]
    assert m2["optimizer"] > 2 * m1["optimizer"]  # Adam moments now cover the backbone too
    assert abs(m2["optimizer"] - 2 * m2["params"]) <= EXACT_SLACK  # every parameter is trainable, same dtype


def test_decode_plan_layout(small):
    plan = small["decode"]["plan"]
    cfg = plan["config"]["model"]
    full_cache = 2 * cfg["num_layers"] * 8 * 256 * cfg["num_kv_heads"] * cfg["head_dim"] * 4
    assert plan["arguments"]["kv_cache"] - 8 * 4 // 2 == full_cache // 8  # rows over data=2, KV heads over tensor=4
    assert plan["invariant_gathers"] == []
    kinds = {c["kind"] for c in plan["collectives"]}
    assert "all-reduce" in kinds and plan["alias_bytes"] >= full_cache // 8  # the cache is donated


def test_stacked_decode_plan_moves_what_the_per_layer_one_does(small):
    """--scan-layers: the stacked model over a stacked KV cache holds the same cache, donates it, gathers no weight
    in the loop, and runs the per-layer form's collectives (a scan body's counted once per layer), within 5% of its
    bytes per device."""
    stacked, per_layer = small["decode_stacked"]["plan"], small["decode"]["plan"]
    assert stacked["config"]["layers"]["scan"] and not per_layer["config"]["layers"]["scan"]
    assert stacked["arguments"] == per_layer["arguments"]
    assert stacked["alias_bytes"] >= stacked["arguments"]["kv_cache"] - 64 and stacked["invariant_gathers"] == []
    for name in ("collectives", "once_collectives"):
        assert stacked[name] == per_layer[name], name
    assert abs(stacked["device_bytes"] / per_layer["device_bytes"] - 1) < 0.05


def test_largest_batch_search_brackets_the_boundary(small):
    search = small["search"]
    plans = {int(b): n for b, n in search["plans"].items()}
    best, step = search["best"], search["step"]
    assert plans[best] <= search["capacity"] < plans[best + step]
    assert len(plans) <= 6
    batches = sorted(plans)
    assert all(plans[a] < plans[b] for a, b in zip(batches, batches[1:]))


@pytest.mark.slow
def test_llama3_8b_plans_compile_without_weights(tmp_path):
    report = run_worker("llama8b", tmp_path / "llama8b.json")
    train, decode = report["train"], report["decode"]
    cfg = model_config("llama3-8b")
    # fp32 frozen backbone over fsdp=4 (data=2 replicates), plus 4 own lm_heads and their Adam moments
    assert abs(train["plan"]["arguments"]["params"] - train["estimate"]["params"]) <= EXACT_SLACK
    assert train["plan"]["arguments"]["params"] > backbone_params(cfg, 4, 1) * 4
    # only the heads' bias moments ([D] over `tensor`, here of size 1) are whole on every device
    assert train["plan"]["replicated_optimizer_bytes"] <= 0.001 * train["plan"]["arguments"]["optimizer"]
    assert decode["plan"]["invariant_gathers"] == []
    assert abs(decode["plan"]["arguments"]["kv_cache"] - decode["estimate"]["kv_cache"]) <= EXACT_SLACK
    # the CPU compiler's float32 copies of the bf16 weights are found and set apart
    upcast, params = decode["plan"]["cpu_upcast_bytes"], decode["plan"]["arguments"]["params"]
    assert 1.9 * params <= upcast <= 2.2 * params  # (a few weights are converted in two layouts)
    # no weights allocated: the 8B weights alone are 32 GB in float32, 8 GB per fsdp shard on each of the 8
    # devices; what the process holds is XLA's compiler (0.8-5.3 GiB seen, depending on the machine's load)
    assert report["max_rss_bytes"] < 8 * 2**30


def test_cli_plans_a_config_folder_as_json(tmp_path):
    hf = {**PRESETS["llama3-8b"], "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2}
    (tmp_path / "config.json").write_text(json.dumps(hf))  # a config alone: planning needs no weights
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "plan.py"), "--model", str(tmp_path), "--mesh",
                           "data=2,tensor=2", "--job", "decode", "--batch", "4", "--seq", "16", "--cache", "96",
                           "--tree", "mc_sim_7b_16", "--device", "1000000000", "--json"],
                          capture_output=True, text=True, timeout=900, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["fits"] is True and out["config"]["mesh"] == {"data": 2, "fsdp": 1, "tensor": 2}
    assert out["arguments"]["kv_cache"] == out["analytic"]["kv_cache"] + 4 * 4 // 2  # + the lengths, [B] int32
    assert out["device_bytes"] > out["arguments"]["params"] > 0


@pytest.mark.parametrize("args, message", [
    (["--model", "llama3-8b", "--mesh", "data=2,pipe=2"], "bad mesh spec"),
    (["--model", "llama9-1b"], "neither a preset"),
    (["--model", "llama3-8b", "--device", "a100"], "unknown device"),
    (["--model", "llama3-8b", "--mesh", "data=2", "--batch", "3"], "not divisible"),
    (["--model", "llama3-8b", "--seq", "1024", "--cache", "1024"], "leaves no room"),
    (["--model", "llama3-8b", "--scan-layers", "--remat", "full"], "a decode plan takes only --scan-layers and --attention"),
])
def test_cli_bad_input_is_one_clear_error(args, message, monkeypatch, capsys):
    code, err = plan_cli_in_process(args, monkeypatch, capsys)
    assert code == 2 and err.startswith("error:") and message in err, err


def plan_cli_in_process(args, monkeypatch, capsys) -> tuple[int, str]:
    """scripts/plan.py's main in this process (no JAX start-up per case): (exit status, stderr). Bad input must
    be refused before the script forces host devices (which needs a fresh process), so forcing them fails here.
    (The tests above and below run the script itself, as a subprocess.)"""
    def no_devices(count):
        raise AssertionError(f"plan.py forced {count} host devices: the input was not refused first")

    monkeypatch.setattr(plan, "force_host_devices", no_devices)
    capsys.readouterr()
    try:
        code = plan.main(list(args))
    except SystemExit as e:  # argparse's refusals
        code = e.code
    return code, capsys.readouterr().err


def test_cli_table_mode_from_lower_bounds_only(tmp_path, monkeypatch, capsys):
    """`plan.py table --saved-only` compiles nothing: the rows whose exact lower bound exceeds every device say
    no, the rest are 'not planned'; a bad preset is one clear error."""
    run = lambda *args: subprocess.run([sys.executable, str(ROOT / "scripts" / "plan.py"), "table", *args],
                                       capture_output=True, text=True, timeout=300,
                                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    proc = run("--out", str(tmp_path), "--models", "llama3-70b", "--saved-only")
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = (tmp_path / "table.md").read_text()
    assert table.startswith("| model | job | 8x H100-80G | 8x H200-141G | TPU v5e-16 (16 x 16 GB) |")
    assert ": **no**" in table and "not planned" in table and "fits" not in table
    saved = json.loads((tmp_path / "plans.json").read_text())
    assert saved and all(entry["arguments_only"] for entry in saved.values())
    code, err = plan_cli_in_process(["table", "--out", str(tmp_path), "--models", "llama9-1b"], monkeypatch, capsys)
    assert code == 2 and err.startswith("error: unknown presets")


def test_cli_vs_device_needs_an_accelerator():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "plan.py"), "vs-device"], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 2 and proc.stderr.startswith("error: cpu device reports no peak memory"), proc.stderr


def test_hlo_helpers():
    assert shape_bytes("bf16[8,64]{1,0}") == 8 * 64 * 2
    assert shape_bytes("(f32[4]{0}, s32[2,2]{1,0})") == 16 + 16
    hlo = """
%wrapped_convert_computation.1 (param_0: bf16[4,8]) -> f32[4,8] {
  %param_0 = bf16[4,8]{1,0} parameter(0)
  ROOT %convert.1 = f32[4,8]{1,0} convert(%param_0)
}

ENTRY %main.5_spmd (param.1: bf16[4,8], param.2: f32[2]) -> f32[4,8] {
  %param.1 = bf16[4,8]{1,0} parameter(0)
  %param.2 = f32[2]{0} parameter(1)
  %wrapped_convert.1 = f32[4,8]{1,0} fusion(%param.1), kind=kLoop, calls=%wrapped_convert_computation.1
  ROOT %negate.1 = f32[4,8]{1,0} negate(%wrapped_convert.1)
}
"""
    assert entry_upcast_bytes(hlo) == 4 * 8 * 4


LOOPS_HLO = """
%wrapped_convert_computation.2 (param_0: bf16[3,4,8]) -> f32[3,4,8] {
  %param_0 = bf16[3,4,8]{2,1,0} parameter(0)
  ROOT %convert.2 = f32[3,4,8]{2,1,0} convert(%param_0)
}

%scan_body.1 (p.3: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %p.3 = (s32[], f32[4,8]{1,0}) parameter(0)
  %x.1 = f32[4,8]{1,0} get-tuple-element(%p.3), index=1
  %ar.1 = f32[4,8]{1,0} all-reduce(%x.1), channel_id=1, replica_groups={{0,1}}, to_apply=%add.1
  ROOT %t.1 = (s32[], f32[4,8]{1,0}) tuple(%ar.1, %ar.1)
}

%decode_body.1 (p.4: (s32[], f32[4,8], bf16[3,4,8])) -> (s32[], f32[4,8], bf16[3,4,8]) {
  %p.4 = (s32[], f32[4,8]{1,0}, bf16[3,4,8]{2,1,0}) parameter(0)
  %w.1 = bf16[3,4,8]{2,1,0} get-tuple-element(%p.4), index=2
  %wrapped_convert.2 = f32[3,4,8]{2,1,0} fusion(%w.1), kind=kLoop, calls=%wrapped_convert_computation.2
  %ag.1 = f32[4,8]{1,0} all-gather(%x.2), channel_id=2, replica_groups={{0,1}}, dimensions={0}
  %while.2 = (s32[], f32[4,8]{1,0}) while(%init.2), condition=%scan_cond.1, body=%scan_body.1, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %t.2 = (s32[], f32[4,8]{1,0}, bf16[3,4,8]{2,1,0}) tuple(%p.4, %p.4, %w.1)
}

%branch_a.1 (p.6: f32[4,8]) -> f32[4,8] {
  %p.6 = f32[4,8]{1,0} parameter(0)
  ROOT %ar.2 = f32[4,8]{1,0} all-reduce(%p.6), channel_id=3, replica_groups={{0,1}}, to_apply=%add.1
}

%branch_b.1 (p.7: f32[4,8]) -> f32[4,8] {
  %p.7 = f32[4,8]{1,0} parameter(0)
  %ar.3 = f32[4,8]{1,0} all-reduce(%p.7), channel_id=4, replica_groups={{0,1}}, to_apply=%add.1
  ROOT %ar.4 = f32[4,8]{1,0} all-reduce(%ar.3), channel_id=5, replica_groups={{0,1}}, to_apply=%add.1
}

ENTRY %main.9_spmd (param.5: bf16[3,4,8]) -> f32[4,8] {
  %param.5 = bf16[3,4,8]{2,1,0} parameter(0)
  %c.1 = f32[4,8]{1,0} conditional(%i.1, %x.3, %x.3), branch_computations={%branch_a.1, %branch_b.1}
  %while.1 = (s32[], f32[4,8]{1,0}) while(%init.1), condition=%cond.1, body=%scan_body.1, backend_config={"known_trip_count":{"n":"2"}}
  %while.3 = (s32[], f32[4,8]{1,0}, bf16[3,4,8]) while(%init.3), condition=%cond.2, body=%decode_body.1
  ROOT %r.1 = f32[4,8]{1,0} get-tuple-element(%while.3), index=1
}
"""


def test_collectives_as_run_and_upcasts_inside_loops():
    """A scan (known trip count) repeats its body's collectives per iteration: 2 all-reduces of a prefill's scan
    run once per call, 3 of the decode step's scan per step; a conditional runs one branch (the one with the most
    counts: 2 of its 1 and 2); a bf16 weight stack converted to float32 inside the decode loop's body is a CPU-only
    copy, set apart from the entry's."""
    step, once = executed_collectives(LOOPS_HLO)
    assert sorted(c.op for c in step) == ["all-gather"] + ["all-reduce"] * 3
    assert [c.op for c in once] == ["all-reduce"] * 4
    assert entry_upcast_bytes(LOOPS_HLO) == 0
    assert loop_upcast_bytes(LOOPS_HLO) == 3 * 4 * 8 * 4


def test_presets_and_devices():
    cfg = model_config("llama3-8b")
    assert round(backbone_params(cfg, 1, 1) / 1e9, 2) == 8.03  # Meta's published 8.03B parameters
    assert round(backbone_params(model_config("llama3-70b"), 1, 1) / 1e9, 1) == 70.6
    assert device_capacity("tpu-v5e-16g") == ("tpu-v5e-16g", 16 * 2**30)
    assert device_capacity("123") == ("123 bytes", 123)


def test_markdown_table_verdicts():
    row = table_rows(("llama3-8b",))[0]
    small = SimpleNamespace(device_bytes=50 * 2**30, analytic_bytes=40 * 2**30)
    bound = SimpleNamespace(device_bytes=200 * 2**30, analytic_bytes=0, arguments_only=True)
    table = markdown_table([(row, {"gpu": small, "v5e": bound}), (row, {"gpu": bound})],
                           {"A": ("gpu", 55 * 2**30), "B": ("gpu", 80 * 2**30), "C": ("v5e", 16 * 2**30),
                            "D": ("gpu", 300 * 2**30)}, 0.1)
    cells = table.splitlines()[2].split(" | ")[2:]
    # 50 GiB is over 90% of 55 GiB, under 90% of 80 GiB; the lower bound of 200 GiB rules out 16 GiB
    assert cells[0].endswith("**no**") and cells[1].endswith("fits") and cells[2].startswith("> 200")
    # ... but cannot prove that 300 GiB suffice
    assert table.splitlines()[3].rstrip(" |").endswith("not planned")


def test_cli_vs_device_train_puts_the_plan_beside_the_device_figures(tmp_path, monkeypatch, capsys):
    """`vs-device --job train` plans the step (a subprocess on forced CPU devices) and prints it beside what the
    accelerator measured; the accelerator is faked here (measure_train_step runs on a GPU or TPU only)."""
    hf = {**PRESETS["llama3-8b"], "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    (tmp_path / "config.json").write_text(json.dumps(hf))

    class FakeAccelerator:
        platform, device_kind = "gpu", "fake GPU"

        def memory_stats(self):
            return {"peak_bytes_in_use": 1, "bytes_in_use": 1}

    measured = {}
    monkeypatch.setattr(plan, "jax", SimpleNamespace(devices=lambda *a: [FakeAccelerator()]))
    monkeypatch.setattr(plan, "measure_train_step",
                        lambda config: measured.setdefault("config", config) and {"state": 2**20, "peak": 2**24,
                                                                                  "compiled": 2**23})
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    code = plan.main(["vs-device", "--job", "train", "--model", str(tmp_path), "--batch", "2", "--seq", "32",
                      "--medusa2", "--scan-layers", "--remat", "full", "--dtype", "float32", "--loss-chunk", "16",
                      "--optimizer-dtype", "bfloat16"])
    out = capsys.readouterr().out
    assert code == 0 and "compiler's figure for the step 8.0 MiB" in out and "peak 16.0 MiB" in out
    config = measured["config"]
    assert config.medusa2 and config.layers.scan and config.layers.remat == "full" and config.model.num_layers == 2
    assert config.loss_chunk == 16 and config.optimizer_dtype == "bfloat16"
    planned = float(out.split("plan (CPU compile): total ")[1].split(" MiB")[0])
    assert f"plan / measured peak = {planned / 16:.2f}" in out
