"""The search_qa verifier: exact match in Search-R1's format, and an optional LLM judge. Trusted side only.

Exact match (`verify`): the text inside the LAST <answer>...</answer> of the response, normalised as in
SQuAD / Search-R1 (lowercase, punctuation removed, the articles a/an/the removed, whitespace collapsed),
must equal some gold answer normalised the same way. No <answer> tags, or a None response, scores 0.

The judge (`JudgedVerifier`, used when the `judge` section is enabled): exact match first; only when it fails, and
an <answer> was given, an OpenAI-compatible chat model is asked whether the answer means the same as a
gold answer. Any judge failure (network, timeout, an odd reply) counts as 0 and is logged: a judge
outage never stops a run.
"""

from __future__ import annotations

import logging
import os
import re
import string
from typing import TYPE_CHECKING, Any, Iterable

from whale_ray.records import Task

if TYPE_CHECKING:
    from .config import JudgeConfig

log = logging.getLogger(__name__)

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)

JUDGE_PROMPT = (
    "You grade answers to questions. Reply with exactly one word: yes or no.\n\n"
    "Question: {question}\nGold answers: {gold}\nPredicted answer: {predicted}\n\n"
    "Does the predicted answer mean the same as one of the gold answers?"
)


def normalize_answer(text: str) -> str:
    text = text.lower().translate(_PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def extract_answer(response: str | None) -> str | None:
    """The content of the last <answer>...</answer>, or None."""
    if not isinstance(response, str):
        return None
    matches = _ANSWER.findall(response)
    return matches[-1].strip() if matches else None


def exact_match_any(predicted: str | None, golds: Iterable[str]) -> bool:
    if predicted is None:
        return False
    p = normalize_answer(predicted)
    return any(p == normalize_answer(g) for g in golds)


def golden_answers(task: Task) -> list[str]:
    """Every accepted answer: the private list when the loader kept one, else the task's answer."""
    golds = task.meta.get("_golden_answers")
    return [str(g) for g in golds] if golds else [task.answer]


def verify(task: Task, response: str | None) -> float:
    return 1.0 if exact_match_any(extract_answer(response), golden_answers(task)) else 0.0


def contains_answer(text: str, golds: Iterable[str]) -> bool:
    """A gold answer appears, as whole normalised words, in `text` (for retrieval accuracy)."""
    haystack = f" {normalize_answer(text)} "
    return any(n and f" {n} " in haystack for n in (normalize_answer(g) for g in golds))


class JudgedVerifier:
    """Exact match, else an LLM judge's yes/no. Picklable: the client is made on first use."""

    def __init__(self, judge: "JudgeConfig"):
        if not judge.model:
            raise ValueError("judge.enabled needs judge.model (the judge's model name)")
        if not os.environ.get(judge.api_key_env):
            raise ValueError(f"judge.enabled: the environment variable {judge.api_key_env} (judge.api_key_env) "
                             "holding the judge's API key is not set")
        self.judge = judge
        self._client: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {"judge": self.judge, "_client": None}

    def _get_client(self) -> Any:
        if self._client is None:
            from openai import OpenAI

            j = self.judge
            self._client = OpenAI(base_url=j.base_url, api_key=os.environ.get(j.api_key_env), timeout=j.timeout_s,
                                  max_retries=j.max_retries)
        return self._client

    def ask(self, question: str, golds: list[str], predicted: str) -> bool:
        """The judge's verdict; raises on any failure to get one."""
        prompt = JUDGE_PROMPT.format(question=question, gold=" | ".join(golds), predicted=predicted)
        reply = self._get_client().chat.completions.create(
            model=self.judge.model, messages=[{"role": "user", "content": prompt}])
        text = (reply.choices[0].message.content or "").strip().lower()
        word = text.split()[0].strip(string.punctuation) if text.split() else ""
        if word not in ("yes", "no"):
            raise ValueError(f"the judge replied {text[:60]!r}, not yes or no")
        return word == "yes"

    def __call__(self, task: Task, response: str | None) -> float:
        if verify(task, response):
            return 1.0
        predicted = extract_answer(response)
        if not predicted:
            return 0.0
        try:
            return 1.0 if self.ask(task.question, golden_answers(task), predicted) else 0.0
        except Exception as e:  # the judge's failure is not the agent's success: 0, and say so
            log.warning("judge failed on task %s (%s: %s); scored 0", task.id, type(e).__name__, str(e)[:200])
            return 0.0
