"""The generation engine's attention windows (`KVCache.window`, chosen per chunk by `row_decode.SlotReach`) against
the same engine attending over its whole cache (`EngineConfig(attention_windows=False)`): SmolLM2, MT-Bench first
turns (chat template, PROMPTS of them, categories in turn), 128 new tokens, greedy, plain rows (the server's
default) and, with MIX set, the mix default+recycle+lookup@16 (costs calibrated at the rows, cached), at ROWS rows
and each context of CONTEXTS (the server's --context: 1024 by default). Each engine runs all prompts once untimed
(compiling), then REPEATS interleaved timed rounds of `generate_all` (the median); the replies of both arms must
be the same tokens.

  python bench/attention_windows.py        (writes bench/attention_windows/{results.json,README.md})

Environment: ROWS (default 4,16), CONTEXTS (1024,4096), PROMPTS (32), REPEATS (3), MIX (0).
"""

import json
import os
import statistics
import time
from pathlib import Path

from medusa_jax.bench.bench_inputs import env_choices, env_int, mtbench_questions, write_files
from medusa_jax.compile_cache import enable_compile_cache
from medusa_jax.inference.generation_engine import EngineConfig, GenerationEngine
from medusa_jax.inference.engine_requests import RequestParams
from medusa_jax.inference.loaded_model import load_model
from medusa_jax.inference.mixed_decoding import build_mix
from medusa_jax.model.kv_cache import attention_windows
from medusa_jax.trees.policy.calibration import machine_description

ROWS = [int(r) for r in env_choices("ROWS", ("4", "16"), ("1", "2", "4", "8", "16", "32", "64"))]
CONTEXTS = [int(c) for c in env_choices("CONTEXTS", ("1024", "4096"), ("512", "1024", "2048", "4096", "8192"))]
PROMPTS = env_int("PROMPTS", 32, 1, 80)
REPEATS = env_int("REPEATS", 3, 1, 20)
MIX = env_int("MIX", 0, 0, 1)
OUT = Path(__file__).resolve().parent / "attention_windows"


def timed(engine: GenerationEngine, prompts, params) -> tuple[float, list, int]:
    steps = engine.metrics.row_steps
    start = time.perf_counter()
    replies = engine.generate_all(prompts, params)
    return time.perf_counter() - start, replies, engine.metrics.row_steps - steps


def main() -> None:
    enable_compile_cache()
    machine = machine_description()
    loaded = load_model("default", "default" if MIX else None)
    prompts = loaded.encode_chat([q.first_turn for q in mtbench_questions(PROMPTS)])
    params = RequestParams(max_tokens=128)
    runs = []
    for rows in ROWS:
        drafters = {"plain": {}}
        if MIX:
            mix, sizes = build_mix(loaded.base, ("recycle", "lookup"), loaded.heads, 16, batch=rows)
            drafters["mix"] = {"heads": mix, "tree": sizes}
        for context in CONTEXTS:
            for label, drafter in drafters.items():
                engines = {on: GenerationEngine(loaded.base, EngineConfig(rows=rows, context=context,
                                                                          attention_windows=on),
                                                eos_ids=loaded.eos_ids, pad_id=loaded.pad_id, **drafter)
                           for on in (True, False)}
                replies = {on: timed(engine, prompts, params)[1] for on, engine in engines.items()}  # compiles
                assert replies[True] == replies[False], (rows, context, label)
                seconds = {True: [], False: []}
                for round_ in range(REPEATS):
                    for on in ((True, False) if round_ % 2 == 0 else (False, True)):
                        s, got, _ = timed(engines[on], prompts, params)
                        assert got == replies[True]
                        seconds[on].append(s)
                tokens = sum(map(len, replies[True]))
                on, off = (statistics.median(seconds[x]) for x in (True, False))
                runs.append({"rows": rows, "context": context, "decoding": label, "tokens": tokens,
                             "windows": list(attention_windows(context)), "seconds_windows": round(on, 3),
                             "seconds_whole_cache": round(off, 3), "tokens_per_s_windows": round(tokens / on, 1),
                             "tokens_per_s_whole_cache": round(tokens / off, 1), "speedup": round(off / on, 3)})
                print(runs[-1], flush=True)
    settings = " ".join(f"{k}={os.environ[k]}" for k in ("ROWS", "CONTEXTS", "PROMPTS", "REPEATS", "MIX")
                        if k in os.environ)
    command = (settings + " " if settings else "") + "python bench/attention_windows.py"
    results = {"command": command, "machine": machine, "prompts": PROMPTS, "max_tokens": 128,
               "repeats": REPEATS, "runs": runs}
    lines = ["# Attention windows in the generation engine (SmolLM2-135M-Instruct, greedy, 128 new tokens)", "",
             f"Command: `{command}`", "",
             f"Machine: {machine['cpu']}, {machine['cpu_count']} cores, JAX {machine['jax']}, load average "
             f"{machine['load_average_1m']:.1f} at the start. {PROMPTS} MT-Bench first turns through the engine's "
             f"rows (`generate_all`); {REPEATS} interleaved rounds, the median. Same tokens in both arms.", "",
             "| decoding | rows | context | windows | tokens/s, windows | tokens/s, whole cache | speedup |",
             "|---|---|---|---|---|---|---|"]
    for r in runs:
        lines.append(f"| {r['decoding']} | {r['rows']} | {r['context']} | {'/'.join(map(str, r['windows']))} | "
                     f"{r['tokens_per_s_windows']} | {r['tokens_per_s_whole_cache']} | {r['speedup']:.3f}x |")
    write_files(OUT, {"results.json": json.dumps(results, indent=1) + "\n", "README.md": "\n".join(lines) + "\n"})
    print("\n".join(lines))


if __name__ == "__main__":
    main()
