"""Weights & Biases in offline mode (where `wandb` is installed): the run is written under <run_dir>/wandb for
`wandb sync` later, and a relaunch continues it by its id."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import wandb

from whale_ray.tracking.records import AXES, Point


class WandbTracker:
    def __init__(self, section: Any, run_dir: Path, experiment: str):
        self.project, self.group, self.dir = section.project, experiment, Path(run_dir)
        self.target = str(self.dir / "wandb")
        self.run: Any = None

    def open(self, name: str, tags: dict[str, str], resume: dict[str, Any] | None) -> dict[str, Any]:
        self.run = wandb.init(mode="offline", dir=str(self.dir), project=self.project, group=self.group, name=name,
                              id=(resume or {}).get("id"), resume="allow", config={"tags": tags}, reinit="create_new")
        for axis in AXES:  # each axis its own step counter: weight steps, harness iterations, cycles
            self.run.define_metric(f"{axis}_step")
            self.run.define_metric(f"{'ledger' if axis == 'cycle' else axis}/*", step_metric=f"{axis}_step")
        self.run.define_metric("cycle/*", step_metric="cycle_step")
        return {"id": self.run.id}

    def log_params(self, params: dict[str, str]) -> None:
        self.run.config.update(params, allow_val_change=True)

    def log_point(self, point: Point) -> None:
        self.run.log({**point.metrics, f"{point.axis}_step": point.step})
        self.run.summary.update(point.tags)

    def log_files(self, files: dict[str, Path]) -> None:
        for path in files.values():  # by their place in the run directory (archive/<id>/harness.py)
            self.run.save(str(path), base_path=str(self.dir), policy="now")

    def close(self, status: str) -> None:
        self.run.finish(exit_code=0 if status == "FINISHED" else 1)
