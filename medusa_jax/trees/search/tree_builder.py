"""build_tree: each head's accuracy on held-out self-distilled text (the LAST conversations of the ShareGPT data,
first user turn, chat template) and the decode loop's step time on this machine, then per batch size the static or
dynamic tree with the most predicted tokens/s, or none (`trees.policy.tree_choice`); the steps and the prediction's
discounts: docs/design.md, "The tree belongs to the heads" and "Static or dynamic, by predicted tokens/s"."""

from __future__ import annotations

import dataclasses
import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import jax
import numpy as np

from medusa_jax.atomic import write_text_atomic
from medusa_jax.settings import above, at_least, check_settings, each, each_or_none, in_range, setting
from medusa_jax.trees import trees_file
from medusa_jax.trees.tree import DynamicTree, TreeError, build_tree, parse_dynamic_tree
from medusa_jax.trees.policy import step_cost, tree_choice
from medusa_jax.inference.api import BatchSettings, generate_batch
from medusa_jax.trees.policy.calibration import DynamicGain, pick_for_batch
from medusa_jax.inference.sharded import ShardedModel
from medusa_jax.training.sharegpt import read_conversations
from medusa_jax.trees.search import head_accuracy
from medusa_jax.inference.loaded_model import LoadedModel
from medusa_jax.trees.policy.calibration import machine_description


@dataclasses.dataclass(frozen=True)
class BuildTreeConfig:
    data: str | None = None  # ShareGPT-style conversations (None: the packaged ShareGPT file)
    heldout: int = setting(24, at_least(1))  # prompts taken from the end of the data
    max_prompt_tokens: int = 192  # longer prompts are skipped
    continuation_tokens: int = setting(128, at_least(4))  # greedy tokens generated per prompt
    top_k: int = setting(10, at_least(1))  # ranks measured per head (the largest rank a tree may use)
    max_nodes: int = setting(64, in_range(1, 4096))  # largest tree considered (root excluded)
    # T values whose step time is measured (root + at least one node)
    tree_tokens: tuple[int, ...] = setting((2, 4, 8, 12, 16, 24, 32, 48, 64), each(in_range(2, 4096)))
    batch_sizes: tuple[int, ...] = setting((1,), each(in_range(1, 4096)))  # rows per timed step: a tree each
    # each drafted token's held-out acceptance is multiplied by this before trees are sized and predicted, so a
    # node at depth d counts scale**d of its held-out value. Held-out ShareGPT text is easier than what users
    # decode: on 16 MT-Bench questions (greedy, 128 tokens, batch 1) the shipped Hydra heads' first head was
    # accepted 0.415 of the time against 0.575 held out (0.72), and a second chained token 0.131 against
    # 0.295 (0.67 per token). Unscaled, build_tree sized the batch-1 tree at 5 nodes, predicted 1.51x and
    # measured 1.09x, where 1 node measured 1.28x (docs/training.md). 1.0 trusts the held-out text.
    accuracy_scale: float = setting(0.72, in_range(0.0, 1.0, low_open=True))
    # a tree is kept only if its predicted speedup over plain (with the scale above) reaches this: a margin for
    # timing noise and for batches of rows more varied than the held-out text (at batch 4 and 8 the predicted
    # 1.23x and 1.11x measured 0.99x on MT-Bench)
    min_speedup: float = setting(1.15, above(0.0))
    context: int = setting(256, at_least(1))  # committed tokens in the cache when timing
    repeats: int = setting(7, at_least(1))  # timed calls per size (median)
    batch_size: int = 8  # rows per call when generating / scoring the held-out text
    # dynamic trees (their default K and D) measured against the static tree of the same size; () for none
    dynamic_nodes: tuple[int, ...] = setting((4, 16), each_or_none(in_range(1, 4096)))

    def __post_init__(self):
        check_settings(self)


def heldout_prompts(loaded: LoadedModel, config: BuildTreeConfig) -> tuple[list[list[int]], str]:
    """Token ids of `heldout` first user turns from the end of the data, and a note saying where from."""
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
    name = Path(str(report.source)).name  # no local paths in what build_tree writes
    return prompts, f"last {len(prompts)} usable conversations of {name} ({report.kept} kept)"


def measure_dynamic(loaded: LoadedModel, config: BuildTreeConfig, prompts, order,
                    progress: Callable[[str], None] = print) -> list[DynamicGain]:
    """For each size N of `config.dynamic_nodes` that the greedy order reaches: tokens per step of greedy decoding
    of the held-out prompts with the dynamic tree of N nodes and with the static tree of the first N nodes of
    `order`. Sizes whose dynamic tree the heads cannot draft are left out."""
    model = ShardedModel(loaded.base, loaded.heads)
    settings = BatchSettings(batch_size=min(config.batch_size, len(prompts)), max_new_tokens=config.continuation_tokens,
                             eos_ids=loaded.eos_ids, pad_id=loaded.pad_id, calibration="skip")
    heads = loaded.heads.config
    gains = []
    for nodes in sorted({n for n in config.dynamic_nodes if n <= len(order)}):
        try:
            dynamic = parse_dynamic_tree(f"dynamic:{nodes}", num_heads=heads.num_heads,
                                         max_top_k=heads.head_vocab_size)
        except TreeError:
            continue
        static = build_tree([p for p, _ in order[:nodes]], name=f"greedy_{nodes}")
        per_step = [generate_batch(model, prompts, dataclasses.replace(settings, tree=tree), progress=False)
                    .tokens_per_step for tree in (dynamic, static)]
        gains.append(DynamicGain(dynamic, round(per_step[0], 4), round(per_step[1], 4)))
        progress(f"{dynamic.name}: {per_step[0]:.3f} tokens/step on the held-out prompts, the static tree of "
                 f"{nodes} nodes {per_step[1]:.3f}")
    return gains


