"""Which collectives (and float32 weight copies) a compiled program runs, inside and outside its decode
`while` loop, read from the optimised HLO text."""

from __future__ import annotations

import dataclasses
import math
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
    return _collectives_in(comps, sorted(seen))


_ENTRY = re.compile(r"^ENTRY\s+%?([\w.\-]+)", re.M)
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def executed_collectives(hlo_text: str) -> tuple[list[Collective], list[Collective]]:
    """(collectives one decode-loop iteration runs, those run once per call), each repeated as often as it runs: a
    scan's body its trip count, a conditional its largest branch; the data-dependent while is the per-step part."""
    comps = _computations(hlo_text)
    entry = _ENTRY.search(hlo_text)
    step: list[Collective] = []
    once: list[Collective] = []

    def walk(name: str, times: int, in_step: bool, depth: int = 0) -> None:
        if name not in comps or depth > 64:
            return
        lines = comps[name]
        found = _collectives_in(comps, [name])
        (step if in_step else once).extend(found * times)
        for line in lines:
            branches = re.search(r"branch_computations=\{([^}]*)\}", line)
            if branches:  # a conditional runs one branch: the one with the most collectives counts
                runs = []
                for branch in (b.strip().lstrip("%") for b in branches.group(1).split(",") if b.strip()):
                    before = (len(step), len(once))
                    walk(branch, times, in_step, depth + 1)
                    runs.append((step[before[0]:], once[before[1]:]))
                    del step[before[0]:], once[before[1]:]
                most = max(runs, key=lambda r: len(r[0]) + len(r[1]), default=([], []))
                step.extend(most[0])
                once.extend(most[1])
            elif re.search(r"\swhile\(", line):
                trip = _TRIP_COUNT.search(line)
                for callee in _callees([line]):
                    if trip:
                        walk(callee, times * int(trip.group(1)), in_step, depth + 1)
                    else:  # the decode loop: what its body runs is per step
                        walk(callee, 1, True, depth + 1)
            else:
                for callee in _callees([line]):
                    walk(callee, times, in_step, depth + 1)

    if entry:
        walk(entry.group(1), 1, False)
    return step, once


def module_collectives(hlo_text: str) -> list[Collective]:
    """Every collective instruction of the module, in any computation (a branch of a conditional counts even
    when another branch runs)."""
    comps = _computations(hlo_text)
    return _collectives_in(comps, sorted(comps))


def _collectives_in(comps: dict[str, list[str]], names: list[str]) -> list[Collective]:
    found = []
    for name in names:
        for line in comps[name]:
            match = _INSTRUCTION.match(line)
            if match:
                found.append(Collective(match.group(2), match.group(1), name, _op_name(line)))
    return found


def _op_name(line: str) -> str:
    """The JAX operation an instruction came from (its HLO metadata's op_name), or ''."""
    origin = re.search(r'op_name="([^"]*)"', line)
    return origin.group(1) if origin else ""


def _definitions(lines: list[str]):
    """(name, opcode, the text after the opcode's parenthesis, result type, line) of each instruction."""
    for line in lines:
        match = _DEFINITION.match(line)
        if match:
            name, opcode, rest = match.groups()
            result = re.match(r"^\s*(?:ROOT\s+)?%[\w.\-]+\s*=\s*(.*?)\s" + re.escape(opcode) + r"\(", line)
            yield name, opcode, rest, result.group(1) if result else "", line


