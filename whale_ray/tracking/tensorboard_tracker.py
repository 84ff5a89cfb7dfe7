"""TensorBoard event files through torch's SummaryWriter (the `tensorboard` package writes them), in
<run_dir>/tensorboard unless `tracking.tensorboard.log_dir` says where; a relaunch adds an event file beside the
first, with only the steps it had not written."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch.utils.tensorboard import SummaryWriter

from whale_ray.tracking.records import Point


class TensorBoardTracker:
    def __init__(self, section: Any, run_dir: Path, experiment: str):
        self.target = str(Path(section.log_dir or run_dir / "tensorboard").resolve())
        self.writer: SummaryWriter | None = None

    def open(self, name: str, tags: dict[str, str], resume: dict[str, Any] | None) -> dict[str, Any]:
        self.writer = SummaryWriter(self.target)
        self.writer.add_text("tags", "\n".join(f"- {k}: {v}" for k, v in tags.items()))
        return {}

    def log_params(self, params: dict[str, str]) -> None:
        self.writer.add_text("config", "\n".join(f"    {k}: {v}" for k, v in params.items()))  # indented: as code
        self.writer.flush()

    def log_point(self, point: Point) -> None:
        for k, v in point.metrics.items():
            self.writer.add_scalar(k, v, point.step)
        for k, v in {**point.tags, **point.texts}.items():
            self.writer.add_text(k, v, point.step)
        self.writer.flush()

    def log_files(self, files: dict[str, Path]) -> None:
        """TensorBoard keeps no files: the harnesses' code as text."""
        for name, path in files.items():
            if path.suffix == ".py":
                self.writer.add_text(name, "\n".join("    " + line for line in path.read_text().splitlines()))
        self.writer.flush()

    def close(self, status: str) -> None:
        self.writer.add_text("status", status)
        self.writer.close()
