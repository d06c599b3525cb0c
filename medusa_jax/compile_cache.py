"""JAX's persistent compilation cache for the command lines (`enable_compile_cache`: in $MEDUSA_JAX_CACHE/jax_compile;
MEDUSA_JAX_COMPILE_CACHE=0 turns it off, =DIR moves it; docs/design.md, "Caches on disk"), and `CompileCounter`: the
executables a block asked XLA for (`requests`), read from the persistent cache (`cache_hits`) or compiled afresh
(`compiles`), and the seconds spent tracing, lowering and compiling (`compile_seconds`)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import jax

from medusa_jax.paths import cache_root

_REQUEST = "/jax/core/compile/backend_compile_duration"  # one per executable: compiled or read from the cache
_SECONDS_PREFIX = "/jax/core/compile/"
_HIT = "/jax/compilation_cache/cache_hits"
_counters: list["CompileCounter"] = []


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
