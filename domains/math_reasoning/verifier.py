"""The strict \\boxed{} verifier of the math domain. Runs only in the trusted process.

A response is accepted when the content of its LAST \\boxed{...} (braces balanced, so
\\boxed{\\frac{1}{2}} works) equals the gold answer after normalisation:
  - surrounding whitespace, surrounding $...$, a trailing period, "\\!" spacing and a leading "+" go;
  - thousands commas go from plain integers ("1,000" -> "1000");
  - when both sides parse as numbers (integer, decimal, a/b or \\frac{a}{b}, with a sign) they are
    compared exactly as fractions.Fraction values ("0.5" == "1/2" == "\\frac{1}{2}");
  - otherwise the normalised strings, with all whitespace removed, must be equal.
No \\boxed{} (for instance "The answer is 14.") scores 0, and so does a None response.
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


def answers_match(predicted: str, gold: str) -> bool:
    p, g = normalize(predicted), normalize(gold)
    pn, gn = as_number(p), as_number(g)
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
