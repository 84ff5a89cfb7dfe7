"""Run directories made by an older whale-ray: their config.yaml and state.json are read into today's shape.

tests/data/config_v1_math.yaml is what whale-ray wrote before the domain plug-ins and the loop reshape
(`dump_config(WhaleConfig(run_dir="runs/old"))` at commit dac5090): search_qa's sections in a math run,
no config_version, and none of the keys added since.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from whale_ray.config import dump_config, load_config, load_recorded_config
from whale_ray.loop import RunDirectory
from whale_ray.run_state import RunState

DATA = Path(__file__).resolve().parents[1] / "data"


def old_run(tmp_path: Path) -> Path:
    run = tmp_path / "runs" / "old"
    run.mkdir(parents=True)
    shutil.copy(DATA / "config_v1_math.yaml", run / "config.yaml")
    return run


def test_an_old_config_resumes_when_nothing_was_changed(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = old_run(tmp_path)
    assert RunDirectory(run).config_conflicts(load_config(None, {"run_dir": "runs/old"})) == []


def test_a_real_conflict_is_named(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = old_run(tmp_path)
    conflicts = RunDirectory(run).config_conflicts(load_config(None, {"run_dir": "runs/old", "E": 0.2,
                                                                      "weight.checkpoint_every": 3}))
    assert conflicts == ["E: 0.6 -> 0.2", "weight.checkpoint_every: 1 -> 3"]


@pytest.mark.parametrize("layout, ingress, preset", [("replica", "proxy", "cpu"), ("actor", "direct", "cpu"),
                                                     ("shared", "haproxy", "gpu")])
def test_a_recorded_endpoint_reads_as_the_preset_it_matches(tmp_path, layout, ingress, preset):
    """A version 3 config.yaml records the endpoint's layout, ingress and flags: `whale serve --run-dir` on it serves
    the preset of that layout, on the resources it recorded."""
    tree = yaml.safe_load(dump_config(load_config(None, {"run_dir": str(tmp_path)})))
    tree["config_version"] = 3
    tree["serve"] = {"port": 8123, "replica_cpus": 0.5, "replica_gpus": 0.25, "engine_layout": layout,
                     "ingress": ingress, "access_log": False, "user_code_thread": False}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(tree))
    serve = load_recorded_config(tmp_path / "config.yaml").serve
    assert (serve.preset, serve.port, serve.engine_cpus, serve.engine_gpus) == (preset, 8123, 0.5, 0.25)


@pytest.mark.parametrize("use_gpu", [True, False])
def test_a_recorded_unset_release_workers_reads_as_what_the_run_did(tmp_path, use_gpu):
    """Before version 5 an unset `weight.release_workers` released the workers when they trained on GPUs; the
    default now keeps them up, so a resumed run must not change what it does by being resumed."""
    tree = yaml.safe_load(dump_config(load_config(None, {"run_dir": str(tmp_path)})))
    tree["config_version"] = 4
    tree["weight"].update(release_workers=None, use_gpu=use_gpu)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(tree))
    assert load_recorded_config(tmp_path / "config.yaml").weight.release_workers is use_gpu


def test_an_unreadable_config_is_a_conflict_that_says_why(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("E: [unclosed\n")
    (conflict,) = RunDirectory(run).config_conflicts(load_config(None, {"run_dir": str(run)}))
    assert "config.yaml" in conflict and "not valid YAML" in conflict and "\n" not in conflict


def test_a_version_1_state_is_read_into_typed_records(tmp_path):
    v1 = {
        "finished": False, "cycle": 1, "weight_version": 3, "accepted_harness": "c004",
        "rollout_files": {"weight-c00-s0000": 16, "validate-c00-i002-c001": 1, "harness-c00-i002-c001": 48,
                          "val-v00003-c004": 128, "test-v00000-h0": 256},
        "eval_cache": {"val|v3|c004|4": 0.25, "test|v0|h0|8": 0.125},
        "eval_metrics": {"test|v0|h0|8": {"truncation_rate": 0.5}},
    }
    (tmp_path / "state.json").write_text(json.dumps(v1))
    state = RunState.load(tmp_path)
    assert state.version == 2
    assert [(f.name, f.phase, f.cycle, f.rows) for f in state.rollout_files] == [
        ("weight-c00-s0000", "weight", 0, 16), ("validate-c00-i002-c001", "validate", 0, 1),
        ("harness-c00-i002-c001", "harness", 0, 48), ("val-v00003-c004", "val", -1, 128),
        ("test-v00000-h0", "test", -1, 256)]
    run = RunDirectory(tmp_path)
    assert run.evaluation("val", 3, "c004", 4).mean == 0.25
    test = run.evaluation("test", 0, "h0", 8)
    assert (test.mean, test.metrics) == (0.125, {"truncation_rate": 0.5})
    assert run.evaluation("test", 0, "h0", 4) is None  # another sample count is another evaluation


def test_a_state_from_before_checkpoint_version_reads_its_checkpoint_as_the_weight_versions(tmp_path):
    """Before a weight phase's last checkpoint was written beside the harness phase, the checkpoint on record always
    held the record's weight version."""
    (tmp_path / "state.json").write_text(json.dumps({"version": 2, "weight_version": 7, "checkpoint": "checkpoints/v00007"}))
    state = RunState.load(tmp_path)
    assert (state.checkpoint_version, state.checkpoint_pending) == (7, None)
    state.weight_version, state.checkpoint_pending = 8, "checkpoints/v00008"
    state.save(tmp_path)
    assert RunState.load(tmp_path).checkpoint_version == 7
