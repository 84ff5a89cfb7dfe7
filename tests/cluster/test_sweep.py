"""`whale sweep`: bad sweep files are one line before any trial starts; a real 4-trial ASHA sweep (a subprocess
with its own local Ray cluster) stops the trials whose val lags, runs trials side by side, and resumes after a
SIGKILL of the whole process group without rerunning a trial Tune had finished."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.helpers import SMALL, check_placed, nested, spans, starts
from tests.run_truth import guessing_math_harness
from whale_ray.config import ConfigError, load_config
from whale_ray.run_state import RunState
from whale_ray.sweep import load_sweep, parse_sweep


@pytest.mark.parametrize("tree, message", [
    ({"space": {"weight.lr": {"grid": [1e-4]}}}, r"space\.weight\.lr: .*weight\.lr is not a run setting"),
    ({"space": {}}, r"space: empty"),
    ({"points": [], "space": {}}, r"space: empty"),
    ({"space": {"E": {"grid": []}}}, r"space\.E: grid is empty"),
    ({"space": {"E": {"uniform": [0.6, 0.2]}}}, r"space\.E: uniform bounds \[0\.6, 0\.2\]: the lower bound must be"),
    ({"space": {"weight.learning_rate": {"loguniform": [0, 1e-3]}}}, r"space\.weight\.learning_rate: loguniform"),
    ({"space": {"I": {"randint": [5, 5]}}}, r"space\.I: randint bounds"),
    ({"space": {"I": {"uniform": [2, 6]}}}, r"space\.I: uniform value 4\.57.*: I: Input should be a valid integer"),
    ({"space": {"E": {"grid": [0.2, 0.0]}}}, r"space\.E: grid value 0\.0: E: E must be a positive"),
    ({"space": {"E": {"uniform": [-0.5, 0.5]}}}, r"space\.E: uniform value -0\.5: E: E must be a positive"),
    ({"points": [[0.2, 2], [-1, 6]]}, r"points\[1\]: E: E must be a positive"),
    ({"points": [{"E": 0.2, "weight.nope": 1}]}, r"points\[0\]: weight\.nope is not a run setting"),
    ({"points": [[0.2, 2]], "metric": "test_mean8"}, r"metric: 'test_mean8' is not a validation score"),
    ({"points": [[0.2, 2]], "metric": "train_reward"}, r"metric: 'train_reward' is not a validation score"),
    ({"points": [[0.2, 2]], "scheduler": {"kind": "asha", "max_rollouts": 100}}, r"scheduler: kind asha needs"),
    ({"points": [[0.2, 2]], "scheduler": {"kind": "asha", "max_rollouts": 10, "grace_rollouts": 50}},
     r"grace_rollouts 50 exceeds max_rollouts 10"),
    ({"points": [[0.2, 2]], "search": {"kind": "annealing"}}, r"search\.kind: unknown search kind 'annealing'"),
    ({"space": {"condition": {"choice": ["whale", "weights"]}}}, r"space\.condition: choice value 'weights'"),
    ({"points": [[0.2, 2]], "shedule": {}}, r"shedule: not a sweep setting"),
])
def test_bad_sweep_is_one_line_naming_the_key(tree, message):
    with pytest.raises(ConfigError, match=message) as err:
        parse_sweep(tree, origin="sweep file s.yaml")
    assert str(err.value).startswith("sweep file s.yaml: ") and "\n" not in str(err.value)


def test_searcher_without_its_package_is_named():
    pytest.importorskip("ray.tune")
    try:
        import optuna  # noqa: F401
        pytest.skip("optuna is installed here")
    except ImportError:
        pass
    with pytest.raises(ConfigError, match=r"search\.kind: search kind 'optuna' needs the Python package 'optuna'"):
        parse_sweep({"space": {"E": {"uniform": [0.2, 1.0]}}, "search": {"kind": "optuna"}})


def test_a_trial_takes_one_evaluator_unless_the_sweep_counts_them(tmp_path):
    """Trials side by side share the cores: the default pool (`sandbox.evaluators: cores`) is one evaluator a
    trial, in the configs that size the trials' placement groups and in the trials' own."""
    from whale_ray.sweep import edge_configs
    from whale_ray.sweep.trial import trial_config
    from whale_ray.sweep.tuner import param_space

    for base, evaluators in (({}, 1), ({"sandbox": {"evaluators": 3}}, 3)):
        sweep = parse_sweep({"base": base, "points": [{"seed": 0}, {"seed": 1}]})
        assert [c.sandbox.evaluators for c in edge_configs(sweep)] == [evaluators, evaluators]
        params = {**param_space(sweep, tmp_path, "", "study"), "point": {"condition": "whale", "seed": 0}}
        assert trial_config(params).sandbox.evaluators == evaluators


def test_the_shipped_sweep_files_load_and_the_cli_rejects_a_bad_one(tmp_path, capsys):
    from whale_ray.cli import main

    for path in sorted(Path("tune_configs").glob("*.yaml")):
        assert load_sweep(path).scheduler.kind == "asha"
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"space": {"E": {"grid": [0.6, -0.2]}}}))
    assert main(["sweep", str(bad), "--root", str(tmp_path / "root")]) == 2
    out = capsys.readouterr().out.strip()
    assert out.count("\n") == 0 and "bad.yaml: space.E: grid value -0.2" in out
    assert not (tmp_path / "root").exists()  # before any trial (or Ray) started


# ------------------------------------------------------------------------------ the ASHA sweep, killed
def harnesses(folder: Path) -> tuple[Path, Path]:
    """A math harness that always hands the verifier the right answer (val 1) and one that never answers
    (val 0): which trials ASHA must stop is then known, whatever the tiny policy samples."""
    from whale_ray.domain import get_domain

    source = guessing_math_harness(get_domain("math_reasoning").h0_path.read_text())
    coin = 'if len(text) % 2 == 0 and QUESTION.get("value") is not None:'
    answer = 'return "\\\\boxed{" + str(QUESTION["value"]) + "}"'
    assert source.count(coin) == 1 and source.count(answer) == 1, "the guessing harness changed"
    good = source.replace(coin, 'if QUESTION.get("value") is not None:')
    (folder / "good.py").write_text(good)
    (folder / "bad.py").write_text(good.replace(answer, 'return "no answer"'))
    return folder / "good.py", folder / "bad.py"


def tune_statuses(root: Path) -> dict[str, str]:
    """trial id -> status in Tune's experiment checkpoint: what a restored Tuner will see."""
    out = {}
    for path in sorted((root / "tune" / "whale-sweep").glob("experiment_state-*.json")):
        try:
            for trial_json, _ in json.loads(path.read_text())["trial_data"]:
                trial = json.loads(trial_json)
                out[trial["trial_id"]] = trial["status"]
        except (json.JSONDecodeError, KeyError, ValueError):
            pass  # being rewritten
    return out


