"""A small real study shared by the study, compare and report tests: `whale study` itself (its CLI, in a
subprocess with its own local Ray cluster), two conditions × two seeds of math runs with the embedded test
policy and real sandboxes, tracked in MLflow, TensorBoard and, where it is installed, W&B (offline). One cycle
each at the smallest budgets; the seed harness guesses (run_truth.guessing_math_harness) so rewards vary between
seeds and pairs, and means and standard deviations have something to get wrong."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import yaml

from tests.helpers import SMALL, nested
from tests.run_truth import guessing_math_harness
from whale_ray.domain import get_domain

CONDITIONS = ("rsft_only", "mh_only")  # weight-only is there: rollouts to reach its best val are computed
SEEDS = (0, 1)
E = 0.25  # given as a flag: the study's flags reach every pair
TRACKED = "mlflow,tensorboard" + (",wandb" if importlib.util.find_spec("wandb") else "")  # W&B: the tracking extra


def study_argv(root: Path, config: Path) -> list[str]:
    return [sys.executable, "-m", "whale_ray.cli", "study", "--conditions", ",".join(CONDITIONS),
            "--seeds", str(len(SEEDS)), "--first-seed", str(SEEDS[0]), "--E", str(E), "--config", str(config),
            "--root", str(root), "--track", TRACKED]  # tests/end_to_end/test_tracking.py reads each


def run_study(root: Path, config: Path) -> subprocess.CompletedProcess:
    # its own local cluster, and MLflow's default store (<root>/mlflow.db)
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI")}
    return subprocess.run(study_argv(root, config), capture_output=True, text=True, env=env)


def make_study(folder: Path, policy: str) -> tuple[Path, Path, str]:
    """(the study root, its base config, the first launch's output)."""
    seed_harness = folder / "guess.py"
    seed_harness.write_text(guessing_math_harness(get_domain("math_reasoning").h0_path.read_text()))
    config = folder / "base.yaml"
    config.write_text(yaml.safe_dump(nested({
        **SMALL, "cycles": 1, "policy.model": policy, "harness": str(seed_harness), "data.n_val": 8,
        "data.n_test": 8, "eval.val_samples": 2})))
    root = folder / "study"
    out = run_study(root, config)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    return root, config, out.stdout
