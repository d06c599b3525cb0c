"""A/B of the cache move made at its width (`medusa.move_cache_slots` as shipped: the narrowest of `move_widths(e)`
past the last entry any row moves) against the move of all e entries at every step that moves (the code before),
in one process: SmolLM2 with the shipped heads' mix `default+recycle+lookup` at 16 nodes, BATCH rows, greedy, 128
new tokens, MT-Bench first turns PROMPTS (0-based) in calls of BATCH, REPEATS interleaved rounds
(`bench.mixed_drafts.run_set`, the median), against plain decoding in the same rounds. Each arm's loop is traced
with its own move (the swap is undone after its first call compiles it); both arms have the same draft sizes and
costs, nudged by a part in a million so that each compiles its own loop.

  python bench/move_width_ab.py           (writes bench/mixed_drafts/move_width/results_batchBATCH[_fixedN].{json,md})

Environment: PROMPTS (default 0,1,...,7), REPEATS (3), BATCH (1), FIXED (0: the size rule as shipped, with
`draft_size.default_costs`; N > 0: every step drafts and verifies N nodes, so nearly every step moves).
MOVE_ALONE=1 times the two moves alone instead (SmolLM2's cache of 1,024 slots, 1 and 4 rows, the mix's e = 11
entries, accepted paths of 1, 2, 4 and 10 nodes; 100 moves in one jitted loop, the fastest of 7 calls):
results_move_alone.{json,md}.
"""

import json
import os
from pathlib import Path

import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from medusa_jax.bench import mixed_drafts
from medusa_jax.bench.bench_inputs import env_choices, env_int, mtbench_questions, write_files
from medusa_jax.compile_cache import enable_compile_cache
from medusa_jax.heads.draft_merge import DraftSizes
from medusa_jax.inference import draft_size, medusa
from medusa_jax.inference.autoregressive import run_if
from medusa_jax.inference.loaded_model import load_model
from medusa_jax.inference.mixed_decoding import build_mix
from medusa_jax.inference.sharded import ShardedModel
from medusa_jax.model.kv_cache import KVCache, move_slots
from medusa_jax.model.sharding import MeshConfig, map_cache_rows
from medusa_jax.trees.policy.calibration import machine_description

PROMPTS = [int(p) for p in env_choices("PROMPTS", tuple(str(i) for i in range(8)), tuple(str(i) for i in range(80)))]
REPEATS = env_int("REPEATS", 3, 1, 100)
BATCH = env_int("BATCH", 1, 1, 16)
FIXED = env_int("FIXED", 0, 0, 16)
MOVE_ALONE = env_int("MOVE_ALONE", 0, 0, 1) == 1
OUT = Path(__file__).resolve().parent / "mixed_drafts" / "move_width"
AT_WIDTH = medusa.move_cache_slots


def whole_move(cache, src_be, dst_be):
    """The move as it was: all e entries in every layer whenever any entry moves."""
    def move(cache_, src, dst):
        return run_if(jnp.any(src != dst), lambda c: move_slots(c, src, dst), cache_)
    return map_cache_rows(move, cache, src_be, dst_be)


