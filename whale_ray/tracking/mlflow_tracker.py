"""MLflow through its own client (MlflowClient): any tracking URI; a run directory's default store is SQLite beside it
(<run_dir>/../mlflow.db, artifacts in <run_dir>/../mlartifacts), so a sweep's trials share their root's store."""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from mlflow import MlflowClient
from mlflow.entities import Metric, Param, RunTag
from mlflow.exceptions import MlflowException

from whale_ray.tracking.records import Point, key

BATCH = 100  # MLflow's log_batch takes at most 100 params (and 1000 metrics) a call


class MlflowTracker:
    def __init__(self, section: Any, run_dir: Path, experiment: str):
        self.target = section.uri or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{run_dir.parent / 'mlflow.db'}"
        self.experiment = section.experiment or experiment
        self.client: MlflowClient | None = None
        self.run_id: str | None = None

    def _connect(self) -> MlflowClient:
        """The client; a new SQLite store's tables are made under a file lock, since trials side by side that
        each make them race in MLflow's schema migration."""
        if not self.target.startswith("sqlite:///"):
            return MlflowClient(tracking_uri=self.target)
        with open(self.target.removeprefix("sqlite:///") + ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            client = MlflowClient(tracking_uri=self.target)
            client.search_experiments(max_results=1)  # the store is made (and migrated) by its first use
            return client

    def _artifact_location(self) -> str | None:
        """Beside a SQLite store (MLflow's default would be relative to the working directory); a server's own."""
        if not self.target.startswith("sqlite:///"):
            return None
        return (Path(self.target.removeprefix("sqlite:///")).parent / "mlartifacts" / self.experiment).as_uri()

    def _experiment_id(self) -> str:
        found = self.client.get_experiment_by_name(self.experiment)
        if found is not None:
            return found.experiment_id
        try:
            return self.client.create_experiment(self.experiment, artifact_location=self._artifact_location())
        except MlflowException:  # another trial created it first
            return self.client.get_experiment_by_name(self.experiment).experiment_id

    def prepare(self) -> str:
        """The store and the experiment, made if missing; the experiment's id."""
        self.client = self._connect()
        return self._experiment_id()

    def open(self, name: str, tags: dict[str, str], resume: dict[str, Any] | None) -> dict[str, Any]:
        self.client = self._connect()
        if resume:
            self.run_id = resume["run_id"]
            self.client.update_run(self.run_id, status="RUNNING")
            self.client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in tags.items()])
        else:
            run = self.client.create_run(self._experiment_id(), run_name=name, tags=tags)
            self.run_id = run.info.run_id
        return {"run_id": self.run_id}

    def log_params(self, params: dict[str, str]) -> None:
        items = [Param(k, v) for k, v in params.items()]
        for i in range(0, len(items), BATCH):
            self.client.log_batch(self.run_id, params=items[i:i + BATCH])

    def log_point(self, point: Point) -> None:
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, point.step) for k, v in point.metrics.items()],
                              tags=[RunTag(key(k), v) for k, v in point.tags.items()])
        for name, text in point.texts.items():
            self.client.log_text(self.run_id, text, name)

    def log_files(self, files: dict[str, Path]) -> None:
        """Each file under its name (log_artifact keeps a file's own name: archive/<id>/harness.py is harness.py)."""
        with tempfile.TemporaryDirectory() as tmp:
            for name, path in files.items():
                named = Path(tmp) / name
                named.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path, named)
                folder = str(Path(name).parent)
                self.client.log_artifact(self.run_id, str(named), artifact_path=None if folder == "." else folder)

    def close(self, status: str) -> None:
        self.client.set_terminated(self.run_id, status)
