"""FSDP under the scan over layers gathers one layer's weights at a time (issue 41): the compiled Medusa-2 train
step of a 5-layer model on fsdp=8 all-gathers each layer kernel only inside the layer loops (once in the
forward loop, once in the backward's recompute), never all layers before them as the unrolled step does; and the
sharded scanned step gives the numbers of the plain one-device step. The JAX work runs in a subprocess
(tests/scan_fsdp_worker.py): the device count is fixed before JAX starts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).parents[1]
WORKER = Path(__file__).with_name("scan_fsdp_worker.py")
D, Q, KV, F, LAYERS = 128, 256, 64, 448, 5
# one layer's kernels by element count: q and o, k and v, gate and up, down
LAYER_KERNELS = Counter({D * Q: 2, D * KV: 2, D * F: 3})


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("scan") / "report.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(WORKER), str(out)], capture_output=True, text=True, timeout=1800,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def _layer_kernels(sizes) -> Counter:
    return Counter(s for s in sizes if s in LAYER_KERNELS)


def test_the_scan_gathers_one_layer_per_iteration(report):
    scanned = report["scanned"]
    # the loops' gathers are one layer's kernels, twice (forward, and the backward's recompute under remat=full)
    assert _layer_kernels(scanned["in_loops"]) == Counter({k: 2 * n for k, n in LAYER_KERNELS.items()})
    assert _layer_kernels(scanned["outside"]) == Counter()
    assert not any(s in (LAYERS * k for k in LAYER_KERNELS) for s in scanned["in_loops"] + scanned["outside"])


def test_the_unrolled_step_gathers_every_layer_outside_any_loop(report):
    unrolled = report["unrolled"]
    assert _layer_kernels(unrolled["in_loops"]) == Counter()
    assert _layer_kernels(unrolled["outside"]) == Counter({k: 2 * LAYERS * n for k, n in LAYER_KERNELS.items()})


def test_the_sharded_scanned_step_equals_the_one_device_step(report):
    np.testing.assert_allclose(report["fsdp_scanned"], report["one_device"], rtol=2e-5, atol=1e-6)