def moves_alone(loaded, machine) -> None:
    """MOVE_ALONE=1 (module docstring): milliseconds per move of each arm."""
    e, moves, rows_out = 11, 100, []

    def timed(fn, cache, src, dst) -> float:
        @partial(jax.jit, donate_argnums=0)
        def loop(c, s, d):  # alternate two sources so that no move repeats the one before
            return jax.lax.fori_loop(0, moves, lambda i, c: fn(c, s + (i % 2) * (s != d), d), c)
        cache = jax.block_until_ready(loop(cache, src, dst))
        best = float("inf")
        for _ in range(7):
            start = time.perf_counter()
            cache = jax.block_until_ready(loop(cache, src, dst))
            best = min(best, time.perf_counter() - start)
        return best / moves * 1e3

    for rows in (1, 4):
        for accepted in (1, 2, 4, 10):
            dst = np.tile(300 + np.arange(e), (rows, 1))
            src = dst.copy()
            src[:, 1:accepted + 1] += 3  # entries 1..accepted move (entry 0, the root, never does)
            src, dst = jnp.asarray(src, jnp.int32), jnp.asarray(dst, jnp.int32)
            ms = {label: timed(fn, KVCache.zeros(loaded.base.config, rows, 1024), src, dst)
                  for label, fn in (("at its width", AT_WIDTH), ("whole", whole_move))}
            rows_out.append({"rows": rows, "accepted": accepted, **{k: round(v, 3) for k, v in ms.items()}})
            print(rows_out[-1])
    command = "MOVE_ALONE=1 python bench/move_width_ab.py"
    lines = ["## The move alone (SmolLM2, 1,024 cache slots, e = 11 entries)", "", f"Command: `{command}`", "",
             f"Machine: {machine['cpu']}, {machine['cpu_count']} cores, JAX {machine['jax']}, load average "
             f"{machine['load_average_1m']:.1f} at the start. Milliseconds per move, the fastest of 7 calls of "
             f"{moves} moves.", "", "| rows | accepted nodes | at its width | whole (before) |", "|---|---|---|---|"]
    lines += [f"| {r['rows']} | {r['accepted']} | {r['at its width']:.3f} | {r['whole']:.3f} |" for r in rows_out]
    write_files(OUT, {"results_move_alone.json": json.dumps({"machine": machine, "command": command,
                                                              "moves": rows_out}, indent=1) + "\n",
                      "results_move_alone.md": "\n".join(lines) + "\n"})
    print("\n".join(lines))


def main() -> None:
    enable_compile_cache()
    machine = machine_description()
    loaded = load_model("default", "default")
    if MOVE_ALONE:
        moves_alone(loaded, machine)
        return
    arms = {"plain": (None, AT_WIDTH), "moved at its width": (0, AT_WIDTH), "moved whole (before)": (1, whole_move)}
    models, sizes = {}, None
    for label, (nudge, _) in arms.items():
        if nudge is None:
            models[label] = (ShardedModel(loaded.base, None, MeshConfig()), None)
            continue
        scale = 1 + 1e-6 * (nudge + 1)
        mix, sizes = build_mix(loaded.base, ("recycle", "lookup"), loaded.heads, 16, batch=BATCH,
                               costs=lambda s: tuple(c * scale for c in draft_size.default_costs(s)))
        if FIXED:
            sizes = DraftSizes((FIXED,), (scale,), sizes.depth)
        models[label] = (ShardedModel(loaded.base, mix, MeshConfig()), sizes)
    questions = mtbench_questions(max(PROMPTS) + 1)
    prompts = loaded.encode_chat([questions[i].first_turn for i in PROMPTS])
    mixed_drafts.compile_with(models, {label: fn for label, (_, fn) in arms.items()}, prompts, loaded.eos_ids,
                                    loaded.pad_id, batch=BATCH)
    rows = mixed_drafts.run_set(models, prompts, 128, loaded.eos_ids, loaded.pad_id, print, batch=BATCH,
                                repeats=REPEATS)
    results = {"machine": machine, "prompts": PROMPTS, "repeats": REPEATS, "batch": BATCH, "fixed": FIXED,
               "sizes": list(sizes.sizes), "costs": [round(c, 3) for c in sizes.costs],
               "methods": mixed_drafts.arm_figures(rows)}
    settings = " ".join(f"{k}={os.environ[k]}" for k in ("PROMPTS", "REPEATS", "BATCH", "FIXED") if k in os.environ)
    results["command"] = command = (settings + " " if settings else "") + "python bench/move_width_ab.py"
    name = f"results_batch{BATCH}" + (f"_fixed{FIXED}" if FIXED else "")
    title = (f"Every step {FIXED} nodes" if FIXED else "The mix as shipped") + f", {BATCH} row(s) a call"
    table = mixed_drafts.arm_table(title, command, machine, results)
    write_files(OUT, {f"{name}.json": json.dumps(results, indent=1) + "\n", f"{name}.md": table})
    print(table)


if __name__ == "__main__":
    main()
