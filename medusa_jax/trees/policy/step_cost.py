"""What a decode step costs on this machine: the plain step and the whole Medusa tree step, timed as the decode
loops run them, and the table of step seconds by tree size that tree choice (`inference.tree_choice`) sizes
trees with.

The whole step is the function the decode loop runs as its `while_loop` body, `medusa.medusa_step` (a
MedusaState in, a MedusaState out: what a loop iteration costs, XLA fusing across pieces, token bookkeeping
included), jitted alone; the plain step is likewise the plain loop's body, `autoregressive.plain_step`
(t = 1 forward + lm_head + argmax). States are donated so writes are in place, as in the decode loops.
Values do not matter for cost, so weights are used as given (random or real) and the cache holds zeros.
Where the time of a step goes, piece by piece, is profiling: `medusa_jax.bench.step_cost`.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from functools import partial
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from medusa_jax.model.backbone import CausalLM, tree_step_jit
from medusa_jax.model.kv_cache import KVCache
from medusa_jax.heads.medusa import MedusaHeads, MedusaModel
from medusa_jax.trees.tree import DynamicTree, TreeBuffers
from medusa_jax.inference.acceptance import GREEDY
from medusa_jax.inference.autoregressive import PlainState, plain_step
from medusa_jax.inference.medusa import MedusaState, medusa_step
from medusa_jax.inference.sampling import SamplingConfig

# Untimed calls before timing a jitted call: the second call compiles again when the first call's inputs were
# fresh, uncommitted arrays, and the third still ran far slower than the rest (docs/design.md, "Step costs are
# measured where the heads decode"), which a median of 2 rounds does not remove.
WARM_UP_CALLS = 3


def time_call(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of `fn()` after `WARM_UP_CALLS` untimed calls."""
    for _ in range(WARM_UP_CALLS):
        jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_interleaved(calls: Sequence[Callable[[], object]], rounds: int) -> list[float]:
    """Median seconds of each call, timing them in turn round after round (after `WARM_UP_CALLS` calls each),
    so that a change in machine load affects every call alike."""
    for fn in calls:
        for _ in range(WARM_UP_CALLS):
            jax.block_until_ready(fn())
    times: list[list[float]] = [[] for _ in calls]
    for _ in range(rounds):
        for fn, acc in zip(calls, times):
            start = time.perf_counter()
            jax.block_until_ready(fn())
            acc.append(time.perf_counter() - start)
    return [statistics.median(acc) for acc in times]


def _medusa_step(graphdef, params, state: MedusaState, *, tree: TreeBuffers | DynamicTree) -> MedusaState:
    """`medusa.medusa_step`, the Medusa decode loop's body (greedy, the heads' proposal), jitted alone by
    `_medusa_step_jit` as the engine's tree steps are (`drafted_rows.drafted_chunk`: the options of its rows)."""
    return medusa_step(nnx.merge(graphdef, params), state, tree=tree, acceptance=GREEDY, eos_ids=())


def _medusa_step_jit(rows: int) -> Callable:
    return tree_step_jit(_medusa_step, rows, static_argnames=("graphdef", "tree"), donate_argnames=("state",))


@partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("state",))
def _plain_step(graphdef, params, state: PlainState) -> PlainState:
    """`autoregressive.plain_step`, the plain decode loop's body (greedy), jitted alone."""
    return plain_step(nnx.merge(graphdef, params), state, sampling=SamplingConfig(), eos_ids=())


def release_executables() -> None:
    """Drops the executables of the steps timed here (each call's plain and Medusa step): a calibration's are not
    used again, and XLA:CPU holds each one's kernels as memory mappings, of which a process may hold a limited
    number (`compile_cache.MappingGuard`). A later timing compiles again, or reads JAX's persistent cache."""
    _plain_step.clear_cache()
    for rows in (1, 2):  # one row's compile options, and every larger batch's
        _medusa_step_jit(rows).clear_cache()


class _SteppedState:
    """Calls step(state) repeatedly, feeding each call's returned (donated) state into the next, reset to the
    same committed context and an empty output so that every call does the same work."""

    def __init__(self, step: Callable, state, context: int):
        self.step, self.state, self.context = step, state, context

    def __call__(self):
        s = self.state
        fresh = dataclasses.replace(s, cache=s.cache.replace(lengths_b=jnp.full_like(s.cache.lengths_b, self.context)),
                                    num_out_b=jnp.zeros_like(s.num_out_b))
        if isinstance(fresh, MedusaState):
            fresh = dataclasses.replace(fresh, steps_b=jnp.zeros_like(fresh.steps_b))
        self.state = self.step(fresh)
        return self.state.out_bo


def make_cache(base: CausalLM, batch: int, cache_size: int, context: int) -> KVCache:
    cache = KVCache.zeros(base.config, batch, cache_size)
    return cache.replace(lengths_b=jnp.full((batch,), context, jnp.int32))


def plain_step_call(base: CausalLM, batch: int, context: int, cache_size: int) -> Callable[[], object]:
    """A zero-argument call that runs one plain step over its own (donated, reused) state."""
    graphdef, params = nnx.split(base)
    b = batch
    state = PlainState(make_cache(base, b, cache_size, context), jnp.zeros((b,), jnp.int32),
                       jnp.zeros((b, 1), jnp.int32), jnp.zeros((b,), jnp.int32), jnp.ones((b,), jnp.int32),
                       jnp.zeros((b,), bool), jax.random.key(0))
    return _SteppedState(lambda s: _plain_step(graphdef, params, s), state, context)


