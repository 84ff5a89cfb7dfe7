"""`whale status RUN_DIR` through the real CLI, over a run directory written by the run's own writers
(RunDirectory, Archive, RunState): mid-run and finished; a missing or non-run directory is exit 2."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers import small_config
from whale_ray.archive import Archive
from whale_ray.domain import get_domain
from whale_ray.loop import RunDirectory
from whale_ray.records import Rollout
from whale_ray.run_state import Evaluation, PhaseProgress, Selection


def status(path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "whale_ray.cli", "status", str(path)], capture_output=True,
                          text=True, timeout=120)


def rollout(phase: str, i: int, reward: float) -> Rollout:
    return Rollout(phase=phase, cycle=0, harness_id="h0", task_id=f"t{i}", sample=0, seed=i, weight_version=0,
                   status="ok", reason="", reward=reward, answer="1", turns=1, truncated=False, prompt_tokens=3,
                   completion_tokens=2, wall_s=0.1, calls=[], trace="{}")


def make_run(tmp_path):
    cfg = small_config(tmp_path / "run")
    run = RunDirectory(cfg.run_dir)
    archive = Archive(run.root / "archive")
    archive.add_candidate(get_domain(cfg.domain).h0_path.read_text(), parent=None, hypothesis="seed", iteration=0,
                          cycle=0, candidate_id="h0")
    archive.add_candidate("def run(task):\n    return None\n", parent="h0", hypothesis="x", iteration=1, cycle=0)
    run.create(cfg)
    run.write_rollouts("val-v00000-h0", "val", 0, [rollout("val", i, 0.5) for i in range(4)])
    run.write_rollouts("test-v00000-h0", "test", 0, [rollout("test", i, 0.25) for i in range(8)])
    run.write_rollouts("weight-c00-s0000", "weight", 0, [rollout("weight", i, 1.0) for i in range(4)])
    state = run.state
    state.evaluations.append(Evaluation(split="test", weight_version=0, harness_id="h0", samples=2, mean=0.375))
    state.best = Selection(weight_version=0, checkpoint=None, harness_id="h0", val=0.5)
    state.phase = PhaseProgress(cycle=0, index=0, kind="weight", units_done=1)
    state.weight_version = 1
    run.commit()
    return cfg, run


def test_status_of_a_run_in_progress(tmp_path):
    cfg, run = make_run(tmp_path)
    (run.root / "events.jsonl").write_text("\n".join(json.dumps(e) for e in [
        {"time": "t1", "kind": "actor_died", "actor": "SandboxEvaluator"},
        {"time": "t2", "kind": "recovered", "actor": "PolicyServer", "weight_version": 1},
    ]) + "\nnot json\n")
    out = status(run.root)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert f"cycle 1/{cfg.cycles}, weight phase running (1 steps done)" in text
    assert "rollouts:  weight 4, val 4, test 8" in text and "training 4, eval 12" in text
    assert "version 1 (base model)" in text
    assert "2 candidates, 0 evaluated" in text
    assert "best:      v0+h0  val 0.500  test 0.375 (mean@2)" in text
    assert "t2 recovered actor=PolicyServer weight_version=1" in text and "not json" in text


def test_status_names_the_checkpoint_being_written_beside_the_harness_phase(tmp_path):
    _, run = make_run(tmp_path)
    run.state.phase = PhaseProgress(cycle=0, index=1, kind="harness")
    run.state.checkpoint_pending = "checkpoints/v00001"
    run.commit()
    out = status(run.root)
    assert "version 1 (base model; checkpoints/v00001 being written)" in out.stdout, out.stdout


def test_status_of_a_finished_run(tmp_path):
    cfg, run = make_run(tmp_path)
    run.state.finished, run.state.cycle, run.state.phase = True, cfg.cycles, None
    run.commit()
    out = status(run.root)
    assert out.returncode == 0, out.stderr
    assert f"finished ({cfg.cycles}/{cfg.cycles} cycles)" in out.stdout
    assert "last events" not in out.stdout  # no events.jsonl


def test_status_needs_a_run_directory(tmp_path):
    for path, why in [(tmp_path / "nothing", "no such directory"), (tmp_path, "not a run directory (no state.json)")]:
        out = status(path)
        assert out.returncode == 2
        assert out.stdout.strip().count("\n") == 0 and why in out.stdout, out.stdout
    (tmp_path / "state.json").write_text("{not json")
    out = status(tmp_path)
    assert out.returncode == 2 and "state.json: not a run state" in out.stdout
