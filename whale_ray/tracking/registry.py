"""Trackers by name (`tracking.<name>` sections), each imported only when a run turns it on."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Protocol

from whale_ray.tracking.records import Point


class Tracker(Protocol):
    target: str  # where it writes (a URI, a folder): what a warning names
    # optional, read after open: {"params": bool, <axis>: count} that its own store holds (W&B's transaction log
    # may lack the tail a killed launch sent), which then stands over tracking.json's counts
    held: dict[str, Any] | None

    def open(self, name: str, tags: dict[str, str], resume: dict[str, Any] | None) -> dict[str, Any]:
        """Starts its run, or continues the one `resume` names; returns what continues it next launch."""

    def log_params(self, params: dict[str, str]) -> None: ...
    def log_point(self, point: Point) -> None: ...
    def log_files(self, files: dict[str, Path]) -> None: ...  # artifact folder/name -> file
    def close(self, status: str) -> None: ...  # FINISHED, FAILED or KILLED


def _mlflow() -> type:
    from whale_ray.tracking.mlflow_tracker import MlflowTracker

    return MlflowTracker


def _tensorboard() -> type:
    from whale_ray.tracking.tensorboard_tracker import TensorBoardTracker

    return TensorBoardTracker


def _wandb() -> type:
    from whale_ray.tracking.wandb_tracker import WandbTracker

    return WandbTracker


TRACKERS: dict[str, Callable[[], type]] = {"mlflow": _mlflow, "tensorboard": _tensorboard, "wandb": _wandb}


def make_tracker(name: str, section: Any, run_dir: Path, experiment: str) -> Tracker:
    """The tracker for a `tracking.<name>` section; an ImportError when its package is not installed."""
    return TRACKERS[name]()(section, run_dir, experiment)
