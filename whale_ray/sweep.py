"""Ray Tune sweeps over WHALE schedules: one trial per (E, I) point, each a full run with its own
run directory, reporting every cycle's row so Tune can compare schedules as they go."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field

from whale_ray.config import ConfigError, WhaleConfig, dotted_keys, load_config


class SweepConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    base: dict[str, Any] = Field(default_factory=dict)  # a run config; the points override E and I
    points: list[tuple[float, int]]  # (E, I)
    max_concurrent_trials: int = Field(1, gt=0)
    metric: str = "test_mean8"


def load_sweep(path: Path) -> SweepConfig:
    if not Path(path).is_file():
        raise ConfigError(f"sweep file {path}: not found")
    try:
        return SweepConfig.model_validate(yaml.safe_load(Path(path).read_text()) or {})
    except Exception as e:  # pydantic or YAML: either way the file is wrong
        raise ConfigError(f"sweep file {path}: {str(e).splitlines()[0]}") from None


def trial_config(sweep: SweepConfig, point: tuple[float, int], root: Path) -> WhaleConfig:
    E, I = point
    flat = {"E": E, "I": I, "run_dir": str(root / f"E{E:g}-I{I}")}
    cfg = load_config(None, {**dotted_keys(sweep.base), **flat})
    cfg.run_dir = Path(cfg.run_dir).resolve()
    return cfg


def _trial(params: dict[str, Any]) -> None:
    from ray import tune

    from actors.coordinator import Coordinator

    cfg = WhaleConfig.model_validate(params["config"])
    Coordinator(cfg, params["model"]).run(
        on_cycle=lambda row: tune.report({**row.model_dump(), "E": cfg.E, "I": cfg.I}))


def run_sweep(sweep: SweepConfig, root: Path, base_model: str) -> list[dict[str, Any]]:
    """Runs every point (resuming the ones whose run directory already holds a run); returns the last
    row of each trial, best first by the sweep's metric."""
    from ray import tune

    configs = [trial_config(sweep, p, Path(root).resolve()).model_dump(mode="json") for p in sweep.points]
    tuner = tune.Tuner(
        _trial,
        param_space={"config": tune.grid_search(configs), "model": base_model},
        tune_config=tune.TuneConfig(max_concurrent_trials=sweep.max_concurrent_trials),
        run_config=tune.RunConfig(name="whale-sweep", storage_path=str(Path(root).resolve() / "tune"), verbose=0),
    )
    grid = tuner.fit()
    rows = []
    for result in grid:
        if result.error is not None:
            raise RuntimeError(f"sweep trial {result.path} failed: {result.error}")
        rows.append(result.metrics)
    return sorted(rows, key=lambda m: -m[sweep.metric])
