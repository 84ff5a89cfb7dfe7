"""What the loop is handed: the roles it drives (as plain Python protocols) and the run's shared parts.

The roles are the design card's long-lived actors. The Coordinator actor hands in thin adapters over Ray
actor handles and the run's weight sync (actors/coordinator.py, actors/weight_sync.py); tests hand in
in-process objects. The loop never imports Ray.
"""

from __future__ import annotations

import threading
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from whale_ray.archive import Archive
from whale_ray.config import WhaleConfig
from whale_ray.domain import Domain, Splits
from whale_ray.loop.run_dir import RunDirectory
from whale_ray.records import EpisodeJob, EpisodeResult, Rollout, Task
from whale_ray.run_state import RolloutPhase


class WeightSync(Protocol):
    """The hand-off of new weights from the Trainer to the PolicyServer(s), both ends of it: one object per
    weight.weight_sync mode (actors/weight_sync.py). The weight phase calls nothing else for weights."""

    def before_step(self) -> None: ...  # new calls wait for the step's weights; GPU memory to the step (sleep mode)
    def push(self, version: int) -> None: ...  # the Trainer's weight `version` on every server, awake
    def resume(self) -> None: ...  # the step trained nothing: every server awake, calls through, on its weights
    def release(self) -> None: ...  # the servers let go of the Trainer's memory before its workers end


class TrainerRole(Protocol):
    """`version` is the weight version the loop expects the trainer to hold (before the step, for train_step):
    a trainer at another one (back from an older state after a fault) refuses rather than act on it."""

    def train_step(self, examples: list[tuple[list[int], list[int]]], version: int) -> dict[str, Any]: ...
    def save_checkpoint(self, path: str, version: int, *, wait: bool = True) -> str: ...  # wait=False: written
    def checkpoint_written(self, path: str) -> str: ...  # in the background until this returns
    def load_checkpoint(self, path: str) -> None: ...
    def release_workers(self) -> None: ...


class Proposer(Protocol):
    def session(self, archive_root: str, n: int, iteration: int, limits: dict[str, Any] | None,
                log_path: str | None) -> dict[str, Any]: ...


@dataclass(frozen=True)
class EpisodeWork:
    """Episodes of one harness: its source text travels to the evaluators, never its archive folder."""

    harness_source: str
    harness_name: str
    jobs: list[EpisodeJob]


class EpisodePool(Protocol):
    def run(self, work: list[EpisodeWork], on_done: Callable[[int], None]) -> list[list[EpisodeResult]]:
        """Every job of every item, in order; `on_done(n)` as each n episodes finish."""


@dataclass(frozen=True)
class Batch:
    """`samples` episodes per task for one harness, seeded by and filed under (phase, cycle, unit)."""

    harness_id: str
    tasks: list[Task]
    samples: int
    phase: RolloutPhase
    cycle: int
    unit: int


class CycleReport(Protocol):
    """A cycle's D_val and D_test evaluations, which wait for the next pool call under the weights the cycle ended
    with (whale_ray/loop/report.py)."""

    def beside(self) -> list[Batch]: ...  # what joins the caller's pool call
    def take(self, batches: list[Batch], results: list[list[Rollout]]) -> None: ...
    def finish(self) -> None: ...  # the rest, alone: the weights are about to change
    def meanwhile(self) -> AbstractContextManager[None]: ...  # the rest, while the caller waits on a proposer


@dataclass
class Roles:
    pool: EpisodePool
    proposer: Proposer
    trainer: TrainerRole | None = None  # these two are None when the schedule has no weight phase
    weights: WeightSync | None = None


@dataclass
class Progress:
    """What the driver shows while the run works; read from another thread."""

    cycle: int = 0
    cycles: int = 0
    phase: str = "starting"
    detail: str = ""
    done: int = 0
    total: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def set(self, **fields: Any) -> None:
        with self._lock:
            for k, v in fields.items():
                setattr(self, k, v)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {k: v for k, v in vars(self).items() if not k.startswith("_")}


@dataclass
class RunContext:
    """The parts every phase shares."""

    cfg: WhaleConfig
    domain: Domain
    splits: Splits
    verifier: Callable[[Task, str | None], float]
    run: RunDirectory
    archive: Archive
    roles: Roles
    progress: Progress
    report: CycleReport = field(init=False)  # set by the loop: it runs its episodes through this context
