"""The math_reasoning domain: word problems (generated) or DAPO-Math-17K / AIME (files), a python tool,
and the strict \\boxed{} verifier. See skill.md for what a harness may change."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from whale_ray.domain import Domain, Splits
from whale_ray.records import Task

from . import data, generator, verifier

if TYPE_CHECKING:
    from whale_ray.config import DataConfig


class MathDomain(Domain):
    name = "math_reasoning"
    folder = Path(__file__).resolve().parent
    warmstart_version = "2"  # part of the embedded policy's cache key: bump when the warm-start formats change

    def load_splits(self, data_config: "DataConfig", seed: int) -> Splits:
        return data.load_splits(data_config, seed)

    def verify(self, task: Task, response: str | None) -> float:
        return verifier.verify(response, task.answer)

    def warmstart_conversations(self, n: int, seed: int) -> list[list[dict[str, str]]]:
        return generator.warmstart_conversations(n, seed)


DOMAIN = MathDomain()
