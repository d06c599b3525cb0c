"""Which collectives a compiled program runs inside its `while` loops (the per-token decode step).

Reads the text of an optimised HLO module (`jitted.lower(...).compile().as_text()`), finds the body and
condition computations of every `while`, follows the computations they call, and lists the collective
instructions found there with their result shapes. Used to check that a sharded decode step moves only
activations (all-reduces) and never gathers whole weights.
"""

from __future__ import annotations

import dataclasses
import re

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s+\(.*\)\s*->\s*.*\{\s*$")
_CALLED = re.compile(r"(?:condition|body|to_apply|calls|branch_computations|called_computations)="
                     r"(?:\{([^}]*)\}|(%?[\w.\-]+))")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.+?)\s+(" + "|".join(COLLECTIVES) +
                          r")(?:-start)?\(")


@dataclasses.dataclass(frozen=True)
class Collective:
    op: str  # one of COLLECTIVES
    shape: str  # the result type as printed, e.g. "f32[8,64]{1,0}"
    computation: str
    op_name: str = ""  # the JAX operation it came from (HLO metadata), e.g. ".../while/body/dot_general"

    @property
    def dims(self) -> tuple[int, ...]:
        match = re.search(r"\[([\d,]*)\]", self.shape)
        return tuple(int(d) for d in match.group(1).split(",") if d) if match else ()

    @property
    def num_elements(self) -> int:
        n = 1
        for d in self.dims:
            n *= d
        return n


def _computations(hlo_text: str) -> dict[str, list[str]]:
    out, current = {}, None
    for line in hlo_text.splitlines():
        match = _COMPUTATION.match(line)
        if match:
            current = match.group(1)
            out[current] = []
        elif line.strip() == "}":
            current = None
        elif current is not None:
            out[current].append(line)
    return out


def _callees(lines: list[str]) -> set[str]:
    names = set()
    for line in lines:
        for match in _CALLED.finditer(line):
            listed = match.group(1) if match.group(1) is not None else match.group(2)
            names.update(n.strip().lstrip("%") for n in listed.split(",") if n.strip())
    return names


def loop_collectives(hlo_text: str) -> list[Collective]:
    """Collectives executed inside any `while` loop of the module (nested calls included)."""
    comps = _computations(hlo_text)
    roots = set()
    for lines in comps.values():
        for line in lines:
            if re.search(r"\swhile\(", line):
                roots |= _callees([line])
    seen, todo = set(), list(roots)
    while todo:
        name = todo.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        todo.extend(_callees(comps[name]))
    found = []
    for name in sorted(seen):
        for line in comps[name]:
            match = _INSTRUCTION.match(line)
            if match:
                origin = re.search(r'op_name="([^"]*)"', line)
                found.append(Collective(match.group(2), match.group(1), name, origin.group(1) if origin else ""))
    return found


def large_loop_gathers(hlo_text: str, min_elements: int) -> list[Collective]:
    """All-gathers inside loops whose result holds at least `min_elements` values. Pass the size of the
    smallest per-device weight shard: a hit means a weight (or a big slice of one) is gathered every step."""
    return [c for c in loop_collectives(hlo_text) if c.op == "all-gather" and c.num_elements >= min_elements]
