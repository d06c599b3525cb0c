"""Token Recycling under a device mesh (8 forced CPU devices, in a subprocess: tests/recycle_mesh_worker.py):
the table update on sharded rows and logits equals one device's on every device, and greedy decoding on the
(8, 1) and (2, 4) meshes gives one device's tokens, steps, accept lengths and final tables, call after call, and a
call after `ShardedModel.restore_draft` repeats the first."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("recycle_mesh_worker.py")
SHARDABLE = dict(num_attention_heads=8, num_key_value_heads=8)  # every tensor axis size up to 8 divides them


@pytest.fixture(scope="module")
def report(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("recycle-mesh") / "report.json"
    proc = subprocess.run([sys.executable, str(WORKER), str(tiny_model_dir("llama", **SHARDABLE)), str(out)],
                          capture_output=True, text=True, timeout=900, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("mesh", ["8,1", "2,4"])
def test_the_table_update_on_a_mesh_equals_one_device_on_every_device(report, mesh):
    assert report["update"][mesh] == {"equal": True, "every_device": True}


@pytest.mark.parametrize("mesh", ["8,1", "2,4"])
def test_recycling_on_a_mesh_equals_one_device_call_after_call(report, mesh):
    one, got = report["decode"]["1,1"], report["decode"][mesh]
    assert [c["tokens"] for c in one] == [report["plain"]] * 2  # lossless, fresh and warm
    assert any(len(t) < 24 for t in report["plain"])  # the EOS ends a row mid-way
    for call_one, call_mesh in zip(one, got):
        assert call_mesh["tokens"] == call_one["tokens"]
        assert call_mesh["steps"] == call_one["steps"] and call_mesh["accepts"] == call_one["accepts"]
        assert call_mesh["table"] == call_one["table"]  # the same table after each call
        assert call_mesh["table_replicated"]  # one table on every device
    assert one[0]["table"] != one[1]["table"] and one[0]["accepts"] != one[1]["accepts"]  # the 2nd call starts warm


@pytest.mark.parametrize("mesh", ["1,1", "8,1", "2,4"])
def test_a_restored_snapshot_decodes_as_the_first_call_on_every_mesh(report, mesh):
    """`draft_snapshot` before the first call, `restore_draft` after the second: the third call is the first."""
    assert report["restored"][mesh] == report["decode"][mesh][0]
