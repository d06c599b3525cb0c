"""What a mixed step that skips the drafting costs against a plain step, and its parts: SmolLM2,
default+recycle+lookup@BUDGET (default 16), BATCH rows (default 1), context 256 of random prompt tokens, R interleaved rounds
(default 40), the median of each call over the plain step's (`step_cost.plain_step_call`, compiled as the plain
engine's). The skipped steps compile as the engine's tree steps over BATCH rows (`backbone.tree_step_compiler_options`). Every variant is `medusa.medusa_step` with the size choice set to skip (`SizeChoiceState.skip_left`
large; each call is checked to have skipped) and the drafter state reset per call, with parts taken out while it
is traced: prompt lookup's matching (`lookup_proposals`), the members' `verified` (Token Recycling's table update)
and `accepted`, the pending cache move (`finish_moves`). With XLA_FLAGS=--xla_cpu_multi_thread_eigen=false it
times process CPU time instead of wall time.

  python bench/skipped_step_cost.py
"""

import contextlib
import dataclasses
import os
import statistics
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from medusa_jax.assets import resolve_heads_dir
from medusa_jax.demo_model import prepare_smollm2
from medusa_jax.heads import mixed
from medusa_jax.heads.load import load_heads
from medusa_jax.heads.medusa import MedusaModel
from medusa_jax.hf.load import load_pretrained
from medusa_jax.inference import medusa
from medusa_jax.inference.acceptance import GREEDY
from medusa_jax.inference.autoregressive import plain_step
from medusa_jax.inference.mixed_decoding import build_mix
from medusa_jax.inference.sampling import SamplingConfig
from medusa_jax.inference.size_choice import SizeChoiceState
from medusa_jax.model.backbone import TREE_STEP_COMPILER_OPTIONS, tree_step_compiler_options
from medusa_jax.trees.policy import step_cost
from medusa_jax.bench.bench_inputs import env_int

BUDGET, CONTEXT, ROUNDS = env_int("BUDGET", 16, 1, 256), 256, env_int("R", 40, 1, 10000)
SKIP = 1 << 20  # steps left to skip: every timed step skips

base = load_pretrained(prepare_smollm2())
heads = load_heads(resolve_heads_dir("default"), base_config=base.config, base=base)
mix, sizes = build_mix(base, ("recycle", "lookup"), heads, BUDGET, costs=lambda s: tuple(1.0 for _ in s))
cache_size = CONTEXT + max(sizes.sizes) + 2 + sizes.depth
b, e = env_int("BATCH", 1, 1, 64), sizes.depth + 1
graphdef, params = nnx.split(MedusaModel(base, mix))
prompt_bt = jnp.asarray(np.random.default_rng(0).integers(100, 40000, (b, CONTEXT)), jnp.int32)
hidden_btd = jax.random.normal(jax.random.key(2), (b, CONTEXT, base.config.hidden_size), base.config.jnp_dtype)
draft = mix.init_draft(base, prompt_bt, jnp.full((b,), CONTEXT, jnp.int32), hidden_btd, cache_size, sizes.depth)
copied = partial(jax.tree.map, lambda x: jnp.array(x, copy=True))  # fresh buffers: the calls donate their state


def skipping_state() -> medusa.MedusaState:
    zeros_b = jnp.zeros((b,), jnp.int32)
    moves_be = jnp.broadcast_to(CONTEXT + jnp.arange(e, dtype=jnp.int32), (b, e))
    choice = dataclasses.replace(SizeChoiceState.start(sizes), skip_left=jnp.full((), SKIP, jnp.int32))
    hidden_bd = jax.random.normal(jax.random.key(1), (b, base.config.hidden_size), base.config.jnp_dtype)
    return copied(medusa.MedusaState(
        step_cost.make_cache(base, b, cache_size, CONTEXT), zeros_b + 7, hidden_bd, jnp.zeros((b, e), jnp.int32),
        zeros_b, jnp.zeros((b,), bool), zeros_b, jnp.zeros((b, e), jnp.int32), jnp.zeros((), jnp.int32),
        jax.random.key(0), moves_be, moves_be, draft, choice))


