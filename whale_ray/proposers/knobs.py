"""Reading a harness: its top-level UPPERCASE knobs and functions (with libcst, so edits keep comments
and layout), a function's fingerprint, and the next sane value up and down for a numeric knob."""

from __future__ import annotations

import ast
import hashlib
import math
import re
from dataclasses import dataclass
from typing import Any, Iterator

import libcst as cst

_UPPER = re.compile(r"^[A-Z][A-Z0-9_]*$")


@dataclass(frozen=True)
class Knob:
    name: str
    value: Any  # int | float | bool | str
    literal: str  # the source of the value expression


def top_assignments(module: cst.Module) -> Iterator[tuple[int, int, str, cst.BaseExpression]]:
    """(statement index, small-statement index, name, value) of top-level `NAME = value` assignments."""
    for i, stmt in enumerate(module.body):
        if not isinstance(stmt, cst.SimpleStatementLine):
            continue
        for j, small in enumerate(stmt.body):
            if isinstance(small, cst.Assign) and len(small.targets) == 1 and isinstance(small.targets[0].target, cst.Name):
                yield i, j, small.targets[0].target.value, small.value
            elif isinstance(small, cst.AnnAssign) and isinstance(small.target, cst.Name) and small.value is not None:
                yield i, j, small.target.value, small.value


def read_knobs(module: cst.Module) -> dict[str, Knob]:
    """Top-level UPPERCASE constants whose value is a literal int, float, bool or str (last assignment wins)."""
    knobs: dict[str, Knob] = {}
    for _, _, name, value in top_assignments(module):
        if not _UPPER.match(name):
            continue
        literal = module.code_for_node(value)
        try:
            v = ast.literal_eval(literal.strip())
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            knobs.pop(name, None)
            continue
        if isinstance(v, (bool, int, float, str)) and not (isinstance(v, float) and not math.isfinite(v)):
            knobs[name] = Knob(name, v, literal)
        else:
            knobs.pop(name, None)
    return knobs


def read_functions(module: cst.Module) -> dict[str, cst.FunctionDef]:
    return {s.name.value: s for s in module.body if isinstance(s, cst.FunctionDef)}


def function_fingerprint(code: str, name: str) -> str | None:
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return None
    fns = [s for s in tree.body if isinstance(s, ast.FunctionDef) and s.name == name]
    if not fns:
        return None
    return hashlib.sha1(ast.dump(fns[-1]).encode()).hexdigest()[:12]


_TEMP_LADDER = (0.0, 0.2, 0.4, 0.6, 0.7, 0.8, 1.0, 1.2, 1.5)
_TOP_P_LADDER = (0.5, 0.7, 0.8, 0.9, 0.95, 1.0)


def _ladder(v: float, ladder: tuple[float, ...]) -> dict[str, float]:
    out = {}
    lower = [x for x in ladder if x < v - 1e-9]
    higher = [x for x in ladder if x > v + 1e-9]
    if lower:
        out["down"] = lower[-1]
    if higher:
        out["up"] = higher[0]
    return out


def numeric_steps(name: str, value: int | float) -> dict[str, int | float]:
    """The next value up and down for a numeric knob, within sane bounds for what its name says."""
    n = name.upper()
    is_int = isinstance(value, int)
    out: dict[str, int | float] = {}
    if "TEMP" in n:
        return _ladder(float(value), _TEMP_LADDER)
    if "TOP_P" in n:
        return _ladder(float(value), _TOP_P_LADDER)
    if value < 0:
        return {}
    if is_int and ("TURN" in n or "STEP" in n or "ROUND" in n):
        lo, hi = 1, max(16, value)
        out = {"up": max(value + 1, math.ceil(value * 1.5)), "down": min(value - 1, math.floor(value / 1.5))}
    elif is_int and "TOKEN" in n:
        lo, hi = min(16, value), max(4096, value)
        out = {"up": value * 2, "down": value // 2}
    elif is_int and ("VOTE" in n or "SAMPLE" in n):
        lo, hi = 1, max(9, value)
        out = {"up": value + 2, "down": value - 2}
    elif is_int and "TOP_K" in n:
        if value == 0:
            return {}  # 0 means "off" for top-k
        lo, hi = 1, max(200, value)
        out = {"up": value * 2, "down": value // 2}
    elif is_int:
        lo, hi = (0, 1) if value == 0 else (1, min(max(value * 8, 8), 1_000_000))
        out = {"up": 1} if value == 0 else {"up": value * 2, "down": value // 2}
    else:
        if value == 0:
            return {}
        lo, hi = value / 8, min(value * 8, 1e6)
        out = {"up": float(f"{value * 1.5:.3g}"), "down": float(f"{value / 1.5:.3g}")}
    clamped = {}
    for d, v in out.items():
        v = min(max(v, lo), hi)
        if v != value:
            clamped[d] = v
    return clamped


__all__ = ["Knob", "function_fingerprint", "top_assignments", "numeric_steps", "read_functions", "read_knobs"]
