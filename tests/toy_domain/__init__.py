"""A toy fourth domain, living in the tests folder only: "how many letters are in the word W?".

It proves a domain plugs in without an edit in the core: the config names it by import path
(`domain: tests.toy_domain`), its package registers it, its own config section (`toy:`) is validated by
its model, and it has its own h0, tools, skill text, verifier and warm-start conversations.
"""

from __future__ import annotations

import random
import re
import string
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from whale_ray.domain import (
    AnswerFormat,
    DataError,
    DataSpec,
    Domain,
    DomainConfig,
    Splits,
    register_domain,
    split_sizes,
)
from whale_ray.records import Task

SYSTEM_PROMPT = "Count the letters. Put the count in <answer></answer>."
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


class ToySection(BaseModel):
    model_config = ConfigDict(extra="forbid")

    min_letters: int = Field(3, gt=0)
    max_letters: int = Field(7, gt=0)


class ToyConfig(DomainConfig):
    toy: ToySection = Field(default_factory=ToySection)


def _words(n: int, rng: random.Random, lo: int, hi: int, taken: set[str]) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        w = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(lo, hi)))
        if w not in taken:
            taken.add(w)
            out.append(w)
    return out


def _task(word: str, i: int, role: str) -> Task:
    return Task(id=f"toy-{role}-{i}", question=f"How many letters are in the word {word}?", answer=str(len(word)))


class ToyDomain(Domain):
    name = __name__  # "tests.toy_domain": where every process of a run finds it
    folder = Path(__file__).resolve().parent
    warmstart_version = "1"
    answer_format = AnswerFormat("<answer>", "</answer>")
    config_model = ToyConfig

    def load_splits(self, data: DataSpec, seed: int) -> Splits:
        rng, taken = random.Random(f"toy:{seed}"), set()
        return Splits(**{role: [_task(w, i, role) for i, w in enumerate(_words(n, rng, 3, 7, taken))]
                         for role, n in split_sizes(data).items()})

    def verify(self, task: Task, response: str | None) -> float:
        found = _ANSWER.findall(response or "")
        return 1.0 if found and found[-1].strip() == task.answer else 0.0

    def check_inputs(self, cfg) -> None:
        section = self.settings(cfg).toy
        if section.min_letters > section.max_letters:
            raise DataError(f"toy.min_letters ({section.min_letters}) is above toy.max_letters ({section.max_letters})")

    def warmstart_conversations(self, n: int, seed: int) -> list[list[dict[str, str]]]:
        rng = random.Random(f"toy-warm:{seed}")
        convs = []
        for i, w in enumerate(_words(n, rng, 3, 7, set())):
            t = _task(w, i, "warm")
            convs.append([{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": t.question},
                          {"role": "assistant", "content": self.answer_format.wrap(t.answer)}])
        return convs


DOMAIN = register_domain(ToyDomain())
