"""Sharded decoding on 8 forced CPU devices equals one device, token for token (plain and Medusa greedy, Medusa
and Hydra heads on a dynamic tree, and Medusa exact sampling for one seed);
clear mesh errors; batch API order; 2-process (multi-host) decoding over gloo CPU collectives.

The JAX work runs in subprocesses (tests/sharded_worker.py), because the device count must be fixed before
JAX starts. One subprocess covers every mesh, so compilation dominates the runtime (about a minute).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from medusa_jax.training.hlo_collectives import invariant_gathers, loop_collectives
from medusa_jax.heads.config import HeadsConfig
from medusa_jax.heads.init import init_heads
from medusa_jax.heads.folder import save_heads
from medusa_jax.hf.load import load_pretrained
from medusa_jax.text import encode_prompt, load_tokenizer
from medusa_jax.inference.api import generate
from medusa_jax.scripts.distributed import DistributedConfig, DistributedError

WORKER = Path(__file__).with_name("sharded_worker.py")
# 8 attention heads and 8 KV heads, MLP 128 and vocabulary 128: every tensor axis size up to 8 divides them
SHARDABLE = dict(num_attention_heads=8, num_key_value_heads=8)


def run_worker(*args: str, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(WORKER), *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def mesh_report(tiny_model_dir, tmp_path_factory):
    folder = tiny_model_dir("llama", **SHARDABLE)
    out = tmp_path_factory.mktemp("sharded") / "report.json"
    proc = run_worker("meshes", str(folder), str(out))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return folder, json.loads(out.read_text())


@pytest.mark.parametrize("mesh", ["8,1", "2,4", "1,8"])
def test_sharded_plain_and_medusa_equal_one_device(mesh_report, mesh):
    _, report = mesh_report
    ref, got = report["reference"], report["meshes"][mesh]
    assert [r["tokens"] for r in got["plain"]] == [r["tokens"] for r in ref["plain"]]
    assert [r["tokens"] for r in got["medusa"]] == [r["tokens"] for r in ref["medusa"]]
    assert [r["steps"] for r in got["medusa"]] == [r["steps"] for r in ref["medusa"]]
    assert [r["accepts"] for r in got["medusa"]] == [r["accepts"] for r in ref["medusa"]]
    if mesh == "2,4":
        assert {"hydra", "eagle", "eagle3", "medusa_dynamic", "hydra_dynamic"} <= set(got)
    # Hydra heads, the EAGLE-1 and EAGLE-3 drafters and dynamic trees: lossless and the same steps on data=2 x tensor=4
    for name in ("hydra", "eagle", "eagle3", "medusa_dynamic", "hydra_dynamic"):
        if name in got:
            assert [r["tokens"] for r in got[name]] == [r["tokens"] for r in ref[name]] == \
                [r["tokens"] for r in ref["plain"]], name
            assert [r["accepts"] for r in got[name]] == [r["accepts"] for r in ref[name]], name


def test_reference_exercises_eos_and_acceptance(mesh_report):
    _, report = mesh_report
    ref = report["reference"]
    lengths = [len(r["tokens"]) for r in ref["plain"]]
    assert min(lengths) < max(lengths), "the chosen EOS should end some rows early"
    assert any(sum(r["accepts"]) > 0 for r in ref["medusa"]), "some verify step should accept candidates"


def test_exact_sampling_on_a_mesh_equals_one_device(mesh_report):
    """Exact acceptance (T 0.7, top-k 40) on data=2 x tensor=4 draws what one device draws for the seed."""
    _, report = mesh_report
    ref = report["reference"]
    assert report["meshes"]["2,4"]["exact"] == ref["exact"]
    assert ref["exact"] != [r["tokens"] for r in ref["medusa"]]  # it sampled, not decoded greedily


def test_layouts_are_sharded(mesh_report):
    _, report = mesh_report
    assert report["meshes"]["1,8"]["q_proj_shards"] == 8
    assert report["meshes"]["2,4"]["k_sharding"] == [["data", "fsdp"], "tensor", None, None]


@pytest.mark.parametrize("mesh", ["2,4", "1,8"])
def test_decode_loop_moves_activations_not_weights(mesh_report, mesh):
    got = mesh_report[1]["meshes"][mesh]
    for name in ("plain", "medusa"):
        assert got[f"{name}_invariant_gathers"] == [], f"{name}: weights all-gathered inside the decode loop"
        assert "all-reduce" in got[f"{name}_loop_ops"], f"{name}: tensor parallelism should all-reduce activations"


def test_mesh_errors_name_the_axis(mesh_report):
    errors = mesh_report[1]["errors"]
    assert "'tensor'" in errors["tensor3"] and "num_heads (8)" in errors["tensor3"]
    assert "'fsdp'" in errors["fsdp3"] and "hidden_size (64)" in errors["fsdp3"]


def test_a_batch_that_does_not_divide_the_mesh_is_padded(mesh_report):
    padded = mesh_report[1]["padded"]
    assert padded["batch6_data4"] == padded["expected6"]  # 6 rows on data=4: padded to 8, fillers dropped
    assert padded["one_plain"] == padded["expected_plain"]  # one prompt on data=2 x tensor=4
    assert padded["one_medusa"] == padded["expected_medusa"]


def test_batch_api_returns_input_order(mesh_report):
    order = mesh_report[1]["order"]
    assert order["indices"] == list(range(11))
    assert order["prompt_tokens"] == order["lengths"]
    assert order["tokens"] == order["expected"]
    assert order["num_batches"] == 3
    # longest prompts go first: batch numbers fall as prompt length rises
    by_length = sorted(range(11), key=lambda i: (-order["lengths"][i], i))
    assert [order["batches"][i] for i in by_length] == sorted(order["batches"])


def test_two_processes_match_one(mesh_report, tmp_path):
    folder, report = mesh_report
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    procs = []
    for pid in range(2):
        env = {"JAX_COORDINATOR_ADDRESS": f"localhost:{port}", "JAX_NUM_PROCESSES": "2",
               "JAX_PROCESS_ID": str(pid), "SHARDED_TEST_EOS": json.dumps(report["eos"])}
        procs.append(subprocess.Popen([sys.executable, str(WORKER), "multihost", str(folder),
                                       str(tmp_path / f"p{pid}.json")], env={**os.environ, **env},
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-4000:]
    ref = report["reference"]
    for pid in range(2):
        got = json.loads((tmp_path / f"p{pid}.json").read_text())
        assert (got["process_index"], got["process_count"], got["device_count"], got["local_devices"]) == (pid, 2, 8, 4)
        assert [r["tokens"] for r in got["plain"]] == [r["tokens"] for r in ref["plain"]]
        assert [r["tokens"] for r in got["medusa"]] == [r["tokens"] for r in ref["medusa"]]


def with_word_tokenizer(folder: Path, dst: Path) -> Path:
    """A copy of the model folder plus a word-level tokenizer (w0 .. w99 -> ids 3 .. 102, EOS </s> = 2)."""
    import transformers

    shutil.copytree(folder, dst)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(100)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>",
                                         eos_token="</s>", pad_token="<unk>").save_pretrained(dst)
    return dst


def test_generate_script_on_a_mesh_with_medusa_heads(mesh_report, tmp_path):
    model_dir = with_word_tokenizer(mesh_report[0], tmp_path / "model")
    base = load_pretrained(model_dir)
    save_heads(init_heads(HeadsConfig(64, 128, num_heads=3), base, seed=1), tmp_path / "heads")
    prompts = ["w5 w6", "w7 w8 w9 w10 w11 w12 w13 w14 w15", "w14", "w1 w2 w3 w4"]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"prompt": p, "id": f"q{i}"}) + "\n" for i, p in enumerate(prompts)))
    dst = tmp_path / "out.jsonl"
    proc = subprocess.run(
        [sys.executable, str(WORKER.parents[1] / "scripts" / "generate.py"), "--model", str(model_dir),
         "--input", str(src), "--output", str(dst), "--batch-size", "2", "--max-new-tokens", "10",
         "--heads", str(tmp_path / "heads"), "--tree", "mc_sim_7b_8", "--mesh", "data=2,tensor=2"],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") +
                                                                 " --xla_force_host_platform_device_count=4").strip()})
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "'data': 2" in proc.stdout and "wrote" in proc.stdout
    rows = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["q0", "q1", "q2", "q3"] and [r["prompt"] for r in rows] == prompts
    tok = load_tokenizer(model_dir)
    expected = generate(base, [encode_prompt(tok, p, chat=False) for p in prompts], max_new_tokens=10, eos_ids=(2,))
    assert [r["token_ids"] for r in rows] == [e.token_ids for e in expected]  # greedy Medusa == plain greedy
    assert all(len(r["accept_lengths"]) == r["steps"] - 1 and r["finish_reason"] in ("eos", "length") for r in rows)


def test_distributed_config_sources():
    env = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"}
    cfg = DistributedConfig.from_sources(environ=env)
    assert (cfg.coordinator_address, cfg.num_processes, cfg.process_id, cfg.enabled) == ("10.0.0.1:1234", 2, 1, True)
    assert DistributedConfig.from_sources(process_id=0, environ=env).process_id == 0  # flags win
    assert not DistributedConfig.from_sources(environ={}).enabled
    with pytest.raises(DistributedError, match="needs all of"):
        DistributedConfig.from_sources(coordinator="h:1", environ={})
    with pytest.raises(DistributedError, match="process_id must be in"):
        DistributedConfig.from_sources("h:1", 2, 2, environ={})


HLO_WITH_WEIGHT_GATHER = """
%body (p: (s32[], f32[4,8], f32[2,8])) -> (s32[], f32[4,8], f32[2,8]) {
  %p = (s32[], f32[4,8], f32[2,8]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[4,8] get-tuple-element(%p), index=1
  %w = f32[2,8] get-tuple-element(%p), index=2
  %w.copy = f32[2,8] copy(%w)
  %all-gather.1 = f32[8,8] all-gather(%w.copy), replica_groups={{0,1,2,3}}, dimensions={0}
  %all-gather.2 = f32[16,8] all-gather(%x), replica_groups={{0,1,2,3}}, dimensions={0}
  %y = f32[4,8] dot(%x, %all-gather.1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %all-reduce.3 = f32[4,8] all-reduce(%y), replica_groups={{0,1,2,3}}, to_apply=%add
  ROOT %t = (s32[], f32[4,8], f32[2,8]) tuple(%i, %all-reduce.3, %w)
}

ENTRY %main (a: (s32[], f32[4,8], f32[2,8])) -> (s32[], f32[4,8], f32[2,8]) {
  %a = (s32[], f32[4,8], f32[2,8]) parameter(0)
  ROOT %while.1 = (s32[], f32[4,8], f32[2,8]) while(%a), condition=%cond, body=%body
}
"""


def test_hlo_scan_finds_weight_gathers_only():
    ops = sorted((c.op, c.dims) for c in loop_collectives(HLO_WITH_WEIGHT_GATHER))
    assert ops == [("all-gather", (8, 8)), ("all-gather", (16, 8)), ("all-reduce", (4, 8))]
    # %w is passed through unchanged (a weight); %x changes every iteration (an activation)
    assert [c.dims for c in invariant_gathers(HLO_WITH_WEIGHT_GATHER)] == [(8, 8)]