@contextlib.contextmanager
def patched(owner, name, value):
    old = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, old)


def skipped_step(*removed):
    """The step jitted with the parts `removed` (context managers) in force while it is traced."""
    @partial(jax.jit, donate_argnames=("state",), compiler_options=tree_step_compiler_options(b))
    def step(params, state):
        with contextlib.ExitStack() as stack:
            for part in removed:
                stack.enter_context(part())
            return medusa.medusa_step(nnx.merge(graphdef, params), state, tree=sizes, acceptance=GREEDY, eos_ids=())
    return step


class SkippedCall:
    def __init__(self, step):
        self.step, self.state = step, skipping_state()

    def __call__(self):
        s = self.state
        s = dataclasses.replace(s, cache=s.cache.replace(lengths_b=jnp.full_like(s.cache.lengths_b, CONTEXT)),
                                draft=copied(draft), num_out_b=jnp.zeros_like(s.num_out_b),
                                steps_b=jnp.zeros_like(s.steps_b),
                                choice=dataclasses.replace(s.choice, skip_left=jnp.full((), SKIP, jnp.int32)))
        self.state = self.step(params, s)
        return self.state.out_bo


@partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("state",),
         compiler_options=TREE_STEP_COMPILER_OPTIONS)
def plain_without_ynnpack(graphdef, params, state):
    return plain_step(nnx.merge(graphdef, params), state, sampling=SamplingConfig(), eos_ids=())


no_lookup = partial(patched, mixed.MixedDrafter, "lookup_proposals", lambda self, d, r: {})
no_verified = partial(patched, mixed.MixedDrafter, "verified", lambda self, d, *a: d)
no_accepted = partial(patched, mixed.MixedDrafter, "accepted", lambda self, d, *a: d)
no_moves = partial(patched, medusa.MedusaState, "finish_moves", lambda self: self.cache)
plain = step_cost.plain_step_call(base, b, CONTEXT, cache_size)
plain_graphdef, plain_params = nnx.split(base)
plain_no_ynn = step_cost.plain_step_call(base, b, CONTEXT, cache_size)
plain_no_ynn.step = lambda s: plain_without_ynnpack(plain_graphdef, plain_params, s)
calls = {"plain step without YNNPACK": plain_no_ynn,
         "skipped step": SkippedCall(skipped_step()),
         "  without lookup": SkippedCall(skipped_step(no_lookup)),
         "  without lookup, verified": SkippedCall(skipped_step(no_lookup, no_verified)),
         "  without lookup, verified, accepted": SkippedCall(skipped_step(no_lookup, no_verified, no_accepted)),
         "  and without the cache move": SkippedCall(skipped_step(no_lookup, no_verified, no_accepted, no_moves)),
         "  without the cache move only": SkippedCall(skipped_step(no_moves))}
for call in calls.values():
    if isinstance(call, SkippedCall):
        call()
        assert int(call.state.choice.skip_left) == SKIP - 1, "a timed step drafted"
cpu_time = "--xla_cpu_multi_thread_eigen=false" in os.environ.get("XLA_FLAGS", "")
clock = time.process_time if cpu_time else time.perf_counter
timed = [plain, *calls.values()]
for fn in timed:
    for _ in range(step_cost.WARM_UP_CALLS):
        jax.block_until_ready(fn())
times = [[] for _ in timed]
for _ in range(ROUNDS):
    for fn, acc in zip(timed, times):
        start = clock()
        jax.block_until_ready(fn())
        acc.append(clock() - start)
median = [statistics.median(t) for t in times]
print(f"@{BUDGET}, batch {b}: depth {sizes.depth}, cache {cache_size} slots, {'CPU' if cpu_time else 'wall'} time; "
      f"plain step {median[0] * 1e3:.2f} ms")
for name, m in zip(calls, median[1:]):
    print(f"{name:40s} {m / median[0]:.3f} of a plain step ({(m - median[0]) * 1e3:+.2f} ms)")
