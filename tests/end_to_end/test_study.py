"""`whale study`: bad input is one line before anything starts; a real study (2 conditions x 2 seeds,
tests/study_runs.py) runs the pairs on one budget side by side, each in its own run directory, and a relaunch
reruns none."""

from __future__ import annotations

import pytest
import yaml

from tests.helpers import SMALL, check_placed, spans, starts
from tests.study_runs import CONDITIONS, SEEDS, E, run_study
from whale_ray.config import load_recorded_config
from whale_ray.run_state import RunState


@pytest.mark.parametrize("argv, message", [
    (["--conditions", "whale,weights"], "--conditions: unknown condition 'weights'"),
    (["--conditions", ","], "--conditions: empty"),
    (["--conditions", "whale,whale"], "a condition is named twice"),
    (["--seeds", "0"], "--seeds: must be at least 1"),
    (["--E", "-0.5"], "study: base: E: E must be a positive number"),
    (["--model", "nobody/No-Such-Model"], "holds no model nobody/No-Such-Model (whale-ray never downloads"),
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
def test_study_runs_each_pair_on_one_budget_and_resumes(made_study):
    root, config, output = made_study  # `whale study` over 2 conditions x 2 seeds (tests/study_runs.py)
    pairs = {f"{c}-s{s}" for c in CONDITIONS for s in SEEDS}
    assert {d.name for d in root.iterdir() if (d / "state.json").is_file()} == pairs
    for name in pairs:
        run = root / name
        cfg = load_recorded_config(run / "config.yaml")
        assert (cfg.condition, f"s{cfg.seed}", cfg.E, cfg.I, cfg.cycles) == (*name.split("-"), E, SMALL["I"], 1)
        assert RunState.load(run).finished and starts(run) == 1 and check_placed(run)
        assert (run / "report" / "index.html").is_file()  # each run's own page, as `whale run` writes it
        assert str(run) in output  # where each pair is
    ended = [span for name in sorted(pairs) for span in spans(root / name)]
    assert any(a[0] < b[1] and b[0] < a[1] for i, a in enumerate(ended) for b in ended[i + 1:]), ended  # side by side
    assert (root / "compare" / "compare.md").is_file()  # and the comparison at the end

    again = run_study(root, config)
    assert again.returncode == 0, again.stdout[-3000:]
    assert all(starts(root / n) == 1 for n in pairs)  # finished pairs are not started again
