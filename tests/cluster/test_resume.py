"""Kill `whale run` (the whole process group, Ray included) inside and between phases, relaunch the
same command, and check that nothing was redone, lost or counted twice: the resumed run is the uninterrupted
run of the same study (same seed) to the value, and every state at a kill was a prefix of it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from tests.helpers import SMALL
from tests.run_truth import check_ledger, check_selection, guessing_math_harness
from whale_ray.archive import Archive
from whale_ray.config import load_config


def launch(config: Path, run_dir: Path, env: dict) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "whale_ray.cli", "run", "--config", str(config), "--run-dir", str(run_dir)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True)


def state(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / "state.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def kill_when(proc: subprocess.Popen, run_dir: Path, condition) -> dict:
    """SIGKILL the run's process group as soon as its state.json meets `condition` (no clock: pytest's timeout
    is the only limit, so a slow machine is slow, not a failure)."""
    while True:
        s = state(run_dir)
        if s and condition(s):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return s
        assert proc.poll() is None, "the run ended before the kill point"
        time.sleep(0.02)


def rows(run_dir: Path, prefix: str) -> int:
    return sum(pq.ParquetFile(p).metadata.num_rows for p in (run_dir / "rollouts").glob(f"{prefix}-*.parquet"))


def timeless(rows: list[dict]) -> list[dict]:
    """History rows without their clocks: the cycle's wall time, and the proposer's in the row's ledger."""
    return [{**{k: v for k, v in row.items() if k not in ("wall_s", "ledger")}, "ledger": spent(row)} for row in rows]


def spent(s: dict) -> dict:
    """The ledger without the proposer's wall time (a clock, not a count)."""
    return {k: v for k, v in s["ledger"].items() if k != "proposer_wall_s"}


@pytest.mark.slow
def test_resume_after_kills_inside_and_between_phases(tmp_path, tiny_policy):
    from whale_ray.domain import get_domain

    seed_harness = tmp_path / "guess.py"  # rewards vary, so weight steps train and pairs differ on D_val
    seed_harness.write_text(guessing_math_harness(get_domain("math_reasoning").h0_path.read_text()))
    config = tmp_path / "study.yaml"
    tree: dict = {"condition": "whale", "policy": {"model": tiny_policy}, "harness": str(seed_harness)}
    # Larger val/test splits widen the window between a cycle's last phase and its row.
    for key, value in {**SMALL, "data.n_val": 16, "data.n_test": 16, "eval.val_samples": 2}.items():
        section, _, leaf = key.rpartition(".")
        (tree.setdefault(section, {}) if section else tree)[leaf] = value
    config.write_text(yaml.safe_dump(tree))
    cfg = load_config(config, {})
    env = {**os.environ, "RAY_ADDRESS": ""}
    env.pop("RAY_ADDRESS")

    # the same study, same seed, never interrupted: side by side with the killed one (the runs share nothing
    # but the machine, and the kill points are read from the killed run's own state)
    reference_dir = tmp_path / "reference"
    reference_run = launch(config, reference_dir, env)

    try:
        def phase(s):
            return s.get("phase") or {}

        # (a kill inside a harness iteration, proposer session included, is tests/proposers/test_llm_proposer.py's
        # resume test; kills at 5/30/60/90% of the loop are tests/loop/test_loop.py's)
        kill_points = [
            # inside the first weight phase, after one step: the Trainer's state comes back from its checkpoint
            lambda s: phase(s).get("kind") == "weight" and phase(s).get("units_done", 0) >= 1 and not phase(s)["done"],
            # inside the harness phase while the weight phase's last checkpoint is not on record: the relaunch
            # trains the steps after the one on record again, on their recorded examples
            lambda s: phase(s).get("kind") == "harness" and phase(s).get("units_done", 0) >= 1
            and s.get("checkpoint_pending") is not None,
            # between phases: a cycle's phases are done and its report (D_val, selection, D_test) is not; the
            # last cycle's runs alone, so the window is there whatever eval.overlap does with the others
            lambda s: not phase(s) and (s.get("report") or {}).get("cycle", -1) >= 0,
        ]
        run_dir = tmp_path / "run"
        seen = []
        for point in kill_points:
            seen.append(kill_when(launch(config, run_dir, env), run_dir, point))
        final = launch(config, run_dir, env)
        assert final.wait() == 0 and reference_run.wait() == 0
    finally:  # a failed check leaves no run behind
        if reference_run.poll() is None:
            os.killpg(reference_run.pid, signal.SIGKILL)
    s, reference = state(run_dir), state(reference_dir)

    assert s["finished"] and [row["cycle"] for row in s["history"]] == [0, 1, 2]
    assert [p.rsplit(":", 1)[0] for p in s["phases_done"]] == ["1:weight", "1:harness", "2:weight", "2:harness"]
    # the resumed run is the uninterrupted one: same rows, phases, selection and counts, to the value
    assert timeless(s["history"]) == timeless(reference["history"])
    assert s["phases_done"] == reference["phases_done"] and s["best"] == reference["best"]
    assert spent(s) == spent(reference)
    assert s["weight_version"] == s["ledger"]["weight_steps"] == reference["weight_version"] > 0
    assert s["checkpoint_pending"] is None and s["checkpoint_version"] == s["weight_version"]
    timings = [json.loads(line) for line in (run_dir / "timings.jsonl").read_text().splitlines()]
    assert [t["steps"] for t in timings if t["act"] == "retrain"] == [seen[1]["weight_version"] - seen[1]["checkpoint_version"]]
    assert seen[1]["weight_version"] > seen[1]["checkpoint_version"]
    # a launch starts a Ray Train run (a folder each) only with steps ahead of it: each killed one had; the last
    # had none if the third kill came after the last weight phase
    weight_left = sum(":weight:" in p for p in seen[2]["phases_done"]) < 2
    assert len(list((run_dir / "trainer" / "ray_train").iterdir())) == 3 + weight_left
    assert len(list((reference_dir / "trainer" / "ray_train").iterdir())) == 1
    # and both are what the config's budgets and the rollout files make them
    for run in (run_dir, reference_dir):
        check_selection(run, state(run))
        check_ledger(cfg, run, state(run))
    evaluated = Archive(run_dir / "archive").candidates("evaluated")
    assert sum(c.scores["n"] for c in evaluated) == rows(run_dir, "harness")
    assert [c.id for c in evaluated] == [c.id for c in Archive(reference_dir / "archive").candidates("evaluated")]

    # the state at each kill was a prefix of the uninterrupted run, its counts those of its finished units
    per_phase = round(cfg.E * cfg.data.n_weight)
    for earlier in seen:
        assert timeless(earlier["history"]) == timeless(reference["history"])[:len(earlier["history"])]
        assert earlier["phases_done"] == reference["phases_done"][:len(earlier["phases_done"])]
        assert earlier["weight_version"] == earlier["ledger"]["weight_steps"]
        finished = [p.split(":")[1] for p in earlier["phases_done"]]
        p = phase(earlier)
        current = {} if not p or p["done"] else {p["kind"]: p}  # a finished phase is in phases_done already
        prompts = per_phase * finished.count("weight") + current.get("weight", {}).get("prompts_done", 0)
        assert earlier["ledger"]["weight_rollouts"] == prompts * cfg.weight.samples_per_prompt
        iterations = cfg.I * finished.count("harness") + current.get("harness", {}).get("units_done", 0)
        assert earlier["ledger"]["harness_iterations"] == iterations
