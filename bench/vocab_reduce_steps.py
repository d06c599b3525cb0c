"""The two-stage argmax and top-k (`model.vocab_reduce`) against the one-stage forms they replace, on SmolLM2
(vocabulary 49,152): (1) the reductions alone over 1 / 17 / 65 rows; (2) the plain step and the mixed step of
default+recycle+lookup@BUDGET (default 16) at each of its forced draft sizes (batch 1, context 256), each compiled
twice, once with the one-stage forms put back while it is traced. R interleaved rounds (default 20), medians.

  python bench/vocab_reduce_steps.py
"""

import contextlib
import statistics
import time
from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from medusa_jax.assets import resolve_heads_dir
from medusa_jax.demo_model import prepare_smollm2
from medusa_jax.heads.load import load_heads
from medusa_jax.heads.medusa import MedusaModel
from medusa_jax.hf.load import load_pretrained
from medusa_jax.inference import sampling
from medusa_jax.inference.acceptance import GREEDY
from medusa_jax.inference.autoregressive import plain_step
from medusa_jax.inference.draft_size import forced_sizes
from medusa_jax.inference.medusa import medusa_step
from medusa_jax.inference.mixed_decoding import build_mix
from medusa_jax.model import vocab_reduce
from medusa_jax.model.backbone import TREE_STEP_COMPILER_OPTIONS
from medusa_jax.trees.policy import step_cost
from medusa_jax.bench.bench_inputs import env_int

BUDGET, CONTEXT, ROUNDS = env_int("BUDGET", 16, 1, 256), 256, env_int("R", 20, 1, 10000)


one_stage_argmax = vocab_reduce._first_max  # the greedy argmax before the blocks: one two-reduction pass


@contextlib.contextmanager
def one_stage():
    """The one-stage forms in force (while a step is traced)."""
    saved = vocab_reduce.top_k, sampling.first_argmax
    vocab_reduce.top_k, sampling.first_argmax = jax.lax.top_k, one_stage_argmax
    try:
        yield
    finally:
        vocab_reduce.top_k, sampling.first_argmax = saved


def interleaved(calls: dict) -> dict:
    for fn in calls.values():
        for _ in range(step_cost.WARM_UP_CALLS):
            jax.block_until_ready(fn())
    times = {name: [] for name in calls}
    for _ in range(ROUNDS):
        for name, fn in calls.items():
            start = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


print("reductions over SmolLM2's vocabulary (ms, one-stage / two-stage):")
for rows in (1, 17, 65):
    x = jax.random.normal(jax.random.key(0), (rows, 49152))
    t = interleaved({"argmax 1": partial(jax.jit(one_stage_argmax), x),
                     "argmax 2": partial(jax.jit(vocab_reduce.first_argmax), x),
                     "top_k 1": partial(jax.jit(lambda x: jax.lax.top_k(x, 8)), x),
                     "top_k 2": partial(jax.jit(lambda x: vocab_reduce.top_k(x, 8)), x)})
    print(f"  {rows:3d} rows: argmax {t['argmax 1'] * 1e3:.3f} / {t['argmax 2'] * 1e3:.3f}, "
          f"top-8 {t['top_k 1'] * 1e3:.3f} / {t['top_k 2'] * 1e3:.3f}")

base = load_pretrained(prepare_smollm2())
heads = load_heads(resolve_heads_dir("default"), base_config=base.config, base=base)
mix, sizes = build_mix(base, ("recycle", "lookup"), heads, BUDGET, costs=lambda s: tuple(1.0 for _ in s))
cache_size = CONTEXT + max(sizes.sizes) + 2 + sizes.depth
graphdef, _ = nnx.split(MedusaModel(base, mix))
plain_graphdef, plain_params = nnx.split(base)


def tree_step(old: bool):
    @partial(jax.jit, static_argnames=("tree",), donate_argnames=("state",),
             compiler_options=TREE_STEP_COMPILER_OPTIONS)
    def step(params, state, *, tree):
        with one_stage() if old else contextlib.nullcontext():
            return medusa_step(nnx.merge(graphdef, params), state, tree=tree, acceptance=GREEDY, eos_ids=())
    return step


def plain(old: bool):
    @partial(jax.jit, donate_argnames=("state",))
    def step(params, state):
        with one_stage() if old else contextlib.nullcontext():
            return plain_step(nnx.merge(plain_graphdef, params), state, sampling=sampling.SamplingConfig(),
                              eos_ids=())
    call = step_cost.plain_step_call(base, 1, CONTEXT, cache_size)
    call.step = lambda s: step(plain_params, s)
    return call


calls = {}
for old in (True, False):
    calls[("plain", old)] = plain(old)
    step = tree_step(old)
    for n, forced in zip(sizes.sizes, forced_sizes(sizes.sizes, sizes.depth)):
        call = step_cost.medusa_step_call(base, mix, forced, 1, CONTEXT, cache_size)
        params = nnx.split(MedusaModel(base, mix))[1]
        call.step = partial(lambda s, p, f, st: st(p, s, tree=f), p=params, f=forced, st=step)
        calls[(n, old)] = call
t = interleaved(calls)
print(f"steps @{BUDGET}, batch 1, context {CONTEXT} (ms, one-stage / two-stage, ratio):")
for key in ["plain", *sizes.sizes]:
    old, new = t[(key, True)], t[(key, False)]
    print(f"  {'plain step' if key == 'plain' else f'size {key}':10s} {old * 1e3:7.2f} / {new * 1e3:7.2f}  "
          f"{new / old:.3f}")
