"""The math_reasoning domain: word problems (generated) or DAPO-Math-17K / AIME (files), a python tool,
and the strict \\boxed{} verifier. See skill.md for what a harness may change."""

from __future__ import annotations

from pathlib import Path

from whale_ray.domain import AnswerFormat, DataSpec, Domain, Splits, register_domain
from whale_ray.records import Task

from . import data, generator, verifier


class MathDomain(Domain):
    name = "math_reasoning"
    folder = Path(__file__).resolve().parent
    warmstart_version = "3"
    answer_format = AnswerFormat("\\boxed{", "}")
    difficulty_field = "steps"

    def load_splits(self, data_config: DataSpec, seed: int) -> Splits:
        return data.load_splits(data_config, seed)

    def verify(self, task: Task, response: str | None) -> float:
        return verifier.verify(task, response)

    def warmstart_conversations(self, n: int, seed: int) -> list[list[dict[str, str]]]:
        return generator.warmstart_conversations(n, seed)


DOMAIN = register_domain(MathDomain())
