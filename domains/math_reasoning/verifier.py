"""The strict \\boxed{} verifier of the math domain. Runs only in the trusted process.

A response is accepted when the content of its LAST \\boxed{...} (braces balanced, so
\\boxed{\\frac{1}{2}} works) equals the gold answer after normalisation:
  - surrounding whitespace, surrounding $...$, a trailing period, "\\!" spacing and a leading "+" go;
  - thousands commas go from plain integers ("1,000" -> "1000");
  - when both sides parse as numbers (integer, decimal, a/b or \\frac{a}{b}, with a sign) they are
    compared exactly as fractions.Fraction values ("0.5" == "1/2" == "\\frac{1}{2}");
  - when the gold is a number and the box's content is not, the decorations real models write around a
    number inside the box are taken off first (`numeric_core`): \\text{} / \\textbf{} / \\mathrm{} /
    \\mathbf{} wrappers, degree marks (^\\circ, °), units after the number ("14 cm", "14\\text{ cm}"),
    a "x =" in front, TeX thousands separators (1{,}000, 1\\,000), "%" / "$" signs and a Unicode minus;
  - otherwise the normalised strings, with all whitespace removed, must be equal.
No \\boxed{} (for instance "The answer is 14.") scores 0, and so does a None response: only the content of
the last box is ever normalised. The WHALE repository's verifier compares the last box's content with
the gold as an exact string, so a response like \\boxed{\\text{14}} or \\boxed{x = 14} scores 1 here
and 0 there (see skill.md).
"""

from __future__ import annotations

import re
from fractions import Fraction

from whale_ray.records import Task

BOXED = "\\boxed{"

_INT_WITH_COMMAS = re.compile(r"[+-]?\d{1,3}(,\d{3})+")
_DECIMAL = re.compile(r"[+-]?(\d+(\.\d+)?|\.\d+)")
_RATIO = re.compile(r"([+-]?\d+)/([+-]?\d+)")
_FRAC = re.compile(r"([+-]?)\\[dt]?frac\{([+-]?\d+)\}\{([+-]?\d+)\}")
# Decorations around a number inside the box (numeric_core).
_WRAPPER = re.compile(r"\\(?:text|textbf|textrm|textit|mathrm|mathbf|mathit|mbox|operatorname)\s*\{([^{}]*)\}")
_DEGREE = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|\\degree|°")
_VARIABLE = re.compile(r"^[A-Za-z]\s*=\s*")
_UNIT = re.compile(r"^([+-]?[\d.,/]+)\s*[A-Za-z][A-Za-z\s.]*$")  # a number, then words: "14 cm", "5 dollars"
_SEPARATORS = ("{,}", "\\,", "\\ ", "\\!", "\\%", "%", "\\$", "$")


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} with balanced braces, or None (also when it is never closed)."""
    start = text.rfind(BOXED)
    if start == -1:
        return None
    depth = 1
    for i in range(start + len(BOXED), len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start + len(BOXED) : i]
    return None  # the last \boxed{ is never closed (a truncated response): no answer


def normalize(answer: str) -> str:
    s = answer.strip()
    while len(s) >= 2 and s.startswith("$") and s.endswith("$"):
        s = s[1:-1].strip()
    s = s.replace("\\!", "")
    s = s.removesuffix(".").strip()
    s = s.removeprefix("+").strip()
    if _INT_WITH_COMMAS.fullmatch(s):
        s = s.replace(",", "")
    return s


def as_number(s: str) -> Fraction | None:
    """An exact value for an integer, decimal, a/b or \\frac{a}{b}; None for anything else."""
    s = s.replace(" ", "")
    if _DECIMAL.fullmatch(s):
        return Fraction(s)
    if m := _RATIO.fullmatch(s):
        sign, (num, den) = 1, m.groups()
    elif m := _FRAC.fullmatch(s):
        sign, num, den = (-1 if m.group(1) == "-" else 1), m.group(2), m.group(3)
    else:
        return None
    if int(den) == 0:
        return None
    return sign * Fraction(int(num), int(den))


def numeric_core(s: str) -> str:
    """The number a box's content writes, without the decorations around it ("\\text{x} = 1{,}000 cm" ->
    "1000"); other content comes back normalised but otherwise as it was."""
    s = s.replace("\u2212", "-")
    unwrapped = None
    while unwrapped != s:  # nested wrappers: \\textbf{\\text{14}}
        unwrapped, s = s, _WRAPPER.sub(r"\1", s)
    s = _DEGREE.sub("", s)
    for sep in _SEPARATORS:
        s = s.replace(sep, "," if sep == "{,}" else "")
    s = _VARIABLE.sub("", s.strip())
    if m := _UNIT.fullmatch(s.strip()):
        s = m.group(1)
    return normalize(s)


def answers_match(predicted: str, gold: str) -> bool:
    p, g = normalize(predicted), normalize(gold)
    pn, gn = as_number(p), as_number(g)
    if gn is not None and pn is None:
        pn = as_number(numeric_core(p))
    if pn is not None and gn is not None:
        return pn == gn
    return re.sub(r"\s+", "", p) == re.sub(r"\s+", "", g)


def gold_answer(gold: str) -> str:
    """The gold answer as stored; a gold that is itself boxed is unwrapped."""
    inner = last_boxed(gold)
    return inner if inner is not None else gold


def verify(task: Task, response: str | None) -> float:
    """1.0 when the last \\boxed{} of `response` matches the task's gold answer, else 0.0."""
    if not isinstance(response, str):
        return 0.0
    predicted = last_boxed(response)
    if predicted is None or not predicted.strip():
        return 0.0
    return 1.0 if answers_match(predicted, gold_answer(str(task.answer))) else 0.0
