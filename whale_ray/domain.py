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
import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable

from whale_ray.records import Task

if TYPE_CHECKING:
    from whale_ray.config import DataConfig, WhaleConfig
    from whale_ray.records import EpisodeResult

DOMAIN_NAMES = ("math_reasoning", "search_qa", "chess_puzzles")

log = logging.getLogger(__name__)


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


def split_sizes(data: "DataConfig") -> dict[str, int]:
    """The configured size of each split, keyed like the fields of Splits."""
    return {"weight": data.n_weight, "harness": data.n_harness, "val": data.n_val, "test": data.n_test}


def distinct_questions(tasks: Iterable[Task]) -> list[Task]:
    """The first task of each question text, in order."""
    seen: set[str] = set()
    out = []
    for t in tasks:
        if t.question.strip() not in seen:
            seen.add(t.question.strip())
            out.append(t)
    return out


def without_test_questions(train: list[Task], test: list[Task], train_path: Path | None, noun: str) -> list[Task]:
    """`train` without the questions of D_test; how many were dropped is logged."""
    test_questions = {t.question.strip() for t in test}
    clean = [t for t in train if t.question.strip() not in test_questions]
    if len(clean) < len(train):
        log.warning("data file %s: %d %s also in the test files left out of training", train_path,
                    len(train) - len(clean), noun)
    return clean


def train_splits(train: list[Task], test: list[Task], data: "DataConfig", noun: str) -> Splits:
    """D_val, D_harness and D_weight, in that order, from the front of `train` (shuffled, free of D_test)."""
    val = train[: data.n_val]
    harness = train[len(val) : len(val) + data.n_harness]
    weight = train[len(val) + len(harness) : len(val) + len(harness) + data.n_weight]
    if not weight:
        raise DataError(
            f"data file {data.train_path}: {len(train)} usable {noun} are too few; D_val ({data.n_val}) and "
            f"D_harness ({data.n_harness}) are taken first and D_weight needs at least one more"
        )
    return Splits(weight=weight, harness=harness, val=val, test=test)


class Domain(ABC):
    name: str
    folder: Path

    @abstractmethod
    def load_splits(self, data: "DataConfig", seed: int) -> Splits:
        """Disjoint D_weight / D_harness / D_val / D_test, from files or the offline generator."""

    @abstractmethod
    def verify(self, task: Task, response: str | None) -> float:
        """1.0 when the final response is accepted for this task, else 0.0."""

    def make_verifier(self, cfg: "WhaleConfig") -> Callable[[Task, str | None], float]:
        """The run's reward function: `verify`, unless the config adds to it (an LLM judge, say)."""
        return self.verify

    def warmstart_conversations(self, n: int, seed: int) -> list[list[dict[str, str]]]:
        """Chat conversations whose assistant turns teach the embedded tiny policy its first skills."""
        raise NotImplementedError(f"domain {self.name!r} has no embedded warm-start data")

    def check_inputs(self, cfg: "WhaleConfig") -> None:
        """Checks the domain's own inputs beyond the splits (a corpus file, say) before a run starts;
        raises DataError naming the input."""

    def start_services(self, cfg: "WhaleConfig", splits: Splits) -> dict[str, Any]:
        """Shared trusted services of a run (Ray actor handles: a retriever, say), started once by the
        coordinator and handed to every evaluator."""
        return {}

    def host_tools(self, services: dict[str, Any]) -> dict[str, Callable[..., str]]:
        """Tools that run in the trusted evaluator process, reached from the sandbox over RPC."""
        return {}

    def episode_tools(self, task: Task, services: dict[str, Any]) -> dict[str, Callable[..., str]]:
        """Tools bound to one episode, built per episode in the trusted evaluator. They may read the gold
        answer and private meta and keep state across calls (a chess opponent, say)."""
        return {}

    def episode_metrics(self, task: Task, episode: "EpisodeResult") -> dict[str, float]:
        """Per-episode metrics beside the reward, computed in the trusted process from trusted records
        (`episode.tool_calls` holds every host and episode tool call); reports average them."""
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


def get_domain(name: str) -> Domain:
    if name not in DOMAIN_NAMES:
        raise ValueError(f"unknown domain {name!r}; choose one of {', '.join(DOMAIN_NAMES)}")
    return importlib.import_module(f"domains.{name}").DOMAIN
