"""What every domain folder provides, and how a domain is found by name.

A domain lives in `domains/<name>/` with the same parts everywhere:
  data.py      loaders for the public formats, the offline generator, the splits
  verifier.py  the binary verifier R(x, tau); runs only in the trusted process
  tools.py     tools the harness may call; stdlib-only, they run inside the sandbox
  h0.py        the deliberately weak base harness
  skill.md     what the proposer may change, what it must not, the harness contract
  __init__.py  `DOMAIN`, an instance of a `Domain` subclass
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from whale_ray.records import Task

if TYPE_CHECKING:
    from whale_ray.config import DataConfig

DOMAIN_NAMES = ("math_reasoning",)


class DataError(ValueError):
    """A dataset file or row is missing or malformed. The message names the file (and row) and the problem."""


@dataclass(frozen=True)
class Splits:
    weight: list[Task]
    harness: list[Task]
    val: list[Task]
    test: list[Task]

    def __post_init__(self) -> None:
        seen: dict[str, str] = {}
        for role in ("weight", "harness", "val", "test"):
            tasks = getattr(self, role)
            if not tasks:
                raise DataError(f"split D_{role} is empty")
            for t in tasks:
                key = t.question.strip()
                if seen.get(key, role) != role:
                    raise DataError(f"task {t.id!r} appears in both D_{seen[key]} and D_{role}")
                seen[key] = role

    def sizes(self) -> dict[str, int]:
        return {role: len(getattr(self, role)) for role in ("weight", "harness", "val", "test")}


class Domain(ABC):
    name: str
    folder: Path

    @abstractmethod
    def load_splits(self, data: "DataConfig", seed: int) -> Splits:
        """Disjoint D_weight / D_harness / D_val / D_test, from files or the offline generator."""

    @abstractmethod
    def verify(self, task: Task, response: str | None) -> float:
        """1.0 when the final response is accepted for this task, else 0.0."""

    def warmstart_conversations(self, n: int, seed: int) -> list[list[dict[str, str]]]:
        """Chat conversations whose assistant turns teach the embedded tiny policy its first skills."""
        raise NotImplementedError(f"domain {self.name!r} has no embedded warm-start data")

    def host_tools(self) -> dict[str, Callable[..., str]]:
        """Tools that must run in the trusted process (a shared retriever, say), reached over RPC."""
        return {}

    @property
    def h0_path(self) -> Path:
        return self.folder / "h0.py"

    @property
    def sandbox_tools_path(self) -> Path:
        return self.folder / "tools.py"

    @property
    def skill_text(self) -> str:
        return (self.folder / "skill.md").read_text()

    def metrics(self, rollouts: list[Any]) -> dict[str, float]:
        """Extra per-domain metrics beside mean@k (retrieval accuracy, say)."""
        return {}


def get_domain(name: str) -> Domain:
    if name not in DOMAIN_NAMES:
        raise ValueError(f"unknown domain {name!r}; choose one of {', '.join(DOMAIN_NAMES)}")
    return importlib.import_module(f"domains.{name}").DOMAIN
