"""`whale compare` on a small real study (2 conditions x 2 seeds, tests/study_runs.py): the table's means, standard
deviations, rollouts and rollouts-to-reach against the rollout files (run_truth.py), the files it writes, and bad
input as one line."""

from __future__ import annotations

import csv
import json
import re
import shutil
import statistics
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from tests.run_truth import check_selection, eval_file, mean_reward
from whale_ray.cli import main

pytestmark = pytest.mark.slow
TRAINING_PHASES = ("weight", "harness", "validate")  # val/test reporting is not spent on training


def run_truth(run: Path) -> dict:
    """A run's numbers from its rollout files: final test mean, training rollouts by the end of each row, best vals."""
    state = json.loads((run / "state.json").read_text())
    best = check_selection(run, state)  # every row's val, best and test against the files
    per_cycle: dict[int, int] = {}
    for f in (run / "rollouts").glob("*.parquet"):
        if m := re.match(rf"({'|'.join(TRAINING_PHASES)})-c(\d+)-", f.name):  # <phase>-c<cycle>-..., cycle from 0
            per_cycle[int(m[2])] = per_cycle.get(int(m[2]), 0) + pq.read_metadata(f).num_rows
    rows = state["history"]
    spent = [sum(n for c, n in per_cycle.items() if c < row["cycle"]) for row in rows]  # row i follows cycle i-1
    truncated = pq.read_table(eval_file(run, "test", *best), columns=["truncated"]).column("truncated").to_pylist()
    return {"seed": yaml.safe_load((run / "config.yaml").read_text())["seed"],
            "test": mean_reward(eval_file(run, "test", *best)), "truncation": sum(truncated) / len(truncated),
            "rollouts": sum(per_cycle.values()),
            "spent": spent, "best_val": [row["best_val"] for row in rows]}


def expected(study: Path) -> dict[str, list[dict]]:
    by: dict[str, list[dict]] = {}
    for run in sorted(study.iterdir()):
        if (run / "state.json").is_file():
            by.setdefault(yaml.safe_load((run / "config.yaml").read_text())["condition"], []).append(run_truth(run))
    return by


def reach(truth: dict, target: float) -> int | None:
    return next((n for n, v in zip(truth["spent"], truth["best_val"]) if v >= target - 1e-12), None)


def test_compare_table_matches_the_runs(small_study, tmp_path, capsys):
    out = tmp_path / "compare"
    assert main(["compare", str(small_study), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    truth = expected(small_study)
    assert sorted(truth) == ["mh_only", "rsft_only"] and all(len(runs) == 2 for runs in truth.values())
    assert len({t["test"] for runs in truth.values() for t in runs}) > 1  # the study has means to get wrong
    peaks = {t["seed"]: t["best_val"][-1] for t in truth["rsft_only"]}  # weight-only's best val, per seed (D_val)
    reached = {c: [reach(t, peaks[t["seed"]]) for t in runs] for c, runs in truth.items()}
    markdown = (out / "compare.md").read_text()
    rows = {r["condition"]: r for r in csv.DictReader((out / "compare.csv").open())}
    flat = sorted(t["seed"] for t in truth["rsft_only"] if t["best_val"][-1] <= t["best_val"][0] + 1e-12)
    assert (f"seeds {flat}: weight-only never beat (θ0, h0) on val" in markdown) == bool(flat)
    for condition, runs in truth.items():
        tests = [t["test"] for t in runs]
        mean, std = statistics.mean(tests), statistics.stdev(tests)
        cell = f"{mean * 100:.2f} ± {std * 100:.2f}"
        line, metrics_line = [x for x in markdown.splitlines() if x.startswith(f"| {condition} |")][:2]
        assert cell in line and cell in printed, (condition, cell, line)
        truncation = [t["truncation"] for t in runs]  # the D_test metrics table: truncation rate over seeds
        assert f"| {statistics.mean(truncation):.3f} ± {statistics.stdev(truncation):.3f} |" in metrics_line
        row = rows[condition]
        assert float(row["test_mean"]) == pytest.approx(mean) and float(row["test_std"]) == pytest.approx(std)
        assert float(row["training_rollouts"]) == pytest.approx(statistics.mean(t["rollouts"] for t in runs))
        hits = [n for n in reached[condition] if n is not None]
        assert int(row["seeds_reached"]) == len(hits)
        assert (float(row["rollouts_to_reach_mean"]) if row["rollouts_to_reach_mean"] else None) == (
            pytest.approx(statistics.mean(hits)) if hits else None)
    own = statistics.mean(reached["rsft_only"])  # weight-only reaches its own best val, by definition
    assert float(rows["rsft_only"]["reach_ratio_to_weight_only"]) == pytest.approx(1.0)
    if own and rows["mh_only"]["rollouts_to_reach_mean"]:
        assert float(rows["mh_only"]["reach_ratio_to_weight_only"]) == pytest.approx(
            float(rows["mh_only"]["rollouts_to_reach_mean"]) / own)
    # the paper's numbers for math, labelled as the paper's, in their own column
    assert "[paper] mean@8" in markdown.splitlines()[2]
    assert float(rows["rsft_only"]["paper_mean8_percent"]) == 15.42 and float(rows["mh_only"]["paper_mean8_percent"]) == 0.42
    runs_csv = list(csv.DictReader((out / "runs.csv").open()))
    assert sorted((r["condition"], r["seed"]) for r in runs_csv) == sorted(
        (c, str(t["seed"])) for c, runs in truth.items() for t in runs)
    for name in ("compare.png", "chain.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000, name
    assert (out / "index.html").stat().st_size > 0


def test_compare_default_output_is_beside_the_study(small_study, tmp_path, capsys):
    """One run directory also compares (a table of one condition and one seed); output goes to DIR/compare."""
    run = tmp_path / "one"
    shutil.copytree(small_study / "mh_only-s0", run)
    assert main(["compare", str(run)]) == 0
    assert "(one seed)" in (run / "compare" / "compare.md").read_text()
    assert "no weight-only (rsft_only) run" in capsys.readouterr().out


def one_error_line(capsys) -> str:
    out = capsys.readouterr().out.strip()
    assert len(out.splitlines()) == 1, out
    return out


def test_bad_input_is_one_line(small_study, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["compare", str(empty)]) == 2
    assert f"{empty}: not a run directory, and no run directory below it" in one_error_line(capsys)
    assert main(["compare", str(tmp_path / "nope")]) == 2
    assert f"{tmp_path / 'nope'}: no such directory" in one_error_line(capsys)
    # a run of another domain beside the math runs: its config.yaml names search_qa
    other = tmp_path / "mixed" / "search"
    shutil.copytree(small_study / "mh_only-s1", other)
    cfg = yaml.safe_load((other / "config.yaml").read_text())
    (other / "config.yaml").write_text(yaml.safe_dump({**cfg, "domain": "search_qa"}))
    shutil.copytree(small_study / "mh_only-s0", tmp_path / "mixed" / "math")
    assert main(["compare", str(tmp_path / "mixed")]) == 2
    line = one_error_line(capsys)
    assert "runs of different domains in one compare" in line and "search_qa (search)" in line, line
    # a state.json that is not a run state
    broken = tmp_path / "broken"
    shutil.copytree(small_study / "mh_only-s0", broken)
    (broken / "state.json").write_text("{not json")
    assert main(["compare", str(broken)]) == 2
    assert f"{broken}/state.json: not a run state" in one_error_line(capsys)
    assert main(["report", str(empty)]) == 2
    assert f"{empty}: not a run directory (no state.json)" in one_error_line(capsys)
