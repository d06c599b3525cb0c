"""Quick Medusa vs plain decoding figures on four fixed prompts: tokens per step and tokens/s of plain decoding,
Medusa with the heads, and Medusa with an oracle that plants the true continuation (the tree's upper bound)."""

from __future__ import annotations

import dataclasses
import json
from typing import Callable, Sequence

import numpy as np

from medusa_jax.model.backbone import CausalLM
from medusa_jax.settings import at_least, check_settings, each, in_range, setting
from medusa_jax.heads.medusa import MedusaHeads
from medusa_jax.trees.tree import load_tree
from medusa_jax.inference.api import generate, generate_medusa
from medusa_jax.bench.bench_inputs import fastest
from medusa_jax.trees.search.oracle import planted_data, planted_over_heads_proposer

PROMPTS = (
    "What is the capital of France? Answer in one sentence.",
    "Write a short poem about the sea.",
    "Explain what a hash table is to a beginner.",
    "Give me three tips for learning to cook.",
)


@dataclasses.dataclass(frozen=True)
class QuickConfig:
    trees: tuple[str, ...]  # tree presets or JSON files
    batch_sizes: tuple[int, ...] = setting((1, 4), each(in_range(1, len(PROMPTS))))
    max_new_tokens: int = setting(64, at_least(1))
    stop_at_eos: bool = False  # False: every row generates exactly max_new_tokens
    repeats: int = setting(2, at_least(1))

    def __post_init__(self):
        if not self.trees:
            raise ValueError("give at least one tree")
        check_settings(self)


def _row(batch: int, name: str, results, seconds: float) -> dict:
    tokens = sum(r.new_tokens for r in results)
    return {"batch": batch, "config": name, "tokens": tokens, "seconds": round(seconds, 3),
            "tokens_per_s": round(tokens / seconds, 1),
            "tokens_per_step": round(float(np.mean([r.tokens_per_step for r in results])), 3),
            "ms_per_step": round(1000 * seconds / max(r.steps for r in results), 1)}


def line(row: dict) -> str:
    return (f"B={row['batch']} {row['config']:34s} tokens/step {row['tokens_per_step']:5.2f}   "
            f"{row['tokens_per_s']:7.1f} tokens/s  {row['ms_per_step']:7.1f} ms/step  ({row['tokens']} tokens in "
            f"{row['seconds']:.2f} s)")


def run_quick(base: CausalLM, heads: MedusaHeads, prompts: Sequence[Sequence[int]], config: QuickConfig, *,
              eos_ids: tuple[int, ...], pad_id: int, as_json: bool = False,
              log: Callable[[str], None] = lambda m: print(m, flush=True)) -> list[dict]:
    """Plain, Medusa with the heads and Medusa with the oracle, per batch size and tree; logs each row as it
    comes and returns them. Raises AssertionError if the oracle's output differs from plain greedy."""
    n = config.max_new_tokens
    common = dict(max_new_tokens=n, eos_ids=eos_ids if config.stop_at_eos else (), pad_id=pad_id)
    rows = []

    def report(batch, name, results, seconds):
        rows.append(_row(batch, name, results, seconds))
        log(json.dumps(rows[-1]) if as_json else line(rows[-1]))

    for batch in config.batch_sizes:
        chunk = list(prompts[:batch])
        plain, seconds = fastest(lambda: generate(base, chunk, **common), config.repeats)
        report(batch, "plain", plain, seconds)
        for tree_name in config.trees:
            tree = load_tree(tree_name, num_heads=heads.config.num_heads)
            results, seconds = fastest(lambda: generate_medusa(base, heads, chunk, tree=tree, **common),
                                     config.repeats)
            report(batch, f"medusa {tree.name} heads", results, seconds)
            data = planted_data(tree, [r.token_ids for r in plain], np.full((batch, n), tree.depth), n)
            results, seconds = fastest(lambda: generate_medusa(
                base, heads, chunk, tree=tree, proposer=planted_over_heads_proposer, proposer_data=data,
                **common), config.repeats)
            if [r.token_ids for r in results] != [r.token_ids for r in plain]:
                raise AssertionError(f"{tree.name}: oracle Medusa output differs from plain greedy")
            report(batch, f"medusa {tree.name} oracle", results, seconds)
    return rows
