"""Test-set leakage in candidate code: a candidate whose text holds a D_test question is rejected.

Texts are normalised (lower case, every run of non-alphanumeric characters, escapes included, becomes
one space), so quoting, escaping and line breaks do not hide a copy. A candidate leaks when its code
holds

  * a whole D_test question of at least `min_chars` normalised characters, or
  * any run of `shingle_words` consecutive words of a D_test question that appears in no question of
    the other splits (D_weight, D_harness, D_val): the proposer may legitimately quote D_harness
    questions it saw in traces, and template text shared by all splits is not evidence of a leak.

Short questions below `min_chars` are never matched (too likely to occur by chance).
"""

from __future__ import annotations

import re
from typing import Iterable

_NON_ALNUM = re.compile(r"[^0-9a-z]+")


def normalise(text: str) -> str:
    # literal escapes such as "\n" or "\"" in source code become separators too
    text = (text or "").replace("\\n", " ").replace("\\t", " ").lower()
    return _NON_ALNUM.sub(" ", text).strip()


def _shingles(words: list[str], k: int) -> set[str]:
    return {" ".join(words[i:i + k]) for i in range(len(words) - k + 1)}


class LeakageGuard:
    def __init__(self, test_texts: Iterable[str], other_texts: Iterable[str] = (), *,
                 shingle_words: int = 10, min_chars: int = 24) -> None:
        self.k = shingle_words
        self.min_chars = min_chars
        others = [normalise(t) for t in other_texts]
        other_shingles: set[str] = set()
        for o in others:
            other_shingles |= _shingles(o.split(), self.k)
        other_set = set(others)  # (the splits are disjoint; this guards hand-made ones)
        self.whole: set[str] = set()
        self.shingles: set[str] = set()
        for t in test_texts:
            norm = normalise(t)
            if len(norm) < self.min_chars:
                continue
            if norm not in other_set and not any(f" {norm} " in f" {o} " for o in others):
                self.whole.add(norm)
            self.shingles |= {s for s in _shingles(norm.split(), self.k) if len(s) >= self.min_chars} - other_shingles

    def __bool__(self) -> bool:
        return bool(self.whole or self.shingles)

    def check(self, code: str) -> str | None:
        """Why `code` leaks D_test (without quoting the test text), or None."""
        norm = normalise(code)
        padded = f" {norm} "
        for w in self.whole:
            if f" {w} " in padded:
                return "rejected as leakage: the code contains the text of a D_test question"
        words = norm.split()
        for i in range(len(words) - self.k + 1):
            if " ".join(words[i:i + self.k]) in self.shingles:
                return (f"rejected as leakage: the code contains {self.k} consecutive words of a D_test question "
                        "that appear in no other split")
        return None


__all__ = ["LeakageGuard", "normalise"]
