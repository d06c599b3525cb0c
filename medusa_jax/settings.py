"""Settings declared once: a config dataclass field with the rule its value must meet (`setting`), checked where
the config is made (`check_settings`, from __post_init__) and, for the command-line flag that fills it, when the
flag is parsed (`scripts.options.add_fields`). A rule returns None, or what is wrong phrased as the fix ("must be
>= 1"); `each(rule)` checks every value of a comma-separated list."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

Rule = Callable[[Any], "str | None"]
SEED_MAX = 2**31 - 1  # seeds reach jitted code as int32


def _finite(value) -> bool:
    return not isinstance(value, float) or math.isfinite(value)


def at_least(low: float) -> Rule:
    def rule(value):
        if not _finite(value) or not value >= low:
            return f"must be a finite number >= {low}" if isinstance(value, float) else f"must be >= {low}"
        return None
    return rule


def above(low: float) -> Rule:
    def rule(value):
        if not _finite(value) or not value > low:
            return f"must be a finite number > {low}"
        return None
    return rule


def in_range(low: float, high: float, *, low_open: bool = False, high_open: bool = False) -> Rule:
    """low <= value <= high (strict at an open end)."""
    left, right = ("(" if low_open else "["), (")" if high_open else "]")

    def rule(value):
        ok = _finite(value) and (value > low if low_open else value >= low) and (
            value < high if high_open else value <= high)
        return None if ok else f"must be in {left}{low}, {high}{right}"
    return rule


SEED = in_range(0, SEED_MAX)


def each(rule: Rule) -> Rule:
    """For list values: every element passes `rule`, and the list is not empty."""
    def check(values):
        if not values:
            return "needs at least one value"
        for v in values:
            problem = rule(v)
            if problem:
                return f"every value {problem} (got {v})"
        return None
    return check


def each_or_none(rule: Rule) -> Rule:
    """Like `each`, but an empty list ('' = none of these) is allowed."""
    return lambda values: each(rule)(values) if values else None


def setting(default, rule: Rule | None = None):
    """A dataclass field of `default` whose value must pass `rule` (a None value, 'not given', passes)."""
    return dataclasses.field(default=default, metadata={"rule": rule})


def shown(value) -> str:
    """A value as its flag is written (a tuple comma-separated)."""
    return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)


def check_settings(config, error: type[ValueError] = ValueError) -> None:
    """Every field of the dataclass `config` declared with a rule (`setting`) passes it; else `error` naming the
    field, its value and the fix."""
    for field in dataclasses.fields(config):
        rule, value = field.metadata.get("rule"), getattr(config, field.name)
        problem = None if rule is None or value is None else rule(value)
        if problem:
            raise error(f"{field.name} {shown(value)}: {problem}")