def medusa_step_call(base: CausalLM, heads: MedusaHeads, tree: TreeBuffers | DynamicTree, batch: int, context: int,
                     cache_size: int) -> Callable[[], object]:
    """A zero-argument call that runs one whole Medusa step (all pieces in one jitted call), for a static tree or
    a dynamic one (drafted every step, `heads.dynamic_tree`), or a mix's draft sizes (`draft_merge.DraftSizes`); a
    drafter that keeps a state (the EAGLE-style one, a mix's members) starts from its state after a prefill of
    `context` tokens."""
    graphdef, params = nnx.split(MedusaModel(base, heads))
    b, e = batch, tree.depth + 1  # an output buffer that holds one step's tokens
    hidden_bd = jax.random.normal(jax.random.key(1), (b, base.config.hidden_size), base.config.jnp_dtype)
    zeros_b = jnp.zeros((b,), jnp.int32)
    moves_be = jnp.broadcast_to(context + jnp.arange(e, dtype=jnp.int32), (b, e))  # a pending move of e slots
    hidden_btd = None  # as the decode loops: a drafter's state from the prompt (its hidden states when it reads them)
    if heads.needs_prompt_hidden:
        hidden_btd = jnp.broadcast_to(jnp.tile(hidden_bd, max(len(heads.feature_layers), 1))[:, None],
                                      (b, context, hidden_bd.shape[-1] * max(len(heads.feature_layers), 1)))
    draft = heads.init_draft(base, jnp.zeros((b, context), jnp.int32), jnp.full((b,), context, jnp.int32),
                             hidden_btd, cache_size, tree.depth)
    # the state's own buffers: the step donates them, and a drafter may start from an array it keeps (Token
    # Recycling's table, when nothing refreshes it from the prompt)
    draft = jax.tree.map(lambda x: jnp.array(x, copy=True), draft)
    state = MedusaState(make_cache(base, b, cache_size, context), zeros_b, hidden_bd, jnp.zeros((b, e), jnp.int32),
                        zeros_b, jnp.zeros((b,), bool), zeros_b, jnp.zeros((b, e), jnp.int32),
                        jnp.zeros((), jnp.int32), jax.random.key(0), moves_be,
                        jnp.array(moves_be, copy=True), draft)  # src and dst: two buffers, both donated
    step = _medusa_step_jit(b)
    return _SteppedState(lambda s: step(graphdef, params, s, tree=tree), state, context)


def plain_step_seconds(base: CausalLM, batch: int, context: int, cache_size: int, repeats: int = 5) -> float:
    return time_call(plain_step_call(base, batch, context, cache_size), repeats)


def medusa_step_seconds(base: CausalLM, heads: MedusaHeads, tree: TreeBuffers, batch: int, context: int,
                        cache_size: int, repeats: int = 5) -> float:
    """Seconds of one whole Medusa step (all pieces in one jitted call)."""
    return time_call(medusa_step_call(base, heads, tree, batch, context, cache_size), repeats)


@dataclasses.dataclass(frozen=True)
class StepCostTable:
    """Step seconds by tree size for one batch size: the curve tree choice sizes trees with; and the step seconds
    of dynamic trees (by name, `DynamicTree.name`), timed in the same rounds."""

    batch: int
    context: int
    cache_size: int
    plain_seconds: float
    num_tree_tokens: tuple[int, ...]
    medusa_seconds: tuple[float, ...]
    dynamic_trees: tuple[str, ...] = ()
    dynamic_seconds: tuple[float, ...] = ()

    def overhead(self) -> list[float]:
        return [s / self.plain_seconds for s in self.medusa_seconds]

    def dynamic_step_seconds(self, tree: DynamicTree) -> float | None:
        """The timed step of this dynamic tree, None if it was not timed."""
        return dict(zip(self.dynamic_trees, self.dynamic_seconds)).get(tree.name)


def measure_step_costs(base: CausalLM, heads: MedusaHeads, trees: Sequence[TreeBuffers], *, batch: int = 1,
                       context: int = 256, cache_size: int | None = None, repeats: int = 5,
                       progress: Callable[[str], None] | None = None,
                       dynamic: Sequence[DynamicTree] = ()) -> StepCostTable:
    """The whole-step time of each tree (sorted by size), of each dynamic tree and of a plain step, same batch and
    context, timed in interleaved rounds (each call keeps its own cache, so memory grows with the number of
    trees)."""
    if not trees:
        raise ValueError("need at least one tree to measure")
    trees = sorted(trees, key=lambda t: t.num_tokens)
    largest = max([trees[-1].num_tokens] + [t.num_tokens for t in dynamic])
    deepest = max([trees[-1].depth] + [t.depth for t in dynamic])
    cache_size = cache_size or context + 2 * largest + 64
    if cache_size < context + largest + deepest + 1:
        raise ValueError(f"cache_size {cache_size} cannot hold context {context} + a {largest}-token tree")
    calls = [plain_step_call(base, batch, context, cache_size)]
    calls += [medusa_step_call(base, heads, tree, batch, context, cache_size) for tree in trees]
    calls += [medusa_step_call(base, heads, tree, batch, context, cache_size) for tree in dynamic]
    plain, *seconds = time_interleaved(calls, repeats)
    del calls
    release_executables()
    static_seconds, dynamic_seconds = seconds[: len(trees)], seconds[len(trees):]
    if progress:
        for name, s in [(f"T={t.num_tokens}", s) for t, s in zip(trees, static_seconds)] + [
                (t.name, s) for t, s in zip(dynamic, dynamic_seconds)]:
            progress(f"B={batch} {name}: {s * 1e3:.2f} ms/step (plain {plain * 1e3:.2f} ms, x{s / plain:.2f})")
    return StepCostTable(batch, context, cache_size, plain, tuple(t.num_tokens for t in trees), tuple(static_seconds),
                         tuple(t.name for t in dynamic), tuple(dynamic_seconds))
