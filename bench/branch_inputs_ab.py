"""A/B of the mixed-draft step as shipped (`medusa.mixed_step`: the drafted branch drafts from the step's inputs
captured by closure, so XLA's loop-invariant code motion hoists the drafting out of its one-trip loop, `run_if`, and
it runs on every step, a skipped one too, and each size's branch reads the proposal the same way, so every size's
verify inputs are built at every drafted step) against the step whose branches read their inputs from the loop's
carry or as operands (`carried_mixed_step`: the drafting and the verify inputs only where a branch runs), in one
process.

SmolLM2 with the shipped heads' mix `default+recycle+lookup` at 16 nodes (sizes 0, 2, 5, 16), BATCH rows, greedy,
128 new tokens, prompts PROMPTS (0-based) of the set SET in calls of BATCH, REPEATS interleaved rounds
(`bench.mixed_drafts.run_set`, the median), against plain decoding in the same rounds. Both arms take this machine's
calibration (`draft_size_cache.size_costs`, by span), the carried arm's costs nudged by a part in a million so that
each arm compiles its own loop (each traced with its own step: `mixed_drafts.traced_with`). Prompts padded to 512
tokens (`BatchSettings.bucket`), as bench/span_costs_ab.py: one decode loop per arm.

  python bench/branch_inputs_ab.py    (writes bench/mixed_drafts/branch_inputs/results_SET_batchBATCH_promptsN.{json,md})

Environment: PROMPTS (default 0,1,...,7), REPEATS (3), BATCH (1), SET (mtbench; grounded, humaneval).
"""

import dataclasses
import json
import os
from pathlib import Path
from typing import Sequence

import jax.numpy as jnp

from medusa_jax.bench import mixed_drafts
from medusa_jax.bench.bench_inputs import env_choices, env_int, prompt_texts, write_files
from medusa_jax.compile_cache import enable_compile_cache
from medusa_jax.heads.draft_merge import DraftSizes, SpanCosts, keep_best
from medusa_jax.inference import medusa
from medusa_jax.inference.autoregressive import run_if
from medusa_jax.inference.loaded_model import load_model
from medusa_jax.inference.mixed_decoding import build_mix
from medusa_jax.inference.sharded import ShardedModel
from medusa_jax.inference.size_choice import accepted_per_size, lookup_pays, predicted_accepts
from medusa_jax.model.sharding import MeshConfig
from medusa_jax.trees.dynamic_tree import TreeProposal
from medusa_jax.trees.policy.calibration import machine_description

PROMPTS = [int(p) for p in env_choices("PROMPTS", tuple(str(i) for i in range(8)), tuple(str(i) for i in range(80)))]
REPEATS = env_int("REPEATS", 3, 1, 100)
BATCH = env_int("BATCH", 1, 1, 16)
SET = env_choices("SET", ("mtbench",), ("mtbench", "grounded", "humaneval"))[0]
OUT = Path(__file__).resolve().parent / "mixed_drafts" / "branch_inputs"
SHIPPED = medusa.mixed_step


def carried_sized_verify(model, state, proposal: TreeProposal, draft, sizes: DraftSizes, acceptance, eos_ids,
                         lookup: Sequence[TreeProposal] = ()):
    """`medusa.sized_verify` with the proposal handed to each size's branch as a `run_if` operand."""
    lengths_b = state.cache.lengths_b
    counted_b = medusa.counted_rows(state)
    rows = jnp.sum(counted_b).astype(jnp.float32)
    accepts_k = predicted_accepts(proposal, sizes, counted_b)
    lookup_k = sum((predicted_accepts(p, sizes, counted_b) for p in lookup), jnp.zeros_like(accepts_k))
    choice = state.choice.choose(accepts_k, lookup_k, sizes, rows)

    def branch(index: int, nodes: int):
        def run(state_, proposal_):
            kept = keep_best(proposal_, nodes) if nodes else None
            if nodes == 0:
                verified = medusa.plain_inputs(state_, sizes.depth)
            else:
                verified = medusa.verify_inputs(kept, state_.root_b, lengths_b, state_.cache.cache_size,
                                                sizes.tree(nodes))
            after = medusa.verify_and_emit(model, state_, verified, state_.draft, acceptance, eos_ids)
            if nodes == 0:
                accepted_k = jnp.zeros((len(sizes.sizes),), jnp.float32)
            else:
                accept_b = jnp.maximum(after.num_out_b - state_.num_out_b - 1, 0)
                accepted_k = accepted_per_size(kept.score_bt[:, 1:], after.move_src_be - lengths_b[:, None],
                                               accept_b, counted_b, sizes, nodes)
            return dataclasses.replace(after, choice=state_.choice.drafted(sizes, jnp.int32(index), accepted_k, rows,
                                                                           accepts_k))
        return run

    state = dataclasses.replace(state, draft=draft)
    for index, nodes in enumerate(sizes.sizes):
        state = run_if(choice == index, branch(index, nodes), state, proposal)
    return state


