"""`compile_cache.MappingGuard`: a series of compilations (the generation engine's warm-up) stops with one clear
error before it passes the process's limit on memory mappings, where XLA:CPU's compiler would fail with "Cannot
allocate memory"."""

from __future__ import annotations

import pytest

from medusa_jax import compile_cache
from medusa_jax.compile_cache import CompileCounter, MappingGuard, MappingLimitError, memory_maps
from medusa_jax.hf.load import load_pretrained
from medusa_jax.inference.generation_engine import EngineConfig, GenerationEngine


def test_this_process_reports_its_mappings_and_their_limit():
    seen = memory_maps()
    if seen is None:
        pytest.skip("no /proc/self/maps here")
    held, limit = seen
    assert 0 < held < limit


def test_the_guard_stops_before_the_compilation_that_would_pass_the_limit():
    """Each compilation adds 300 mappings under a limit of 2,000: the guard lets them run while the held ones plus
    1.25 times the largest step so far fit, and raises before the one that would not, naming the limit and fix."""
    held = [1000]
    guard = MappingGuard("the shapes", "use fewer of them", maps=lambda: (held[0], 2000))
    ran = 0
    with pytest.raises(MappingLimitError) as error:
        for _ in range(10):
            guard.before()
            held[0] += 300  # the compilation
            ran += 1
    assert ran == 3  # held 1000 (no step seen yet), 1300 + 375 and 1600 + 375 fit; 1900 + 375 does not
    message = str(error.value)
    assert "2000 memory mappings" in message and "use fewer of them" in message
    assert "vm.max_map_count=262144" in message and "\n" not in message


def test_each_kind_of_compilation_is_estimated_by_its_own_largest_step():
    """Two chunks of 2,000 mappings, then admissions of 100 under a limit of 6,000: the admissions are estimated by
    their own growth (a kind's first one by the mappings held alone), so they run until 100 more would not fit."""
    held = [1000]
    guard = MappingGuard("the shapes", "fewer", maps=lambda: (held[0], 6000))
    for _ in range(2):
        guard.before("chunk")
        held[0] += 2000
    admissions = 0
    with pytest.raises(MappingLimitError, match="about 100 for each of the 1 calls left"):
        while True:
            guard.before("admission")
            held[0] += 100
            admissions += 1
    assert admissions == 9  # 5000 + 9 x 100 = 5900 held; 5900 + 125 > 6000
    with pytest.raises(MappingLimitError, match="about 2000"):
        guard.before("chunk")


def test_a_series_that_cannot_fit_stops_after_the_first_compilation_of_its_kind():
    """20 admissions of 100 mappings each left, 1,500 free: the guard projects them all after the first one and
    stops there, instead of compiling 14 of them first."""
    held = [4500]
    guard = MappingGuard("the shapes", "fewer", maps=lambda: (held[0], 6000))
    guard.before("admission", 20)  # the first: its growth unknown yet
    held[0] += 100
    with pytest.raises(MappingLimitError, match="about 100 for each of the 19 calls left"):
        guard.before("admission", 19)
    held = [4500]
    fits = MappingGuard("the shapes", "fewer", maps=lambda: (held[0], 6000))
    for left in range(14, 0, -1):  # 14 x 100 fit in 1,500
        fits.before("admission", left)
        held[0] += 100


def test_without_proc_nothing_is_checked():
    guard = MappingGuard("x", "y", maps=lambda: None)
    for _ in range(3):
        guard.before()


def test_an_engine_warm_up_near_the_limit_fails_before_compiling_every_shape(tiny_model_dir, monkeypatch):
    """A process that already holds its limit but for one mapping: the engine's warm-up raises the guard's error
    (its message ends in the caller's fix) before it has compiled all of its 2 x 2 admission shapes and chunk."""
    model = load_pretrained(tiny_model_dir("llama"))
    engine = GenerationEngine(model, EngineConfig(rows=2, context=128, chunk_steps=2), eos_ids=())
    real = memory_maps()
    if real is None:
        pytest.skip("no /proc/self/maps here")
    limit = real[0] + 1
    monkeypatch.setattr(compile_cache, "memory_maps", lambda: (memory_maps_now(), limit))
    with CompileCounter() as compiles, pytest.raises(MappingLimitError,
                                                      match="lower --batch-size or --context, or raise the limit"):
        engine.warm_up(fix="lower --batch-size or --context")
    assert compiles.requests < 5


def memory_maps_now() -> int:
    with open(compile_cache.MAPS_FILE, "rb") as f:
        return sum(1 for _ in f)


def test_what_runs_between_two_announced_compilations_is_not_counted_as_theirs():
    """`after` ends the growth of the run `before` announced: 200 mappings added by other work before the next
    `before` are not taken as that kind's step (with them, 1500 + 1.25 * 500 would pass the limit of 2,000)."""
    held = [1000]
    guard = MappingGuard("the shapes", "fewer", maps=lambda: (held[0], 2000))
    guard.before("run")
    held[0] += 300  # the announced run
    guard.after()
    held[0] += 200  # other work
    guard.before("run")  # 1500 + 1.25 * 300 fits
    assert guard._largest == {"run": 300}


@pytest.mark.parametrize("engine", ["batches", "refill"])
def test_batch_calls_stop_before_a_new_engine_that_would_pass_the_limit(tiny_model_dir, monkeypatch, engine):
    """`generate_batch` checks the process's mappings before a new engine runs a cache size's batches (`engine_batches.
    MAPPINGS`): a first call that added 500 mappings under a limit of 2,200 answers; with 1,750 held, a call whose
    sorted batches restart the last engine (the same shapes: nothing to compile) answers too, and one that needs a
    new engine (refilled slots always do) stops with one error line naming what to run fewer of."""
    from medusa_jax.inference import engine_batches
    from medusa_jax.inference.api import generate_batch
    from medusa_jax.inference.batch_run import BatchSettings
    from medusa_jax.inference.sharded import ShardedModel
    from medusa_jax.model.sharding import MeshConfig

    reads = iter([1000, 1500])  # before and after the first call; 1,750 from then on
    monkeypatch.setattr(engine_batches, "MAPPINGS", MappingGuard(
        engine_batches.MAPPINGS.what, engine_batches.MAPPINGS.fix, maps=lambda: (next(reads, 1750), 2200)))
    model = ShardedModel(load_pretrained(tiny_model_dir("llama")), None, MeshConfig())
    settings = BatchSettings(batch_size=2, max_new_tokens=3, engine=engine)
    prompts = [[5, 6, 7], [8, 9]]
    assert [len(r.token_ids) for r in generate_batch(model, prompts, settings, progress=False).results] == [3, 3]
    if engine == "batches":
        again = generate_batch(model, prompts, settings, progress=False)
        assert [len(r.token_ids) for r in again.results] == [3, 3]
        settings = BatchSettings(batch_size=3, max_new_tokens=3, engine=engine)  # a new engine: 3 rows
    with pytest.raises(MappingLimitError) as error:
        generate_batch(model, prompts + [[4]], settings, progress=False)
    message = str(error.value)
    assert "2200 memory mappings" in message and "max_new_tokens" in message and "\n" not in message
