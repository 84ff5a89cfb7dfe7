"""Tracking (whale_ray/tracking/): runs mirrored to MLflow, TensorBoard and W&B, read back with their own readers.

The shared small study (tests/study_runs.py, `whale study --track mlflow,tensorboard[,wandb]`) is the tracked
sweep: its four trials in one MLflow experiment of the default SQLite store, their conditions and seeds as tags,
and, where wandb is installed (the tracking extra), one W&B offline run each, read with `wandb leet inspect`. One
short `whale run` of its own has an MLflow URI where nothing listens. The rest runs in process over copies of the
study's run directories (one W&B launch in a subprocess, to be killed).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from tests.helpers import SMALL, nested
from tests.study_runs import CONDITIONS, SEEDS
from whale_ray.config import TrackingConfig, load_config, with_trackers
from whale_ray.events import read_events
from whale_ray.run_state import RunState
from whale_ray.tracking import registry
from whale_ray.tracking.records import params
from whale_ray.tracking.session import TrackingSession

mlflow = pytest.importorskip("mlflow")
from mlflow import MlflowClient  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")
PAIRS = [f"{c}-s{s}" for c in CONDITIONS for s in SEEDS]


def steps(client: MlflowClient, run_id: str, key: str) -> list[tuple[int, float]]:
    return [(m.step, m.value) for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.timestamp)]


def artifacts(client: MlflowClient, run_id: str, folder: str) -> set[str]:
    return {Path(a.path).name for a in client.list_artifacts(run_id, folder)}


def expected_weight(run: Path, state: RunState) -> dict[str, list[tuple[int, float]]]:
    """Per weight step, from the run directory itself: the loss, the gradient's norm, the tokens, the mean reward and
    the accepted fraction (reward 1 and status ok)."""
    out: dict[str, list[tuple[int, float]]] = {k: [] for k in ("weight/loss", "weight/grad_norm", "weight/tokens",
                                                                "weight/reward", "weight/accepted_fraction")}
    for i, name in enumerate(state.train_steps, start=1):
        record = json.loads((run / "train" / f"{name}.json").read_text())
        table = pq.read_table(run / "rollouts" / f"{record['rollout_file']}.parquet").to_pydict()
        rewards = table["reward"]
        out["weight/loss"].append((i, record["metrics"]["loss"]))
        out["weight/grad_norm"].append((i, record["metrics"]["grad_norm"]))
        out["weight/tokens"].append((i, record["metrics"]["n_tokens"]))
        out["weight/reward"].append((i, sum(rewards) / len(rewards)))
        accepted = sum(r == 1 and s == "ok" for r, s in zip(rewards, table["status"]))
        out["weight/accepted_fraction"].append((i, accepted / len(rewards)))
    return out


@pytest.fixture(scope="module")
def study_store(small_study):
    client = MlflowClient(tracking_uri=f"sqlite:///{small_study / 'mlflow.db'}")
    experiment = client.get_experiment_by_name(f"whale-study-{small_study.name}")
    assert experiment is not None
    runs = client.search_runs([experiment.experiment_id])
    return client, {r.info.run_name: r for r in runs}


@pytest.mark.slow
def test_a_study_is_one_experiment_with_its_conditions_and_seeds_as_tags(small_study, study_store):
    client, runs = study_store
    assert sorted(runs) == sorted([*PAIRS, "compare"])
    for name in PAIRS:
        run = runs[name]
        condition, seed = name.rsplit("-s", 1)
        assert (run.data.tags["condition"], run.data.tags["seed"]) == (condition, seed)
        assert (run.data.tags["sweep.condition"], run.data.tags["sweep.seed"]) == (condition, seed)
        assert run.info.status == "FINISHED"
        config = yaml.safe_load((small_study / name / "config.yaml").read_text())
        assert run.data.params["condition"] == condition and run.data.params["E"] == "0.25"
        assert run.data.params["weight.prompts_per_step"] == str(config["weight"]["prompts_per_step"])
        assert json.loads((small_study / name / "tracking.json").read_text())["mlflow"]["resume"]["run_id"] == \
            run.info.run_id
    assert "compare.png" in artifacts(client, runs["compare"].info.run_id, "compare")


@pytest.mark.slow
def test_every_step_iteration_and_cycle_reads_back_in_order(small_study, study_store, tmp_path):
    client, runs = study_store
    for name in PAIRS:
        run, run_id = small_study / name, runs[name].info.run_id
        state = RunState.load(run)
        for key, want in expected_weight(run, state).items():
            got = steps(client, run_id, key)
            assert [s for s, _ in got] == [s for s, _ in want], (name, key)
            assert [v for _, v in got] == pytest.approx([v for _, v in want]), (name, key)
        assert steps(client, run_id, "harness/accepted_success") == [
            (row.iteration, pytest.approx(row.accepted_success)) for row in state.iterations]
        assert steps(client, run_id, "cycle/val") == [(row.cycle, pytest.approx(row.val)) for row in state.history]
        assert steps(client, run_id, "cycle/test_mean_at_k")[-1][1] == pytest.approx(state.history[-1].test_mean8)
        assert steps(client, run_id, "ledger/training_rollouts")[-1][1] == state.ledger.training_rollouts
        assert runs[name].data.tags["best_pair"] == state.history[-1].best
        if name.startswith("rsft_only"):
            assert state.train_steps and not state.iterations
        else:
            assert not state.train_steps and len(state.iterations) == SMALL["I"]
            row = state.iterations[-1]
            local = client.download_artifacts(run_id, f"harness/iteration-{row.iteration:04d}.json", str(tmp_path))
            assert json.loads(Path(local).read_text())["accepted"] == row.accepted
        assert {"index.html", "summary.md"} <= artifacts(client, run_id, "report")
        assert artifacts(client, run_id, "harness/accepted") == {f"{state.accepted_harness}.py"}


@pytest.mark.slow
def test_tensorboard_event_files_read_back_with_tensorboards_reader(small_study):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for name in PAIRS:
        run = small_study / name
        state = RunState.load(run)
        events = EventAccumulator(str(run / "tensorboard"))
        events.Reload()
        val = [(e.step, e.value) for e in events.Scalars("cycle/val")]
        assert val == [(row.cycle, pytest.approx(row.val)) for row in state.history]
        if state.train_steps:
            want = expected_weight(run, state)["weight/loss"]
            got = events.Scalars("weight/loss")
            assert [e.step for e in got] == [s for s, _ in want]
            assert [e.value for e in got] == pytest.approx([v for _, v in want])
        assert "config/text_summary" in events.Tags()["tensors"]  # the resolved config, as text


def copy_run(small_study: Path, tmp_path: Path, name: str = "mh_only-s0") -> Path:
    run = tmp_path / "runs" / name
    shutil.copytree(small_study / name, run, ignore=shutil.ignore_patterns("tracking.json", "tensorboard", "wandb"))
    return run


def session(run: Path, **sections) -> TrackingSession:
    cfg = TrackingConfig.model_validate({"poll_s": 60, **sections})
    s = TrackingSession(cfg, run, "resume-test", {})
    s.start()
    return s


@pytest.mark.slow
def test_a_relaunch_continues_the_same_mlflow_run_without_logging_a_step_twice(small_study, tmp_path):
    run = copy_run(small_study, tmp_path)
    full = (run / "state.json").read_text()
    state = RunState.load(run)
    cut = state.model_copy(update={"iterations": state.iterations[:1], "history": state.history[:1]})
    cut.save(run)  # the first launch ends after one iteration and the start row
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    first = session(run, mlflow={"uri": uri})
    first.finish("KILLED")
    (run / "state.json").write_text(full)  # the relaunch goes on to the end
    second = session(run, mlflow={"uri": uri})
    second.finish("FINISHED")

    client = MlflowClient(tracking_uri=uri)
    [one] = client.search_runs([client.get_experiment_by_name("resume-test").experiment_id])
    assert one.info.status == "FINISHED"
    assert [s for s, _ in steps(client, one.info.run_id, "harness/accepted_success")] == [
        row.iteration for row in state.iterations]
    assert [s for s, _ in steps(client, one.info.run_id, "cycle/val")] == [row.cycle for row in state.history]


NO_WANDB = "W&B is used where wandb is installed (the tracking extra: scripts/setup.sh installs it)"


def wandb_logs(folder: Path) -> list[list[dict]]:
    """The records of each W&B offline run under <folder>/wandb (one per launch, oldest first), as wandb's own
    reader prints them (`wandb leet inspect --json`)."""
    from whale_ray.tracking.wandb_tracker import launches

    env = {k: v for k, v in os.environ.items() if k != "WANDB_SERVICE"}
    env.update(WANDB_MODE="offline", WANDB_ERROR_REPORTING="false")
    logs = []
    ids = {p.parent.name.split("-")[3] for p in (folder / "wandb").glob("offline-run-*/run-*.wandb")}
    assert len(ids) <= 1, ids  # one W&B run
    for path in launches(folder / "wandb", ids.pop()) if ids else []:
        out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(path)],
                             capture_output=True, text=True, env=env, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        logs.append([json.loads(line) for line in out.stdout.splitlines()])
    return logs


def of(logs: list[list[dict]], kind: str) -> list[dict]:
    return [r[kind] for log in logs for r in log if r["type"] == kind]


def wandb_rows(logs: list[list[dict]], axis: str, key: str) -> list[tuple[int, float]]:
    return [(h["item"][f"{axis}_step"], h["item"].get(key)) for h in of(logs, "history") if f"{axis}_step" in h["item"]]


def saved(logs: list[list[dict]]) -> set[str]:
    return {f["path"] for files in of(logs, "files") for f in files["files"]}


def summary(logs: list[list[dict]]) -> dict:
    out: dict = {}
    for s in of(logs, "summary"):
        out.update(s.get("update", {}))
    return out


def check_wandb_run(run: Path, logs: list[list[dict]]) -> None:
    """Every launch's offline run is the one run tracking.json names; between them, the resolved config, each weight
    step, harness iteration and cycle once and in order, and the files."""
    state = RunState.load(run)
    runs = of(logs, "run")
    assert {r["run_id"] for r in runs} == {json.loads((run / "tracking.json").read_text())["wandb"]["resume"]["id"]}
    assert [bool(r.get("resume")) for r in runs] == [False] + [True] * (len(runs) - 1)
    config: dict = {}
    for c in of(logs, "config"):
        config.update(c.get("update", {}))
    assert {k: config.get(k) for k in params(run)} == params(run)
    for key, want in expected_weight(run, state).items():
        got = wandb_rows(logs, "weight", key)
        assert [s for s, _ in got] == [s for s, _ in want], key
        assert [v for _, v in got] == pytest.approx([v for _, v in want]), key
    assert wandb_rows(logs, "harness", "harness/accepted_success") == [
        (row.iteration, pytest.approx(row.accepted_success)) for row in state.iterations]
    assert wandb_rows(logs, "cycle", "cycle/val") == [(row.cycle, pytest.approx(row.val)) for row in state.history]
    assert wandb_rows(logs, "cycle", "cycle/test_mean_at_k") == [
        (row.cycle, pytest.approx(row.test_mean8)) for row in state.history]
    assert [h["item"]["_step"] for h in of(logs, "history")] == list(range(len(of(logs, "history"))))
    assert {"report/index.html", "report/summary.md", f"harness/accepted/{state.accepted_harness}.py",
            *(f"harness/iteration-{row.iteration:04d}.json" for row in state.iterations)} <= saved(logs)
    assert summary(logs)["whale_status"] == "FINISHED" and of(logs, "exit")[-1]["exit_code"] == 0
    assert summary(logs)["best_pair"] == state.history[-1].best


@pytest.mark.slow
def test_wandb_offline_runs_read_back_with_wandbs_reader(small_study):
    pytest.importorskip("wandb", reason=NO_WANDB)
    for name in PAIRS:
        logs = wandb_logs(small_study / name)
        assert logs and {r["run_group"] for r in of(logs, "run")} == {f"whale-study-{small_study.name}"}
        check_wandb_run(small_study / name, logs)
        assert of(logs, "run")[0]["config"]["update"]["tags"]["condition"] == name.rsplit("-s", 1)[0]
    compare = wandb_logs(small_study / "compare")  # the study's comparison: a run of its own in the study's group
    assert {r["display_name"] for r in of(compare, "run")} == {"compare"}
    assert {"compare/compare.png", "compare/compare.md"} <= saved(compare)


def wandb_cores(pid: int) -> list[str]:
    """The wandb-core service processes that process `pid` started."""
    ps = subprocess.run(["ps", "-ww", "-eo", "args"], capture_output=True, text=True).stdout.splitlines()
    return [line for line in ps if "wandb-core" in line and f" --pid {pid} " in f"{line} "]


KILLED_LAUNCH = """
import sys, time
from whale_ray.config import TrackingConfig
from whale_ray.tracking.session import TrackingSession
s = TrackingSession(TrackingConfig.model_validate({"poll_s": 60, "wandb": {}}), sys.argv[1], "resume-test", {})
s.start()
s.sync()
print("synced", flush=True)
time.sleep(600)
"""


@pytest.mark.slow
def test_a_killed_launch_loses_no_wandb_step_and_the_relaunch_logs_none_twice(small_study, tmp_path, monkeypatch):
    """wandb-core writes its log in blocks: a launch killed before a block was flushed lost what it had sent, though
    tracking.json counts it. The relaunch continues the same run from what the log holds."""
    wandb = pytest.importorskip("wandb", reason=NO_WANDB)
    monkeypatch.setenv("WANDB_SERVICE", "")  # the launches in process start a service of their own, gone after
    monkeypatch.setenv("WANDB_ERROR_REPORTING", "false")
    run = copy_run(small_study, tmp_path)
    full = (run / "state.json").read_text()
    state = RunState.load(run)
    state.model_copy(update={"iterations": state.iterations[:1], "history": state.history[:1]}).save(run)
    try:
        first = session(run, wandb={})  # ends after one iteration and the start row, its run closed (KILLED)
        first.finish("KILLED")
        (run / "state.json").write_text(full)
        env = {k: v for k, v in os.environ.items() if k != "WANDB_SERVICE"}
        second = subprocess.Popen([sys.executable, "-c", KILLED_LAUNCH, str(run)], stdout=subprocess.PIPE, text=True,
                                  env=env)  # sends the rest, then is killed (no run.finish, no flush)
        try:
            lines = []
            for line in second.stdout:  # its one line of W&B, then ours
                lines.append(line)
                if line.startswith("synced"):
                    break
            assert lines[-1:] == ["synced\n"] and len(lines) == 2, lines
            assert wandb_cores(second.pid)
        finally:
            second.kill()  # SIGKILL
            second.wait()
        deadline = time.monotonic() + 20
        while wandb_cores(second.pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not wandb_cores(second.pid)  # its wandb-core went with it
        third = session(run, wandb={})
        third.finish("FINISHED")
    finally:
        wandb.teardown()
    logs = wandb_logs(run)
    assert len(logs) == 3
    check_wandb_run(run, logs)
    assert [e["exit_code"] for e in of(logs, "exit")] == [1, 0]  # the killed launch wrote none


class Stalling:
    """A tracker whose server takes far longer than tracking.timeout_s to answer."""

    def __init__(self, section, run_dir, experiment):
        self.target = "http://stalled.invalid"

    def open(self, name, tags, resume):
        return {}

    def log_params(self, params):
        time.sleep(30)

    def log_point(self, point):
        raise AssertionError("a tracker that stalled is called no more")

    log_files = close = log_point


@pytest.mark.slow
def test_a_slow_tracker_is_named_once_and_never_holds_the_run(small_study, tmp_path, monkeypatch, caplog):
    run = copy_run(small_study, tmp_path)
    monkeypatch.setitem(registry.TRACKERS, "wandb", lambda: Stalling)
    started = time.perf_counter()
    s = session(run, tensorboard={}, wandb={}, timeout_s=1)
    s.sync()
    s.sync()
    s.finish("FINISHED")
    assert time.perf_counter() - started < 20  # one bounded wait, then the tracker is skipped
    failed = [e for e in read_events(run) if e["kind"] == "tracker_failed"]
    assert len(failed) == 1 and "http://stalled.invalid" in failed[0]["message"]
    assert "no answer within 1 s" in failed[0]["message"]
    assert sum("stalled.invalid" in r.getMessage() for r in caplog.records) == 1
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"))  # the other tracker went on
    events.Reload()
    assert [e.step for e in events.Scalars("cycle/val")] == [row.cycle for row in RunState.load(run).history]


def test_track_flags_turn_sections_on_and_keep_what_a_config_gives():
    from whale_ray.cli import parse_args, resolve_config

    args = parse_args(["run", "--track", "tensorboard", "--mlflow-uri", "http://mlflow:5000"])
    tracking = resolve_config(args).tracking
    assert tracking.enabled() == ["mlflow", "tensorboard"] and tracking.mlflow.uri == "http://mlflow:5000"
    tree = with_trackers({"tracking": {"mlflow": {"experiment": "mine"}}}, ["mlflow", "tensorboard"], None)
    assert tree["tracking"]["mlflow"] == {"experiment": "mine"} and tree["tracking"]["tensorboard"] == {}
    assert load_config(None, {}).tracking.enabled() == []  # off unless asked for
    with pytest.raises(SystemExit):
        parse_args(["run", "--track", "mlflow,comet"])


@pytest.mark.slow
def test_a_refused_tracker_uri_is_named_once_and_the_run_finishes(tmp_path, tiny_policy):
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(nested({**SMALL, "cycles": 1, "E": 0.25, "policy.model": tiny_policy,
                                             "tracking.timeout_s": 5})))
    run = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI")}
    out = subprocess.run([sys.executable, "-m", "whale_ray.cli", "run", "--config", str(config), "--run-dir",
                          str(run), "--track", "tensorboard", "--mlflow-uri", "http://127.0.0.1:1"],
                         capture_output=True, text=True, env=env, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert RunState.load(run).finished
    failed = [e for e in read_events(run) if e["kind"] == "tracker_failed"]
    assert len(failed) == 1 and "mlflow at http://127.0.0.1:1" in failed[0]["message"], failed
    assert (out.stdout + out.stderr).count("tracker_failed: tracking: mlflow at http://127.0.0.1:1") == 1
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))  # TensorBoard went on
