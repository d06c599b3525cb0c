"""The generation front-end: token-id prompts in, one `GenerationResult` per prompt out, in input order, on a device
mesh (`sharded.ShardedModel`; one device is a mesh of one). `generate` (plain) and `generate_medusa` are one batch on
one device; `generate_batch` runs any number of prompts on any mesh through the generation engine, in sorted
batches or refilled slots (`uses_refill`); every path checks its prompts with `engine.check_prompts`. The policies,
their measured rule and several processes: docs/design.md, "Batch generation"."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
from tqdm.auto import tqdm

from medusa_jax.model.backbone import CausalLM
from medusa_jax.model.sharding import MeshConfig
from medusa_jax.heads.draft_merge import DraftSizes
from medusa_jax.heads.medusa import MedusaHeads
from medusa_jax.trees.tree import DynamicTree, TreeBuffers, load_tree
from medusa_jax.inference.acceptance import AcceptanceConfig
from medusa_jax.trees.policy.choose import HEADS_TREE, ChosenTree, HeadsOwnTree, choose_tree
from medusa_jax.inference.batch_run import BatchRun, BatchSettings, GenerationResult
from medusa_jax.inference.engine_batches import refilled_slots, sorted_batches
from medusa_jax.inference.engine import PROMPT_BUCKET, check_prompts, resolve_eos, round_up
from medusa_jax.inference.medusa import Proposer, heads_proposer
from medusa_jax.inference.sampling import SamplingConfig
from medusa_jax.inference.sharded import ShardedModel

REFILL_MIN_BATCH = 64  # engine "auto" refills slots from this batch size on (bench/refill/auto_rule, uneven)


def plan_batches(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """Prompt indices grouped into batches of at most batch_size, longest prompts first (stable on ties); prompts
    that fit one batch keep their input order (so a caller's per-row data, e.g. proposer_data, lines up)."""
    if len(lengths) <= batch_size:
        return [list(range(len(lengths)))]
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    return [order[i: i + batch_size] for i in range(0, len(order), batch_size)]


def generate_batch(model: ShardedModel, prompts: Sequence[Sequence[int]], settings: BatchSettings = BatchSettings(),
                   *, progress: bool = True, on_batch: Callable[[list[GenerationResult]], None] | None = None,
                   proposer: Proposer | None = None, proposer_data: Any = None) -> BatchRun:
    """Generates a reply for every token-id prompt; returns the results in input order. `on_batch` is
    called with each finished batch's results (e.g. to stream them to a file; refilled slots: once, with
    all). `proposer` replaces the heads' top-k proposal in Medusa decoding (it receives `proposer_data`, whose
    rows are a batch's rows: its prompts in input order where they fit one batch; `ProposeInputs.step` counts
    the batch's verify steps)."""
    check_prompts(prompts)
    if settings.tree is not None and not model.has_heads:
        raise ValueError("Medusa decoding (a tree was given) needs a ShardedModel built with heads")
    chosen = None
    if isinstance(settings.tree, DraftSizes):
        chosen = ChosenTree(settings.tree, f"mixed drafts ({settings.tree.name}: up to {settings.tree.nodes} nodes, "
                                           f"the size chosen per step from costs {settings.tree.cost_note})")
    elif settings.tree is not None:
        given = None if isinstance(settings.tree, HeadsOwnTree) else settings.tree
        chosen = choose_tree(model.heads_config, model.heads_trees, settings.batch_size, given, model=model,
                             calibration=settings.calibration, progress=progress)
    if chosen is not None:
        settings = dataclasses.replace(settings, tree=chosen.tree)
    # on a mesh the rows are rounded up to a multiple of data x fsdp (a batch keeps batch_size prompts)
    rows = round_up(settings.batch_size, model.row_multiple)
    check_prompts(prompts, model.config.max_position_embeddings, settings.max_new_tokens)
    bar = tqdm(total=len(prompts), unit="prompt", desc="generate", dynamic_ncols=True) \
        if progress and jax.process_index() == 0 else None
    if uses_refill(model, settings, len(prompts), proposer):
        run = refilled_slots(model, prompts, settings, bar, on_batch)
    else:
        plan = plan_batches([len(p) for p in prompts], settings.batch_size)
        run = sorted_batches(model, prompts, settings, plan, rows, chosen, bar, on_batch,
                             proposer or heads_proposer, proposer_data)
    if bar is not None:
        bar.close()
    return run


def uses_refill(model: ShardedModel, settings: BatchSettings, num_prompts: int, proposer: Proposer | None = None
                ) -> bool:
    """Whether `generate_batch` refills slots: engine "refill", or "auto" with plain decoding on one device in
    one process, batch_size >= REFILL_MIN_BATCH, at least batch_size prompts and no fixed cache size."""
    plain_on_one_device = (settings.tree is None and proposer is None and model.mesh.size == 1
                           and jax.process_count() == 1)
    if settings.engine == "refill":
        if not plain_on_one_device:
            raise ValueError("engine='refill' decodes plainly on one device: no tree, no proposer, no mesh")
        return True
    return (settings.engine == "auto" and plain_on_one_device and settings.cache_size is None
            and settings.batch_size >= REFILL_MIN_BATCH and num_prompts >= settings.batch_size)


def _one_batch(prompts: Sequence[Sequence[int]], batch_size: int | None) -> int:
    """The batch size of a one-batch call (default: the number of prompts)."""
    check_prompts(prompts)
    batch_size = batch_size or len(prompts)
    if len(prompts) > batch_size:
        raise ValueError(f"{len(prompts)} prompts do not fit a batch of {batch_size}")
    return batch_size


def generate(model: CausalLM, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 128,
             sampling: SamplingConfig = SamplingConfig(), seed: int = 0, eos_ids: Sequence[int] | None = None,
             pad_id: int = 0, batch_size: int | None = None, cache_size: int | None = None,
             timings: dict | None = None) -> list[GenerationResult]:
    """Plain decoding of one batch of token-id prompts (ragged lengths are fine) on one device: `generate_batch`
    on a mesh of one, prompts padded to a width of `engine.width_ladder`. `timings` gets "seconds" (the whole call)."""
    settings = BatchSettings(batch_size=_one_batch(prompts, batch_size), max_new_tokens=max_new_tokens,
                             sampling=sampling, seed=seed, eos_ids=resolve_eos(model, eos_ids), pad_id=pad_id,
                             bucket=PROMPT_BUCKET, cache_size=cache_size)
    run = generate_batch(ShardedModel(model, None, MeshConfig()), prompts, settings, progress=False)
    if timings is not None:
        timings["seconds"] = run.seconds
    return run.results


def generate_medusa(base: CausalLM, heads: MedusaHeads, prompts: Sequence[Sequence[int]], *,
                    tree: "str | TreeBuffers | DynamicTree | None" = None, max_new_tokens: int = 128,
                    sampling: SamplingConfig = SamplingConfig(), acceptance: AcceptanceConfig = AcceptanceConfig(),
                    seed: int = 0, eos_ids: Sequence[int] | None = None, pad_id: int = 0, batch_size: int | None = None,
                    cache_size: int | None = None, proposer: Proposer | None = None, proposer_data: Any = None,
                    timings: dict | None = None) -> list[GenerationResult]:
    """Medusa decoding of one batch of token-id prompts (ragged lengths are fine) on one device, as `generate`.
    `tree` is a preset name, "dynamic:N[,k=K,d=D]" (a dynamic tree, EAGLE-2 style), a JSON file, TreeBuffers or
    a DynamicTree; None: the heads' own tree for this backend and batch
    size (`choose.choose_tree`), and plain decoding (same sampling) where their trees.json says no tree pays.
    `sampling` is the one sampling config (greedy at temperature 0), `acceptance` how candidates are accepted
    (kind None: greedy at temperature 0, exact, i.e. lossless, above; `acceptance.DecodeConfig`).
    `proposer` replaces the heads' top-k proposal (it receives `proposer_data`). Each result's `steps` counts
    the prefill and the verify steps; `accept_lengths` lists each step's. `timings` gets "seconds" and
    "tree" (the tree's origin, or why decoding was plain)."""
    limits = dict(num_heads=heads.config.num_heads, max_top_k=heads.config.head_vocab_size)
    settings = BatchSettings(batch_size=_one_batch(prompts, batch_size), max_new_tokens=max_new_tokens,
                             tree=HEADS_TREE if tree is None else tree if isinstance(tree, DraftSizes)
                             else load_tree(tree, **limits), acceptance=acceptance,
                             sampling=sampling,
                             seed=seed, eos_ids=resolve_eos(base, eos_ids), pad_id=pad_id, bucket=PROMPT_BUCKET,
                             cache_size=cache_size)
    run = generate_batch(ShardedModel(base, heads, MeshConfig()), prompts, settings, progress=False,
                         proposer=proposer, proposer_data=proposer_data)
    if timings is not None:
        timings.update(seconds=run.seconds, tree=run.tree_choice.note)
    return run.results
