"""`whale study`: bad input is one line before anything starts; a real two-pair study runs both pairs on one
budget side by side, each in its own run directory, and a relaunch reruns neither."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from tests.conftest import SMALL
from tests.test_sweep import check_placed, nested, spans, starts
from whale_ray.config import load_recorded_config
from whale_ray.run_state import RunState


@pytest.mark.parametrize("argv, message", [
    (["--conditions", "whale,weights"], "--conditions: unknown condition 'weights'"),
    (["--conditions", ","], "--conditions: empty"),
    (["--conditions", "whale,whale"], "a condition is named twice"),
    (["--seeds", "0"], "--seeds: must be at least 1"),
    (["--E", "-0.5"], "study: base: E: E must be a positive number"),
])
def test_bad_study_input_is_one_line(tmp_path, capsys, argv, message):
    from whale_ray.cli import main

    assert main(["study", *argv, "--root", str(tmp_path / "root")]) == 2
    out = capsys.readouterr().out.strip()
    assert "\n" not in out and message in out, out
    assert not (tmp_path / "root").exists()


def test_a_config_that_sets_what_the_study_varies_is_refused(tmp_path, capsys):
    from whale_ray.cli import main

    config = tmp_path / "base.yaml"
    config.write_text(yaml.safe_dump({"condition": "whale"}))
    assert main(["study", "--config", str(config), "--root", str(tmp_path / "root")]) == 2
    assert "'condition' is what the study varies" in capsys.readouterr().out


@pytest.mark.slow
def test_study_runs_each_pair_on_one_budget_and_resumes(tmp_path, tiny_policy):
    config = tmp_path / "base.yaml"
    config.write_text(yaml.safe_dump(nested({**SMALL, "cycles": 1, "policy.model": tiny_policy})))
    root = tmp_path / "study"
    argv = [sys.executable, "-m", "whale_ray.cli", "study", "--conditions", "rsft_only,mh_only", "--seeds", "1",
            "--first-seed", "3", "--E", "0.25", "--config", str(config), "--root", str(root)]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    first = subprocess.run(argv, capture_output=True, text=True, env=env)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-2000:]
    pairs = {"rsft_only-s3", "mh_only-s3"}
    assert {d.name for d in root.iterdir() if (d / "state.json").is_file()} == pairs
    for name in pairs:
        run = root / name
        cfg = load_recorded_config(run / "config.yaml")
        assert (cfg.condition, cfg.seed, cfg.E, cfg.I, cfg.cycles) == (name.split("-")[0], 3, 0.25, SMALL["I"], 1)
        assert RunState.load(run).finished and starts(run) == 1 and check_placed(run)
        assert str(run) in first.stdout  # where each pair is
    (a,), (b,) = (spans(root / n) for n in sorted(pairs))
    assert a[0] < b[1] and b[0] < a[1], (a, b)  # side by side

    again = subprocess.run(argv, capture_output=True, text=True, env=env)
    assert again.returncode == 0, again.stdout[-3000:]
    assert all(starts(root / n) == 1 for n in pairs)  # finished pairs are not started again
