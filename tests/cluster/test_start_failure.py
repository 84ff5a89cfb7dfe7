"""An actor that cannot start on its input ends the run at once, named in one line, instead of rolling it back
again and again: a bad-input error on the first start, any other error when it repeats on the next start."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from actors.coordinator import Coordinator, StartFailed
from tests.helpers import small_config
from whale_ray.events import read_events


def corrupt_checkpoint(tiny_policy: str, path) -> str:
    """The tiny policy with its weights file cut in half: config.json and the tokenizer are whole, so the
    checkpoint passes `whale run`'s up-front checks, and only loading the weights fails."""
    shutil.copytree(tiny_policy, path)
    weights = path / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) // 2)
    return str(path)


def test_a_checkpoint_the_policy_server_cannot_load_ends_the_run_in_one_line(tmp_path, tiny_policy):
    model = corrupt_checkpoint(tiny_policy, tmp_path / "broken")
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "whale_ray.cli", "run", "--model", model, "--run-dir", str(run_dir),
         "--isolation", "unsafe_none", "--cycles", "1"],
        cwd=tmp_path, capture_output=True, text=True, timeout=240,
        env={"COLUMNS": "400", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path),
             **{k: os.environ[k] for k in ("PYTHONPATH",) if k in os.environ}})  # this checkout's whale_ray
    assert result.returncode == 2, result.stdout + result.stderr
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, result.stdout
    line = lines[0]
    assert line.startswith("whale: error: the PolicyServer could not start") and model in line, line
    assert "SafetensorError" in line or "could not be loaded" in line, line  # the weights, named by the reader or loader
    assert "Traceback" not in result.stdout + result.stderr
    events = read_events(run_dir)
    assert [e["kind"] for e in events] == ["start_failed"], events
    assert events[0]["actor"] == "PolicyServer" and events[0]["input"] == model
    assert not (run_dir / "config.yaml").exists() and not (run_dir / "state.json").exists()  # no run recorded


def test_a_base_checkpoint_without_a_chat_template_ends_the_run_at_its_first_start(tmp_path, ray_cluster, tiny_policy):
    """The issue's case at the Coordinator (whatever `whale run` checks up front): the PolicyServer's CheckpointError
    is bad input, so the first start ends the run, with no roll-back."""
    model = tmp_path / "base"
    shutil.copytree(tiny_policy, model)
    (model / "chat_template.jinja").unlink()
    cfg = small_config(tmp_path / "run", condition="mh_only", cycles=1, sandbox__isolation="unsafe_none")
    coordinator = Coordinator(cfg, str(model))
    with pytest.raises(StartFailed, match="^the PolicyServer could not start: policy checkpoint .*: the tokenizer has "
                                          "no chat template"):
        coordinator.run()
    assert [e["kind"] for e in read_events(cfg.run_dir)] == ["start_failed"] and coordinator.recoveries == 0
    assert not (cfg.run_dir / "config.yaml").exists()


def test_the_same_start_error_twice_in_a_row_ends_the_run(tmp_path, ray_cluster, tiny_policy):
    """A PolicyServer on a device that does not exist fails with an error that is no bad-input type: the first
    start counts as a fault (one roll-back), the second, identical, ends the run."""
    cfg = small_config(tmp_path / "run", condition="mh_only", cycles=1, policy__device="cuda:99",
                       sandbox__isolation="unsafe_none")
    coordinator = Coordinator(cfg, tiny_policy)
    with pytest.raises(StartFailed) as raised:
        coordinator.run()
    message = str(raised.value)
    assert "\n" not in message and message.startswith(f"the PolicyServer could not start on {tiny_policy} (the same "
                                                      "error on two starts in a row"), message
    kinds = [e["kind"] for e in read_events(cfg.run_dir)]
    assert kinds == ["rolled_back", "start_failed"], kinds
    assert coordinator.recoveries == 1
