"""`whale calibrate` (whale_ray/calibrate.py): the pass@k estimator, the table by difficulty, bad input, and the
command end to end on the embedded policy (real Ray, the real sandbox)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from math import comb
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from whale_ray.calibrate import ALL, pass_at_k, summarize
from whale_ray.records import Rollout, Task


@pytest.mark.parametrize("n, c, k, expected", [
    (8, 0, 1, 0.0), (8, 8, 8, 1.0), (8, 2, 1, 0.25), (8, 2, 8, 1.0), (8, 1, 4, 0.5),  # 1 - 35/70
    (5, 2, 2, 0.7),  # 1 - C(3,2)/C(5,2) = 1 - 3/10
    (10, 3, 5, 1 - 21 / 252), (8, 6, 3, 1.0),  # fewer wrong samples than k: every draw of k holds a right one
])
def test_pass_at_k_by_hand(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected)


def test_pass_at_k_is_the_chance_that_k_draws_hold_a_correct_one():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(1 - comb(n - c, k) / comb(n, k))
    for bad in [(4, 5, 1), (4, 1, 5), (4, 1, 0), (4, -1, 1)]:
        with pytest.raises(ValueError, match="pass@k needs"):
            pass_at_k(*bad)


def rollout(task: str, reward: float, answer: str | None = "x", finish: str = "stop", status: str = "ok") -> Rollout:
    return Rollout(phase="calibrate-weight", cycle=0, harness_id="h0", task_id=task, sample=0, seed=0,
                   weight_version=0, status=status, reason="", reward=reward, answer=answer, turns=1, truncated=False,
                   prompt_tokens=1, completion_tokens=1, wall_s=0.0,
                   calls=[{"finish_reason": finish, "prompt_ids": [], "completion_ids": [], "logprobs": [],
                           "weight_version": 0}], trace="{}")


def test_table_by_difficulty():
    tasks = [Task(id=f"t{i}", question=f"q{i}", answer="1", meta={"level": level})
             for i, level in enumerate([1, 2, 10, 2])]
    rollouts = [rollout("t0", 1, "\\boxed{1}"), rollout("t0", 0, "1"),  # level 1: pass@1 0.5, pass@2 1
                rollout("t1", 0, "2", "length"), rollout("t1", 0, None, status="timeout"),  # level 2 ...
                rollout("t3", 1, "\\boxed{1}"), rollout("t3", 1, "\\boxed{1}"),  # ... pass@1 0.5, pass@2 0.5
                rollout("t2", 0, "\\boxed{3}"), rollout("t2", 0, "3")]  # level 10: 0
    groups = summarize(rollouts, tasks, 2, "level", "\\boxed{")
    assert [g.group for g in groups] == ["1", "2", "10", ALL]  # numbers in numeric order
    one, two, ten, every = groups
    assert (one.tasks, one.episodes, one.correct, one.pass_at_1, one.pass_at_k) == (1, 2, 1, 0.5, 1.0)
    assert (two.tasks, two.pass_at_1, two.pass_at_k, two.marked, two.cut, two.failed) == (2, 0.5, 0.5, 0.5, 0.25, 0.25)
    assert (ten.pass_at_1, ten.pass_at_k) == (0.0, 0.0)
    assert (every.tasks, every.episodes, every.correct) == (4, 8, 3)
    assert every.pass_at_1 == pytest.approx((0.5 + 0 + 1 + 0) / 4) and every.pass_at_k == pytest.approx(2 / 4)
    assert [g.group for g in summarize(rollouts, tasks, 2, None, None)] == [ALL]


@pytest.mark.parametrize("flags, named", [
    (["--by", "colour"], "--by colour: no task has a public field 'colour' (fields: level, steps)"),
    (["--k", "0"], "--k 0: needs at least one episode per task"),
    (["--tasks", "0"], "--tasks 0: needs at least one task"),
    (["--model", "/nonexistent/ckpt"], "policy checkpoint /nonexistent/ckpt: no such directory"),
    (["--harness", "/nonexistent/h.py"], "/nonexistent/h.py"),
])
def test_bad_input_is_one_line_before_ray_starts(flags, named, tmp_path):
    """In a process of its own, pointed at a Ray address where nothing listens: a command that got as far as
    starting Ray would name that address instead of the bad input."""
    result = subprocess.run([sys.executable, "-m", "whale_ray.cli", "calibrate", "--domain",
                             "domains.math_reasoning.arithmetic", "--ray-address", "127.0.0.1:1", *flags], cwd=tmp_path,
                            capture_output=True, text=True, timeout=300, env={**os.environ, "COLUMNS": "400"})
    assert result.returncode == 2, result.stdout + result.stderr
    assert named in result.stdout and result.stdout.strip().count("\n") == 0, result.stdout


def test_calibrate_end_to_end_on_the_embedded_policy(tiny_policy, tmp_path: Path):
    out = tmp_path / "calib.json"
    args = ["calibrate", "--domain", "domains.math_reasoning.arithmetic", "--model", tiny_policy, "--tasks", "4",
            "--k", "2", "--slots", "4", "--out", str(out)]
    done = subprocess.run([sys.executable, "-m", "whale_ray.cli", *args], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "pass@2" in done.stdout and "θ0 on D_weight" in done.stdout
    result = json.loads(out.read_text())
    s = result["settings"]
    assert (s["split"], s["tasks"], s["k"], s["by"], s["model"]) == ("weight", 4, 2, "level", tiny_policy)
    assert s["command"].startswith("whale calibrate --domain domains.math_reasoning.arithmetic")
    every = result["groups"][-1]
    assert every["group"] == ALL and (every["tasks"], every["episodes"]) == (4, 8)
    assert sum(g["episodes"] for g in result["groups"][:-1]) == 8
    assert 0 <= every["pass_at_1"] <= every["pass_at_k"] <= 1 and every["failed"] == 0.0
    rows = pq.read_table(tmp_path / "calib.rollouts.parquet").to_pylist()
    assert len(rows) == 8 and {r["sample"] for r in rows} == {0, 1} and all(r["calls"] for r in rows)
    assert sum(r["reward"] for r in rows) == every["correct"]
