"""The command lines' argument parser (argparse's, with a parse-time rule per numeric flag and one-line errors)
and the value rules; the parser's rules are in docs/modules.md."""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
from typing import Callable

from medusa_jax.inference import draft_size
from medusa_jax.model.sharding import MeshConfig
# the value rules live with the settings they check (medusa_jax.settings); the commands take them from here too
from medusa_jax.settings import SEED, Rule, above, at_least, each, each_or_none, in_range, shown  # noqa: F401
from medusa_jax.trees.policy import calibration


def environment_problem() -> str | None:
    """What is wrong with the settings a command reads from the environment when it calibrates
    ($MEDUSA_JAX_CALIBRATION, $MEDUSA_JAX_CALIBRATION_SECONDS), phrased with the fix; None when they are fine.
    Checked with the flags, so a bad value stops the command before any model loads."""
    for read in (calibration.default_mode, draft_size.default_budget):
        try:
            read()
        except ValueError as e:
            return str(e)
    return None


def _list_of(kind: type, what: str) -> Callable[[str], tuple]:
    """An argparse `type=` for comma-separated values of `kind` ('1,4,8' -> (1, 4, 8))."""
    def parse(text: str) -> tuple:
        try:
            return tuple(kind(x) for x in text.split(",") if x.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got {text!r}") from None
    return parse


parse_int_list = _list_of(int, "integers")
parse_float_list = _list_of(float, "numbers")


def parse_positive_int_list(text: str) -> tuple[int, ...]:
    """Like parse_int_list, but at least one value and every value >= 1 (sizes, counts)."""
    values = parse_int_list(text)
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


NUMERIC_TYPES = (int, float, parse_int_list, parse_positive_int_list, parse_float_list)


def mesh_spec(spec: str) -> str | None:
    """A --mesh string such as 'data=2,tensor=4' (axes data, fsdp, tensor, each >= 1)."""
    try:
        MeshConfig.parse(spec)
    except ValueError as e:
        return f"{e}; e.g. --mesh data=2,tensor=4"
    return None


def _flag(action: argparse.Action) -> str:
    return max(action.option_strings, key=len) if action.option_strings else action.dest


class _Checked:
    """add_argument(..., check=RULE): the rule rides on the action, for ArgumentParser.parse_args."""
    def add_argument(self, *args, check: Rule | None = None, **kwargs):
        action = super().add_argument(*args, **kwargs)
        action.check = check
        return action


class _CheckedGroup(_Checked, argparse._ArgumentGroup):
    pass


class ArgumentParser(_Checked, argparse.ArgumentParser):
    """argparse with a rule per flag (`add_argument(..., check=RULE)`, required of every numeric flag; floats must
    also be finite) and one-line `error: ...` messages, exit status 2 (docs/modules.md)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)

    def add_argument_group(self, *args, **kwargs):
        group = _CheckedGroup(self, *args, **kwargs)
        self._action_groups.append(group)
        return group

    def error(self, message: str):
        message = " ".join(message.split())  # one line, whatever a path or value holds
        if not message.startswith(("--", "$")) and "see --help" not in message:
            message += f" (see {self.prog} --help)"
        sys.stderr.write(f"error: {message}\n")
        sys.exit(2)

    @contextlib.contextmanager
    def checking(self):
        """`with p.checking():` a ValueError inside (a validate.UsageError among them) is a bad command line."""
        try:
            yield
        except ValueError as e:
            self.error(str(e))

    def parse_args(self, args=None, namespace=None):
        ns = super().parse_args(args, namespace)
        for action in self._actions:
            if action.dest is argparse.SUPPRESS or not hasattr(ns, action.dest):
                continue
            check = getattr(action, "check", None)
            if check is None and action.type in NUMERIC_TYPES:
                raise RuntimeError(f"{self.prog}: numeric flag {_flag(action)} has no check= rule")
            value = getattr(ns, action.dest)
            if value is None or isinstance(value, bool):
                continue
            if isinstance(value, float) and not math.isfinite(value):
                self.error(f"{_flag(action)} {value}: must be a finite number")
            problem = check(value) if check is not None else None
            if problem:
                self.error(f"{_flag(action)} {shown(value)}: {problem}")
        problem = environment_problem()
        if problem:
            self.error(problem)
        return ns


def run_mode(argv: list[str] | None, modes: dict[str, Callable[[list[str]], int]],
             default: Callable[[list[str]], int]) -> int:
    """A command with modes (`benchmark.py quick ...`): the mode its first argument names, else `default`."""
    argv = sys.argv[1:] if argv is None else list(argv)
    return modes[argv[0]](argv[1:]) if argv and argv[0] in modes else default(argv)
