"""Kill `whale run` (the whole process group, Ray included) inside and between phases, relaunch the
same command, and check that nothing was redone, lost or counted twice."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from tests.conftest import SMALL
from whale_ray.archive import Archive


def launch(config: Path, run_dir: Path, env: dict) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "whale_ray.cli", "run", "--config", str(config), "--run-dir", str(run_dir)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True)


def state(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / "state.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def kill_when(proc: subprocess.Popen, run_dir: Path, condition, timeout: float = 400) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = state(run_dir)
        if s and condition(s):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return s
        assert proc.poll() is None, "the run ended before the kill point"
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    raise AssertionError("kill point not reached")


def rows(run_dir: Path, prefix: str) -> int:
    return sum(pq.ParquetFile(p).metadata.num_rows for p in (run_dir / "rollouts").glob(f"{prefix}-*.parquet"))


@pytest.mark.slow
def test_resume_after_kills_inside_and_between_phases(tmp_path, tiny_policy):
    config = tmp_path / "study.yaml"
    tree: dict = {"condition": "whale", "policy": {"model": tiny_policy}}
    # Larger val/test splits widen the window between a finished harness phase and the cycle's end.
    for key, value in {**SMALL, "data.n_val": 16, "data.n_test": 16, "eval.val_samples": 2}.items():
        section, _, leaf = key.rpartition(".")
        (tree.setdefault(section, {}) if section else tree)[leaf] = value
    config.write_text(yaml.safe_dump(tree))
    run_dir = tmp_path / "run"
    env = {**os.environ, "RAY_ADDRESS": ""}
    env.pop("RAY_ADDRESS")

    def phase(s):
        return s.get("phase") or {}

    kill_points = [
        # inside the first weight phase, after one step
        lambda s: phase(s).get("kind") == "weight" and phase(s).get("units_done", 0) >= 1 and not phase(s)["done"],
        # inside the first harness phase, after its first iteration
        lambda s: phase(s).get("kind") == "harness" and phase(s).get("units_done", 0) >= 1 and not phase(s)["done"],
        # between phases: the harness phase is finished, the cycle's selection on D_val is not
        lambda s: phase(s).get("kind") == "harness" and phase(s).get("done"),
    ]
    seen = []
    for point in kill_points:
        seen.append(kill_when(launch(config, run_dir, env), run_dir, point))
    final = launch(config, run_dir, env)
    assert final.wait(timeout=600) == 0
    s = state(run_dir)

    assert s["finished"] and [row["cycle"] for row in s["history"]] == [0, 1, 2]
    assert [p.rsplit(":", 1)[0] for p in s["phases_done"]] == ["1:weight", "1:harness", "2:weight", "2:harness"]
    # weight phase: E * |D_weight| prompts per cycle, k samples each, every one stored once
    per_cycle = round(SMALL["E"] * SMALL["data.n_weight"]) * SMALL["weight.samples_per_prompt"]
    assert s["ledger"]["weight_rollouts"] == rows(run_dir, "weight") == 2 * per_cycle
    steps = sorted(p.name for p in (run_dir / "rollouts").glob("weight-*.parquet"))
    assert len(steps) == len(set(steps)) == 2 * per_cycle // (SMALL["weight.prompts_per_step"] * SMALL["weight.samples_per_prompt"])
    # harness phase: each candidate evaluated once, no iteration proposed twice, all counted
    assert s["ledger"]["harness_rollouts"] == rows(run_dir, "harness") + rows(run_dir, "validate")
    archive = Archive(run_dir / "archive")
    per_iteration = Counter(c.iteration for c in archive.candidates() if c.parent and "re-evaluate" not in c.hypothesis)
    assert max(per_iteration.values()) <= SMALL["harness_phase.candidates_per_iteration"]
    assert s["ledger"]["harness_iterations"] == 2 * SMALL["I"]
    evaluated = [c for c in archive.candidates("evaluated")]
    assert sum(c.scores["n"] for c in evaluated) == rows(run_dir, "harness")
    # the state at each kill was a consistent prefix of the final one
    for earlier in seen:
        assert earlier["ledger"]["weight_rollouts"] <= s["ledger"]["weight_rollouts"]
    assert s["ledger"]["eval_rollouts"] == rows(run_dir, "val") + rows(run_dir, "test")