def carried_mixed_step(model, state, proposer, inputs, sizes: DraftSizes, acceptance, eos_ids):
    """`medusa.mixed_step` (with a size-choice state) whose drafted branch drafts from its carry."""
    given = model.heads.lookup_proposals(state.draft, state.root_b) if hasattr(model.heads, "lookup_proposals") \
        else None

    def drafted(state_):
        proposal, draft = proposer(dataclasses.replace(inputs, hidden_bd=state_.hidden_bd, root_b=state_.root_b,
                                                       num_out_b=state_.num_out_b, step=state_.step,
                                                       draft=state_.draft, active_b=state_.active_b, given=given))
        return carried_sized_verify(model, state_, proposal, draft, sizes, acceptance, eos_ids,
                                    list((given or {}).values()))

    drafts = state.choice.drafts | lookup_pays(list((given or {}).values()), sizes, medusa.counted_rows(state))
    state = run_if(~drafts, lambda s: medusa.skipped_step(model, s, sizes=sizes, acceptance=acceptance,
                                                          eos_ids=eos_ids), state)
    return run_if(drafts, drafted, state)


def nudged(sizes: DraftSizes, scale: float) -> DraftSizes:
    """The same sizes with every cost (by span too) times `scale`: a distinct static argument."""
    by_span = sizes.by_span and SpanCosts(sizes.by_span.spans,
                                          tuple(tuple(c * scale for c in cs) for cs in sizes.by_span.costs))
    return DraftSizes(sizes.sizes, tuple(c * scale for c in sizes.costs), sizes.depth, by_span)


def main() -> None:
    texts = prompt_texts(SET, max(PROMPTS) + 1)
    enable_compile_cache()
    machine = machine_description()
    loaded = load_model("default", "default")
    arms = {"plain": (None, SHIPPED), "branch inputs carried": (1 + 1e-6, carried_mixed_step),
            "branch inputs by closure (shipped)": (1.0, SHIPPED)}
    models, sizes = {}, None
    for label, (scale, _) in arms.items():
        if scale is None:
            models[label] = (ShardedModel(loaded.base, None, MeshConfig()), None)
            continue
        mix, timed = build_mix(loaded.base, ("recycle", "lookup"), loaded.heads, 16, batch=BATCH)
        sizes = sizes or timed
        models[label] = (ShardedModel(loaded.base, mix, MeshConfig()), nudged(timed, scale))
    prompts = loaded.encode_chat([texts[i] for i in PROMPTS])
    bucket = mixed_drafts.PROMPT_WIDTH
    for label, (model, tree) in models.items():  # each arm's loop traced with its own step, before the timed rounds
        with mixed_drafts.traced_with(arms[label][1], "mixed_step"):
            mixed_drafts.run_set({label: (model, tree)}, prompts[:BATCH], 128, loaded.eos_ids, loaded.pad_id,
                                 batch=BATCH, bucket=bucket)
    rows = mixed_drafts.run_set(models, prompts, 128, loaded.eos_ids, loaded.pad_id, print, batch=BATCH,
                                repeats=REPEATS, bucket=bucket)
    results = {"machine": machine, "set": SET, "prompts": PROMPTS, "repeats": REPEATS, "batch": BATCH,
               "bucket": bucket, **sizes.record(), "methods": mixed_drafts.arm_figures(rows)}
    settings = " ".join(f"{k}={os.environ[k]}" for k in ("SET", "PROMPTS", "REPEATS", "BATCH") if k in os.environ)
    results["command"] = command = (settings + " " if settings else "") + "python bench/branch_inputs_ab.py"
    table = mixed_drafts.arm_table(f"Branch inputs carried against captured ({SET}, batch {BATCH}, prompts padded "
                                   f"to {bucket})", command, machine, results)
    name = f"results_{SET}_batch{BATCH}_prompts{len(PROMPTS)}"
    write_files(OUT, {f"{name}.json": json.dumps(results, indent=1) + "\n", f"{name}.md": table})
    print(table)


if __name__ == "__main__":
    main()