_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
          "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO result type, e.g. 'bf16[8,64]{1,0}' or a tuple '(f32[4], f32[4])' (summed)."""
    return sum(math.prod(int(d) for d in dims.split(",") if d) * _BYTES.get(dtype, 4)
               for dtype, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", shape))


_DEFINITION = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*.*?\s([a-z][\w\-]*)\((.*)$")


def _operands(rest: str) -> list[str]:
    """Operand names of an instruction, from the text after its opcode's opening parenthesis."""
    depth, end = 1, len(rest)
    for i, ch in enumerate(rest):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0:
            end = i
            break
    return re.findall(r"%([\w.\-]+)", rest[:end])


def invariant_gathers(hlo_text: str) -> list[Collective]:
    """All-gathers inside a `while` body whose input is loop-invariant: derived only from carried values the
    body passes through unchanged (the weights) and constants. Each is a weight re-gathered at every step."""
    comps = _computations(hlo_text)
    bodies = set()
    for lines in comps.values():
        for line in lines:
            match = re.search(r"\swhile\(.*\bbody=%?([\w.\-]+)", line)
            if match:
                bodies.add(match.group(1))
    found = []
    for body in sorted(bodies & set(comps)):
        defs, order, root = {}, [], None
        for name, opcode, rest, shape, line in _definitions(comps[body]):
            index = re.search(r"\bindex=(\d+)", rest)
            defs[name] = (opcode, _operands(rest), int(index.group(1)) if index else None, shape, line)
            order.append(name)
            if line.lstrip().startswith("ROOT"):
                root = name
        if root is None or defs[root][0] != "tuple":
            continue
        params = {n for n in order if defs[n][0] == "parameter"}
        passed = {i for i, operand in enumerate(defs[root][1])
                  if operand in defs and defs[operand][0] == "get-tuple-element"
                  and defs[operand][2] == i and defs[operand][1][:1] and defs[operand][1][0] in params}
        invariant = set()
        for name in order:
            opcode, operands, index, shape, line = defs[name]
            if opcode == "get-tuple-element" and operands[:1] and operands[0] in params:
                if index in passed:
                    invariant.add(name)
            elif opcode == "constant" or (operands and opcode not in ("parameter", "rng", "rng-bit-generator")
                                          and all(o in invariant for o in operands)):
                invariant.add(name)
            if opcode in ("all-gather", "all-gather-start") and operands and all(o in invariant for o in operands):
                found.append(Collective("all-gather", shape, body, _op_name(line)))
    return found


_MOVES = {"parameter", "convert", "bitcast", "copy", "concatenate", "reshape", "transpose"}


def entry_upcast_bytes(hlo_text: str) -> int:
    """Bytes of float32 copies the entry computation makes of bf16/f16 weights (data movement only), which a CPU
    compiler makes and a GPU/TPU compiler does not, so a memory plan compiled on CPU subtracts them."""
    comps = _computations(hlo_text)
    entry = next((name for name, lines in comps.items() if any(" parameter(" in l for l in lines)
                  and name.startswith("main")), None)
    return 0 if entry is None else _upcast_bytes(comps, entry)


def loop_upcast_bytes(hlo_text: str) -> int:
    """`entry_upcast_bytes`' weight copies made inside called computations (a loop body, a branch) instead; they run
    one at a time, so the largest set counts."""
    comps = _computations(hlo_text)
    entry = _ENTRY.search(hlo_text)
    fused = {m.group(1) for lines in comps.values() for line in lines if " fusion(" in line
             for m in re.finditer(r"\bcalls=%?([\w.\-]+)", line)}
    inner = [n for n in comps if n not in fused and (entry is None or n != entry.group(1))]
    return max((_upcast_bytes(comps, n, sources=("parameter", "get-tuple-element")) for n in inner), default=0)


def _upcast_bytes(comps: dict[str, list[str]], computation: str, sources: tuple[str, ...] = ("parameter",)) -> int:
    derived: dict[str, bool] = {}  # weight-derived value -> passed through a half-precision type
    total = 0
    for name, opcode, rest, shape, _ in _definitions(comps[computation]):
        half = bool(re.match(r"\(?(bf16|f16)\[", shape))
        ops = {opcode}
        if opcode == "fusion":
            called = re.search(r"\bcalls=%?([\w.\-]+)", rest)
            body = comps.get(called.group(1), []) if called else []
            ops = {m.group(2) for m in map(_DEFINITION.match, body) if m}
            half = half or any(re.search(r"=\s*(bf16|f16)\[", l) for l in body)
        operands = _operands(rest)
        if opcode == "parameter" or (opcode in sources and all(o in derived for o in operands)):
            derived[name] = half
            continue
        if not ops <= _MOVES or not operands or not all(o in derived for o in operands):
            continue
        derived[name] = half = half or any(derived[o] for o in operands)
        if half and shape.startswith("f32["):
            total += shape_bytes(shape)
            if "concatenate" in ops:  # a stack of layers: the GPU holds it in bf16
                total -= shape_bytes(shape) // 2
    return total