def build(loaded: LoadedModel, config: BuildTreeConfig,
          progress: Callable[[str], None] = print) -> tuple[dict[int, tuple | DynamicTree], dict]:
    """Runs the measurements. Returns (batch size -> paths, () for plain decoding, or a DynamicTree; the `built`
    record of trees.json: accuracies, step times and predictions per batch size, where it ran — no local
    paths)."""
    if loaded.heads is None:
        raise ValueError("build_tree needs heads")
    top_k = min(config.top_k, loaded.heads.config.head_vocab_size)
    prompts, source = heldout_prompts(loaded, config)
    progress(f"held-out text: greedy continuations of {len(prompts)} prompts ({source})")
    sequences, starts = head_accuracy.self_distill(
        loaded.base, prompts, max_new_tokens=config.continuation_tokens, eos_ids=loaded.eos_ids,
        pad_id=loaded.pad_id, batch_size=config.batch_size)
    accuracy = head_accuracy.measure_head_accuracy(loaded.base, loaded.heads, sequences, starts, top_k=top_k,
                                                   batch_size=config.batch_size, progress=progress)
    progress("top-1 accuracy per head: " + ", ".join(f"{a:.3f}" for a in accuracy.top1_m))

    scaled_mr = accuracy.accuracy_mr * config.accuracy_scale  # what sizes and predicts the trees
    order = tree_choice.greedy_tree(scaled_mr, config.max_nodes)
    sizes = sorted({t for t in config.tree_tokens if t <= len(order) + 1})
    trees = [build_tree([p for p, _ in order[: t - 1]], name=f"greedy_{t - 1}") for t in sizes]
    gains = measure_dynamic(loaded, config, prompts, order, progress)
    chosen, records = {}, {}
    for batch in sorted(set(config.batch_sizes)):
        costs = step_cost.measure_step_costs(loaded.base, loaded.heads, trees, batch=batch, context=config.context,
                                             repeats=config.repeats, progress=progress,
                                             dynamic=[g.tree for g in gains])
        chosen[batch], records[str(batch)] = pick_for_batch(
            scaled_mr, costs, len(order), config.min_speedup,
            np.round(accuracy.per_sequence_smr, 4) * config.accuracy_scale, gains)  # as stored in trees.json
        progress(_choice_line(batch, chosen[batch], records[str(batch)]))
    built = {
        "machine": machine_description(),
        "model": loaded.folder.name,
        "heads": loaded.heads_folder.name if loaded.heads_folder else None,
        "num_heads": loaded.heads.config.num_heads,
        "min_speedup": config.min_speedup,
        "accuracy_scale": config.accuracy_scale,
        "heldout": {"source": source, "prompts": len(prompts), "continuation_tokens": config.continuation_tokens,
                    "positions_per_head": accuracy.positions_m.tolist()},
        "head_top1": accuracy.top1_m.tolist(),
        "head_accuracy": accuracy.accuracy_mr.tolist(),
        "head_accuracy_per_sequence": np.round(accuracy.per_sequence_smr, 4).tolist(),
        "greedy_order": [list(p) for p, _ in order],
        "timing": {"context": config.context, "repeats": config.repeats, "tree_tokens": sizes},
        "dynamic": [g.to_json() for g in gains],
        "batches": records,
    }
    return chosen, built


def _choice_line(batch: int, tree, record: dict) -> str:
    if not tree:
        return (f"batch {batch}: no tree pays (best predicted x{record['best_tree_predicted_speedup']:.2f}): "
                f"decode plainly")
    what = f"dynamic tree {tree.name}" if isinstance(tree, DynamicTree) else f"tree of {len(tree)} nodes"
    return (f"batch {batch}: {what}, predicted {record['predicted_tokens_per_step']:.2f} tokens/step, "
            f"x{record['predicted_speedup_vs_plain']:.2f} over plain")


def summary_lines(batches: dict[int, tuple], built: dict) -> list[str]:
    """A short human-readable account of a build."""
    acc = np.asarray(built["head_accuracy"])
    lines = [f"head {d}: top-1 {acc[d, 0]:.3f}, top-{acc.shape[1]} {acc[d].sum():.3f}" for d in range(acc.shape[0])]
    for batch, paths in sorted(batches.items()):
        r = built["batches"][str(batch)]
        steps = r["step_seconds"]
        lines.append(f"batch {batch}: step ms by tree tokens " + ", ".join(
            f"T={t}: {s * 1e3:.1f}" for t, s in zip(steps["tree_tokens"], steps["fitted"]))
            + f" (plain {r['plain_step_seconds'] * 1e3:.1f})")
        lines.append(_choice_line(batch, paths, r))
    return lines


def save_trees(out: Path, existing, batches: dict[int, tuple], built: dict, command: str) -> list[str]:
    """This backend's trees written into the trees file `out` (the other backends' trees of `existing`, its
    content before, kept); returns the build's summary lines."""
    backend = jax.default_backend()
    built = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "command": command, **built}
    document = trees_file.trees_document(existing, backend, batches, built)
    write_text_atomic(out, json.dumps(document, indent=1) + "\n")
    return summary_lines(batches, built) + [f"wrote the {backend} trees for batch sizes "
                                            f"{', '.join(map(str, sorted(batches)))} to {out}"]
