"""The generation engine and medusa-serve on a device mesh (`--mesh`, inference/engine_mesh.py): on 8 forced CPU
devices, greedy answers equal one device's, plain, with Medusa heads, with Token Recycling's shared table and with
a mix (heads + recycling + lookup); a mesh that does not split the rows,
or needs more devices than there are, is refused. The JAX work runs in subprocesses (the device count is fixed
before JAX starts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from test_serve import (MODEL, decode_tokens, free_port, reference, running_server,  # noqa: F401
                        tiny_with_tokenizer)
from test_sharded_decode import SHARDABLE

WORKER = Path(__file__).with_name("engine_mesh_worker.py")
EIGHT_DEVICES = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") +
                                                       " --xla_force_host_platform_device_count=8").strip()}


def test_engine_on_meshes_equals_one_device(tiny_model_dir, tmp_path):
    folder = tiny_model_dir("llama", **SHARDABLE)
    out = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, str(WORKER), str(folder), str(out)], capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(out.read_text())
    plain = report["one/plain"]
    assert len(plain) == 6 and all(len(tokens) == 12 for tokens in plain)
    for method in ("plain", "medusa", "recycle", "mix"):  # every drafter's greedy tokens on a mesh are plain's on
        assert report[f"2,2/{method}"] == plain and report[f"4,1/{method}"] == plain  # one device
    assert "3 decode rows do not split" in report["indivisible"]


def test_serve_with_a_mesh_answers_as_one_device(tiny_with_tokenizer, reference):  # noqa: F811
    """medusa-serve --mesh data=2,tensor=2 in a subprocess: the official client's greedy answers, whole and
    streamed, several at once, equal `generate`'s on one device."""
    tokenizer, greedy = reference
    args = ["--model", str(tiny_with_tokenizer), "--batch-size", "4", "--context", "64", "--chunk-steps", "4",
            "--mesh", "data=2,tensor=2"]
    with running_server(args, EIGHT_DEVICES, wait=600) as (base, _):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)
        prompts = [f"w{i} w{2 * i} w{3 * i}" for i in (1, 4, 7, 9, 11)]
        for prompt in prompts:
            want = decode_tokens(tokenizer, greedy(tokenizer(prompt)["input_ids"], 10))
            whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0)
            assert whole.choices[0].text == want
            pieces = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0,
                                               stream=True)
            assert "".join(c.choices[0].text for c in pieces) == want


def test_serve_refuses_a_mesh_beyond_the_devices(tiny_with_tokenizer, capsys):  # noqa: F811
    from test_serve import load_script

    serve = load_script("serve")
    with pytest.raises(SystemExit) as exit_:
        serve.main(["--model", str(tiny_with_tokenizer), "--mesh", "data=64", "--port", str(free_port())])
    assert exit_.value.code == 2 and "--mesh data=64: needs 64 devices" in capsys.readouterr().err
