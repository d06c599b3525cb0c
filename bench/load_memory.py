"""Peak host memory of loading a model onto N (forced CPU) devices, each measurement in a fresh process: sharded
loading vs loading on one device then device_put; the figures are defined in docs/modules.md."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

import jax
from flax import nnx

from medusa_jax.model.sharding import MeshConfig, param_shardings, sharding_for
from medusa_jax.hf.load import load_pretrained
from medusa_jax.bench.bench_report import table

MODES = ("sharded", "via_one")


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


class _AnonPeak:
    """Samples RssAnon in a background thread (the kernel keeps a high-water mark only for the total)."""

    def __init__(self, interval: float = 0.005):
        self.peak = _status_kib("RssAnon")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval,), daemon=True)
        self._thread.start()

    def _run(self, interval):
        while not self._stop.is_set():
            self.peak = max(self.peak, _status_kib("RssAnon"))
            time.sleep(interval)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _status_kib("RssAnon"))
        return self.peak


def _child(model_dir: str, mesh_spec: str, mode: str) -> dict:
    jax.devices()  # start the backend before the baseline
    mesh = MeshConfig.parse(mesh_spec).make_mesh()
    baseline_kib, anon_base_kib = _status_kib("VmRSS"), _status_kib("RssAnon")
    sampler = _AnonPeak()
    start = time.perf_counter()
    if mode == "sharded":
        model = load_pretrained(model_dir, sharding_for=sharding_for(mesh))
        state = nnx.state(model)
    else:
        state = nnx.state(load_pretrained(model_dir))
        jax.block_until_ready(state)
        state = jax.device_put(state, param_shardings(state, mesh))
    jax.block_until_ready(state)
    seconds = time.perf_counter() - start
    anon_peak_kib = sampler.stop()
    shards = [s for leaf in jax.tree.leaves(state) for s in leaf.addressable_shards]
    on_devices = sum(s.data.nbytes for s in shards)
    most = max(sum(s.data.nbytes for s in shards if s.device == device) for device in {s.device for s in shards})
    mib = 1 / 1024
    return {"mesh": mesh_spec or "single", "devices": mesh.size, "mode": mode, "seconds": round(seconds, 2),
            "baseline_mib": round(baseline_kib * mib, 1), "peak_total_mib": round(_status_kib("VmHWM") * mib, 1),
            "peak_anon_mib": round(anon_peak_kib * mib, 1),
            "anon_growth_mib": round((anon_peak_kib - anon_base_kib) * mib, 1),
            "on_devices_mib": round(on_devices / 2**20, 1),
            "max_per_device_mib": round(most / 2**20, 1)}


DEFAULT_RUNS = ("1::sharded", "8:fsdp=8:sharded", "8:data=2,fsdp=4:sharded", "8:data=8:sharded",
                "8:fsdp=8:via_one")


def parse_run(text: str) -> tuple[int, str, str]:
    """--runs 'DEVICES:MESH:MODE' (e.g. 8:fsdp=8:sharded; MESH '' = one device) -> (devices, mesh, mode); a
    ValueError says what is wrong."""
    parts = text.split(":")
    if (len(parts) != 3 or not (parts[0].isascii() and parts[0].isdigit()) or int(parts[0]) < 1
            or parts[2] not in MODES):
        raise ValueError(f"--runs {text!r}: expected DEVICES:MESH:MODE with DEVICES >= 1 and MODE sharded or "
                         f"via_one, e.g. 8:fsdp=8:sharded")
    try:
        size = MeshConfig.parse(parts[1]).size if parts[1] else 1
    except ValueError as e:
        raise ValueError(f"--runs {text!r}: {e}") from None
    if size > int(parts[0]):
        raise ValueError(f"--runs {text!r}: the mesh needs more devices than given")
    return int(parts[0]), parts[1], parts[2]


def markdown(rows: list[dict], model: str) -> str:
    keys = ("devices", "mesh", "mode", "on_devices_mib", "max_per_device_mib", "anon_growth_mib", "peak_total_mib",
            "seconds")
    lines = [f"Loading {model} (float32): peak host memory, MiB (fresh process per row)", "",
             *table("devices | mesh | mode | on devices | max per device | private memory growth (peak RssAnon) | "
                    "VmHWM (incl. mapped file) | seconds", ([r[k] for k in keys] for r in rows))]
    return "\n".join(lines) + "\n"


def measure(model_dir: str, mesh_spec: str, devices: int, mode: str = "sharded", timeout: int = 900) -> dict:
    """Runs one load in a fresh process with `devices` forced CPU devices; returns its figures."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    proc = subprocess.run([sys.executable, "-m", "medusa_jax.bench.load_memory", model_dir, mesh_spec, mode],
                          env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"loading with mesh {mesh_spec!r} ({mode}) failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="child process of medusa_jax.bench.load_memory.measure")
    parser.add_argument("model_dir")
    parser.add_argument("mesh", help="mesh spec, e.g. fsdp=8 ('' for one device)")
    parser.add_argument("mode", choices=MODES)
    args = parser.parse_args()
    print(json.dumps(_child(args.model_dir, args.mesh, args.mode)))
