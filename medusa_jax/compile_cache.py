"""JAX's persistent compilation cache for the command lines (`enable_compile_cache`: in $MEDUSA_JAX_CACHE/jax_compile;
MEDUSA_JAX_COMPILE_CACHE=0 turns it off, =DIR moves it; docs/design.md, "Caches on disk"), and `CompileCounter`: the
executables a block asked XLA for (`requests`), read from the persistent cache (`cache_hits`) or compiled afresh
(`compiles`), and the seconds spent tracing, lowering and compiling (`compile_seconds`). `MappingGuard`: a series of
compilations stopped with a clear error before it passes the kernel's limit on a process's memory mappings."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Callable

import jax

from medusa_jax.paths import cache_root

_REQUEST = "/jax/core/compile/backend_compile_duration"  # one per executable: compiled or read from the cache
_SECONDS_PREFIX = "/jax/core/compile/"
_HIT = "/jax/compilation_cache/cache_hits"
_counters: list["CompileCounter"] = []
MAPS_FILE, MAP_LIMIT_FILE = "/proc/self/maps", "/proc/sys/vm/max_map_count"
RAISED_MAP_LIMIT = 262144  # what the error suggests (the value several distributions now ship)


def compile_cache_dir() -> Path | None:
    """The cache folder the scripts use, or None when MEDUSA_JAX_COMPILE_CACHE=0."""
    choice = os.environ.get("MEDUSA_JAX_COMPILE_CACHE", "")
    if choice == "0":
        return None
    if choice:
        return Path(choice).expanduser()
    return cache_root() / "jax_compile"


def enable_compile_cache() -> Path | None:
    """Turns on the persistent cache (every executable, however fast it compiled); returns its folder."""
    folder = compile_cache_dir()
    if folder is None:
        return None
    folder.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return folder


@dataclasses.dataclass(eq=False)  # identity, not field equality: nested counters that read alike stay distinct
class CompileCounter:
    """`with CompileCounter() as c: ...` then c.compiles, c.cache_hits, c.requests, c.compile_seconds; counters
    nest (each counts what ran inside its own block)."""

    requests: int = 0
    cache_hits: int = 0
    compile_seconds: float = 0.0

    @property
    def compiles(self) -> int:
        """Executables XLA compiled afresh (not read from the persistent cache)."""
        return self.requests - self.cache_hits

    def summary(self) -> dict:
        """The counts the CLIs add to their JSON output."""
        return {"compiles": self.compiles, "compile_cache_hits": self.cache_hits}

    def __enter__(self) -> "CompileCounter":
        _counters.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _counters.remove(self)


def _on_duration(event: str, seconds: float, **_) -> None:
    for c in _counters:
        if event == _REQUEST:
            c.requests += 1
        if event.startswith(_SECONDS_PREFIX):
            c.compile_seconds += seconds


def _on_event(event: str, **_) -> None:
    if event == _HIT:
        for c in _counters:
            c.cache_hits += 1


jax.monitoring.register_event_duration_secs_listener(_on_duration)
jax.monitoring.register_event_listener(_on_event)


def memory_maps() -> tuple[int, int] | None:
    """(memory mappings this process holds, the kernel's limit on them: vm.max_map_count), or None where Linux's
    /proc does not tell."""
    try:
        with open(MAPS_FILE, "rb") as f:
            held = sum(1 for _ in f)
        return held, int(Path(MAP_LIMIT_FILE).read_text())
    except (OSError, ValueError):
        return None


class MappingLimitError(ValueError):
    """The next compilation would pass the process's limit on memory mappings."""


@dataclasses.dataclass
class MappingGuard:
    """Call `before(kind)` ahead of each compilation of a series (e.g. `GenerationEngine.warm_up`'s call shapes,
    the largest kind first).

    XLA:CPU maps each kernel of an executable it compiles or loads as its own memory mappings (code, data,
    read-only data): a SmolLM2 decode step holds about 1,900 of them, and a server's engine of 16 rows and 1,024
    slots 49,000 after its warm-up, against Linux's default limit of 65,530 per process. Past the limit LLVM
    aborts the process ("Unable to allocate section memory"). So `before(kind, left)` raises MappingLimitError when
    the mappings held plus what the `left` compilations of that kind still to come (this one included) add would
    pass the limit, each taken as the largest growth of one compilation of that kind seen so far (and the next one
    alone as `margin` times it), with what to do (`fix`): a series that cannot fit stops after its first
    compilation of each kind, not at its end. A kind's first compilation is checked against the mappings held
    alone, so a series compiles its largest kind first. `maps` reads (held, limit) (None: `memory_maps`; reading
    None checks nothing)."""

    what: str  # what is being compiled, for the error
    fix: str  # what the caller can lower, for the error
    margin: float = 1.25  # the largest step's growth is taken this many times
    maps: Callable[[], tuple[int, int] | None] | None = None
    _last: tuple[int, str] | None = None  # (held before the previous compilation, its kind)
    _largest: dict = dataclasses.field(default_factory=dict)  # kind -> the largest growth of one compilation

    def before(self, kind: str = "", left: int = 1) -> None:
        seen = (self.maps or memory_maps)()
        if seen is None:
            return
        held, limit = seen
        if self._last is not None:
            last_held, last_kind = self._last
            self._largest[last_kind] = max(self._largest.get(last_kind, 0), held - last_held)
        self._last = held, kind
        growth = self._largest.get(kind, 0)
        if held + max(self.margin, left) * growth > limit:
            raise MappingLimitError(
                f"compiling {self.what} would pass this machine's limit of {limit} memory mappings per process "
                f"({held} held; XLA:CPU maps each compiled kernel, about {growth} for each of the {left} calls "
                f"left): {self.fix}, or raise the limit (sudo sysctl -w vm.max_map_count={RAISED_MAP_LIMIT})")

    def after(self) -> None:
        """Ends the compilation (or the run that compiles) that the last `before` announced: its growth is taken now,
        not at the next `before`, so what the process compiles in between is not counted as its."""
        if self._last is None:
            return
        seen = (self.maps or memory_maps)()
        if seen is None:
            return
        last_held, last_kind = self._last
        self._largest[last_kind] = max(self._largest.get(last_kind, 0), seen[0] - last_held)
        self._last = None
