"""build_tree: measure head accuracy and step time on this machine, then pick the tree (see tree_search).

1. held-out prompts (the LAST conversations of the ShareGPT data, first user turn, chat template), continued
   greedily by the base model itself (self-distilled text);
2. each head's top-k accuracy on that text (`head_accuracy`);
3. the greedy node order by expected accepted length, and the whole Medusa step's time for trees that are
   prefixes of that order at several sizes T, plus one plain step, timed in interleaved rounds
   (`step_cost`) and fitted with a non-decreasing curve (a bigger tree is never cheaper; dips are noise);
4. the size with the most expected tokens per second = (1 + expected accepted nodes) / step time.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from medusa_jax import tree_search
from medusa_jax.tree import build_tree
from medusa_jax.inference import head_accuracy, step_cost
from medusa_jax.inference.bench_inputs import LoadedModel, machine_description


@dataclasses.dataclass(frozen=True)
class BuildTreeConfig:
    data: str | None = None  # ShareGPT-style conversations (None: the packaged ShareGPT file)
    heldout: int = 24  # prompts taken from the end of the data
    max_prompt_tokens: int = 192  # longer prompts are skipped
    continuation_tokens: int = 128  # greedy tokens generated per prompt
    top_k: int = 10  # ranks measured per head (the largest rank a tree may use)
    max_nodes: int = 64  # largest tree considered (root excluded)
    tree_tokens: tuple[int, ...] = (2, 4, 8, 12, 16, 24, 32, 48, 64)  # T values whose step time is measured
    batch: int = 1  # rows per step when timing
    context: int = 256  # committed tokens in the cache when timing
    repeats: int = 7  # timed calls per size (median)
    batch_size: int = 8  # rows per call when generating / scoring the held-out text

    def __post_init__(self):
        if self.heldout < 1 or self.top_k < 1 or self.max_nodes < 1 or self.continuation_tokens < 4:
            raise ValueError(f"heldout, top_k, max_nodes must be >= 1 and continuation_tokens >= 4: {self}")
        if not self.tree_tokens or min(self.tree_tokens) < 2:
            raise ValueError(f"tree_tokens must be sizes >= 2 (root + at least one node), got {self.tree_tokens}")


def heldout_prompts(loaded: LoadedModel, config: BuildTreeConfig) -> tuple[list[list[int]], str]:
    """Token ids of `heldout` first user turns from the end of the data, and a note saying where from."""
    from medusa_jax.training.sharegpt import read_conversations

    conversations, report = read_conversations(config.data)
    prompts = []
    for conv in reversed(conversations):
        user = next((m["content"] for m in conv["messages"] if m["role"] == "user" and m["content"].strip()), None)
        if user is None:
            continue
        ids = loaded.encode_chat([user])[0]
        if len(ids) <= config.max_prompt_tokens:
            prompts.append(ids)
        if len(prompts) == config.heldout:
            break
    if not prompts:
        raise ValueError(f"{report.source}: no usable prompt of at most {config.max_prompt_tokens} tokens")
    return prompts, f"last {len(prompts)} usable conversations of {report.source} ({report.kept} kept)"


def build(loaded: LoadedModel, config: BuildTreeConfig, progress: Callable[[str], None] = print) -> dict:
    """Runs the measurements and returns the tree document (see `tree_search.tree_document`)."""
    if loaded.heads is None:
        raise ValueError("build_tree needs heads")
    num_heads = loaded.heads.config.num_heads
    top_k = min(config.top_k, loaded.heads.config.head_vocab_size)
    prompts, source = heldout_prompts(loaded, config)
    progress(f"held-out text: greedy continuations of {len(prompts)} prompts ({source})")
    sequences, starts = head_accuracy.self_distill(
        loaded.base, prompts, max_new_tokens=config.continuation_tokens, eos_ids=loaded.eos_ids,
        pad_id=loaded.pad_id, batch_size=config.batch_size)
    accuracy = head_accuracy.measure_head_accuracy(loaded.base, loaded.heads, sequences, starts, top_k=top_k,
                                                   batch_size=config.batch_size, progress=progress)
    progress("top-1 accuracy per head: " + ", ".join(f"{a:.3f}" for a in accuracy.top1_d))

    order = tree_search.greedy_tree(accuracy.accuracy_dk, config.max_nodes)
    sizes = sorted({t for t in config.tree_tokens if t <= len(order) + 1})
    trees = [build_tree([p for p, _ in order[: t - 1]], name=f"greedy_{t - 1}") for t in sizes]
    costs = step_cost.measure_step_costs(loaded.base, loaded.heads, trees, batch=config.batch,
                                         context=config.context, repeats=config.repeats, progress=progress)
    # step time cannot fall as the tree grows: fit the measured (noisy) times with a non-decreasing curve
    cost = tree_search.StepCost(costs.num_tree_tokens,
                                tuple(tree_search.nondecreasing_fit(costs.medusa_seconds)))
    choice = tree_search.choose_tree(accuracy.accuracy_dk, cost, min(len(order), cost.max_tokens - 1))
    progress(f"chosen: {choice.best_num_nodes} nodes, predicted {choice.predicted_tokens_per_step:.2f} tokens/step, "
             f"{choice.predicted_tokens_per_second:.1f} tokens/s at batch {config.batch}")
    provenance = {
        "model": str(loaded.folder),
        "heads": str(loaded.heads_folder),
        "num_heads": num_heads,
        "heldout": {"source": source, "prompts": len(prompts),
                    "continuation_tokens": config.continuation_tokens,
                    "positions_per_head": accuracy.positions_d.tolist()},
        "head_top1": accuracy.top1_d.tolist(),
        "plain_step_seconds": costs.plain_seconds,
        "measured_step_seconds": list(costs.medusa_seconds),
        "timing": {"batch": config.batch, "context": config.context, "cache_size": costs.cache_size,
                   "repeats": config.repeats},
        "predicted_speedup_vs_plain": float(choice.predicted_tokens_per_second * costs.plain_seconds),
        "machine": machine_description(),
    }
    return tree_search.tree_document(choice, accuracy.accuracy_dk, cost, provenance)


def summary_lines(document: dict) -> list[str]:
    """A short human-readable account of a tree document."""
    acc = np.asarray(document["head_accuracy"])
    lines = [f"head {d}: top-1 {acc[d, 0]:.3f}, top-{acc.shape[1]} {acc[d].sum():.3f}" for d in range(acc.shape[0])]
    steps = document["step_seconds"]
    lines.append("step ms by tree tokens: " + ", ".join(
        f"T={t}: {s * 1e3:.1f}" for t, s in zip(steps["tree_tokens"], steps["seconds"]))
        + f" (plain {document['plain_step_seconds'] * 1e3:.1f})")
    lines.append(f"chosen tree: {document['num_nodes']} nodes, predicted {document['predicted_tokens_per_step']:.2f} "
                 f"tokens/step, predicted speedup over plain x{document['predicted_speedup_vs_plain']:.2f}")
    return lines