def launch(sweep_file: Path, root: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own local cluster
    return subprocess.Popen([sys.executable, "-m", "whale_ray.cli", "sweep", str(sweep_file), "--root", str(root)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)


@pytest.mark.slow
def test_asha_sweep_stops_laggards_runs_side_by_side_and_resumes_after_sigkill(tmp_path, tiny_policy):
    good, bad = harnesses(tmp_path)
    base = nested({**SMALL, "condition": "rsft_only", "policy.model": tiny_policy})
    # Grid order is start order; two trials fit side by side on the 4-CPU local cluster (each: PolicyServer 1
    # CPU + evaluator 0.25 in its group, Train worker 0.5), so the good pair reaches the 8-rollout rung first.
    sweep = {"base": base, "points": [{"harness": str(h), "seed": s} for h in (good, bad) for s in (0, 1)],
             "scheduler": {"kind": "asha", "max_rollouts": 32, "grace_rollouts": 8, "reduction_factor": 2},
             "metric": "best_val", "max_concurrent_trials": "auto"}
    sweep_file, root = tmp_path / "asha.yaml", tmp_path / "root"
    sweep_file.write_text(yaml.safe_dump(sweep))

    proc = launch(sweep_file, root)
    while not any(s == "TERMINATED" for s in tune_statuses(root).values()):  # pytest's timeout is the limit
        assert proc.poll() is None, f"the sweep ended before the kill point:\n{proc.stdout.read()[-3000:]}"
        time.sleep(0.05)
    killed_at = time.time()
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    done_before = {t for t, s in tune_statuses(root).items() if s == "TERMINATED"}
    dirs = {d.name.split("-")[0]: d for d in root.iterdir() if (d / "config.yaml").is_file()}
    before = {t: ((dirs[t.split("_")[1]] / "state.json").read_bytes(), starts(dirs[t.split("_")[1]]))
              for t in done_before}

    proc = launch(sweep_file, root)
    out, _ = proc.communicate()
    assert proc.returncode == 0, out[-3000:]

    runs = sorted(d for d in root.iterdir() if (d / "config.yaml").is_file())
    assert len(runs) == 4
    for trial_id, (state_bytes, n_starts) in before.items():  # finished before the kill: not run again
        run = dirs[trial_id.split("_")[1]]
        assert (run / "state.json").read_bytes() == state_bytes and starts(run) == n_starts == 1
    states = {r.name: RunState.load(r) for r in runs}
    finished = {n for n, s in states.items() if s.finished}
    stopped = set(states) - finished
    assert finished == {r.name for r in runs if "harness=good" in r.name}, states
    assert stopped == {r.name for r in runs if "harness=bad" in r.name}
    full = {states[n].ledger.training_rollouts for n in finished}
    assert full == {16} and all(states[n].ledger.training_rollouts < 16 for n in stopped)
    # side by side: two launches' [start, end] intervals overlap (a launch killed with the first sweep ran until the
    # kill), each trial's actors in its own group
    ran = [span for run in runs for span in spans(run, killed_at)]
    assert any(a[0] < b[1] and b[0] < a[1] for i, a in enumerate(ran) for b in ran[i + 1:]), ran
    groups = [check_placed(run) for run in runs]
    assert all(groups) and len(set().union(*groups)) == sum(map(len, groups))

    # the outputs: best first by val, the plot, the Pareto set, the best config ready to run
    with open(root / "sweep.csv") as f:
        table = list(csv.DictReader(f))
    assert "harness=good" in table[0]["trial"] and {r["ended"] for r in table} == {"finished", "stopped early"}
    assert (root / "sweep.png").stat().st_size > 0 and (root / "pareto.csv").is_file()
    best = load_config(root / "best.yaml", {})
    assert Path(best.harness).name == "good.py" and best.run_dir.name.startswith("best-")


def test_a_root_holding_another_sweep_is_refused(tmp_path, capsys):
    from whale_ray.cli import main
    from whale_ray.sweep import RECORD

    root = tmp_path / "root"
    root.mkdir()
    first = parse_sweep({"points": [[0.2, 2]]})
    (root / RECORD).write_text(yaml.safe_dump(first.model_dump(mode="json")))
    other = tmp_path / "other.yaml"
    other.write_text(yaml.safe_dump({"points": [[0.2, 2], [0.6, 6]]}))
    assert main(["sweep", str(other), "--root", str(root)]) == 2
    out = capsys.readouterr().out.strip()
    assert "\n" not in out and f"--root {root}: holds another sweep (differs in points)" in out
    assert sorted(p.name for p in root.iterdir()) == [RECORD]  # nothing started
