"""Ray Tune sweeps over WHALE run settings (`whale sweep`): a search space over any run setting, ASHA on the
training rollouts spent, trials side by side in their own placement groups, resume from the sweep's root.

    space.py   the sweep file: space, points, search, scheduler, metric; every bad value before any trial
    trial.py   one trial: a full run in its own run directory and placement group, rows reported to Tune
    tuner.py   the Tuner (new or restored), ASHA on rollouts, max_concurrent_trials: auto
    output.py  the table, sweep.png, the Pareto set and best.yaml in the sweep's root
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from whale_ray.config import ConfigError, dotted_keys
from whale_ray.storage import atomic_write_text
from whale_ray.sweep.output import TrialRow, ranked, trial_row, write_outputs
from whale_ray.sweep.space import SweepConfig, edge_configs, load_sweep, parse_sweep
from whale_ray.sweep.trial import trial_config, trial_values

__all__ = ["SweepConfig", "TrialRow", "check_root", "edge_configs", "load_sweep", "parse_sweep", "run_sweep"]


RECORD = "sweep.yaml"  # in the root: the sweep as first launched, so a relaunch resumes the same sweep


def check_root(sweep: SweepConfig, root: Path) -> None:
    """A root that holds another sweep is one line: a restored Tuner would mix the old trials with the new file."""
    path = Path(root) / RECORD
    if not path.is_file():
        return
    recorded = dotted_keys(yaml.safe_load(path.read_text()) or {})
    given = dotted_keys(sweep.model_dump(mode="json"))
    if differ := sorted(k for k in set(recorded) | set(given)
                        if recorded.get(k) != given.get(k) and not k.startswith("base.tracking")):  # no part of it
        raise ConfigError(f"--root {root}: holds another sweep (differs in {', '.join(differ[:5])}); rerun with the "
                          "same sweep to resume it, or choose another root")


def _trial_id(result: Any) -> str:
    if trial_id := result.metrics.get("trial_id"):
        return trial_id
    match = re.search(r"_([0-9a-f]{5}_\d{5})", Path(result.path).name)  # Tune's trial folder: <name>_<id>_<tag>
    return match.group(1) if match else ""


def run_sweep(sweep: SweepConfig, root: Path, base_model: str, naming: str = "index") -> list[TrialRow]:
    """Runs the sweep (or resumes it from `root`); returns one row per trial, best first by the sweep's metric,
    and writes the table, sweep.png, pareto.csv and best.yaml into `root`. A trial that fails is a row with its
    error; the others run on."""
    from whale_ray.sweep.tuner import make_tuner

    root = Path(root).resolve()
    root.mkdir(parents=True, exist_ok=True)
    check_root(sweep, root)
    if not (root / RECORD).is_file():
        atomic_write_text(root / RECORD, yaml.safe_dump(sweep.model_dump(mode="json"), sort_keys=False))
    from whale_ray.config import TrackingConfig
    from whale_ray.tracking.session import prepare_sweep, sweep_experiment

    prepare_sweep(TrackingConfig.model_validate(sweep.base.get("tracking") or {}), root, sweep_experiment(root, naming))
    grid = make_tuner(sweep, root, base_model, naming).fit()
    rows = []
    for result in grid:
        params = result.config
        run_dir = trial_config(params, _trial_id(result)).run_dir
        error = None if result.error is None else str(result.error).strip().splitlines()[-1][:200]
        rows.append(trial_row(Path(run_dir), trial_values(params), error))
    write_outputs(root, rows, sweep.metric)
    return ranked(rows, sweep.metric)
