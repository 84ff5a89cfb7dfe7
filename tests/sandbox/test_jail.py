"""The agent-cli jail gets the harness sandbox's layers (issue 10): a per-slot uid, its own cgroup, seccomp and
Landlock, with the network as its config says; nothing of the jail is left afterwards. A small script stands
in for the coding agent and reports what it sees from the inside (through the real proposer)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from tests.helpers import slots_held_elsewhere
from whale_ray.archive import Archive
from whale_ray.config import HarnessPhaseConfig
from whale_ray.proposers.agent_cli import AgentCLIProposer
from whale_ray.sandbox import cgroup, isolation
from whale_ray.sandbox.isolation import find_bwrap

REPO = Path(__file__).resolve().parents[2]
H0 = (REPO / "domains" / "math_reasoning" / "h0.py").read_text()

pytestmark = pytest.mark.skipif(find_bwrap() is None, reason="bubblewrap is not installed")

AGENT = r'''
import json, os, socket
r = {"uid": os.getuid()}
with open("/proc/self/status") as f:
    r["seccomp"] = [l.split()[1] for l in f if l.startswith("Seccomp:")][0]
with open("/proc/self/cgroup") as f:
    r["cgroup"] = f.read()
for fam, name in ((socket.AF_INET, "inet"), (socket.AF_INET6, "inet6")):
    try:
        socket.socket(fam, socket.SOCK_STREAM).close()
        r[name] = "allowed"
    except OSError as e:
        r[name] = type(e).__name__
for target in ("/workspace/w.txt", "/tmp/t.txt", "/proc/self/comm"):
    try:
        with open(target, "w") as f:
            f.write("x")
        r[target] = "written"
    except OSError as e:
        r[target] = type(e).__name__
r["env_ld"] = os.environ.get("LD_LIBRARY_PATH")
with open("/workspace/report.json", "w") as f:
    json.dump(r, f)
'''


def propose(tmp_path: Path, network: bool) -> dict:
    script = tmp_path / "agent" / "agent.py"
    script.parent.mkdir(exist_ok=True)
    script.write_text(AGENT)
    archive = Archive(tmp_path / "run" / "archive")
    if "h0" not in archive:
        archive.add_candidate(H0, parent=None, hypothesis="seed", iteration=1, cycle=0, candidate_id="h0")
    cfg = HarnessPhaseConfig.model_validate({"proposer": "agent-cli", "agent_cli": {
        "command": ["/usr/bin/python3", str(script)], "ro_binds": [str(script.parent)], "network": network}})
    log_path = tmp_path / "run" / "proposer" / f"net-{network}" / "session.partial.json"
    proposer = AgentCLIProposer(config=cfg)
    proposer.propose(archive, 1, 2, skill_text="skill", seed=0, log_path=log_path)
    assert proposer.last_session["stop_reason"] == "exit code 0", proposer.last_session
    workspace = log_path.parent / "workspace"
    report = json.loads((workspace / "report.json").read_text())
    report["owners"] = {os.lstat(p).st_uid for p in [workspace, *workspace.rglob("*")]}
    return report


@pytest.mark.parametrize("network", [False, True])
def test_agent_jail_has_the_sandbox_layers(tmp_path, network):
    r = propose(tmp_path, network)
    assert r["seccomp"] == "2"
    assert r["/workspace/w.txt"] == "written" and r["/tmp/t.txt"] == "written"
    assert r["/proc/self/comm"] == "PermissionError"  # Landlock: writes only under the workspace, /tmp, /dev
    assert r["env_ld"] is None  # the shim's interpreter path is not the agent's business
    if network:
        assert r["inet"] == r["inet6"] == "allowed"
    else:
        assert r["inet"] == r["inet6"] == "PermissionError"  # seccomp, on top of the empty network namespace
    if isolation.running_as_root():
        assert isolation.SLOT_UID_BASE <= r["uid"] < isolation.SLOT_UID_BASE + isolation.MAX_SLOTS
        assert r["owners"] == {0}  # what the agent wrote is root's again before the proposer reads it
    if cgroup.cgroup_layer() is not None:
        assert "whale-ray/ep-" in r["cgroup"]
    # nothing of the jail is left: cgroups, staging mounts and directories, processes of the slot uid
    assert cgroup.leftovers() == []
    with open("/proc/self/mountinfo") as f:
        assert "whale-jail-" not in f.read()
    from whale_ray.sandbox.uid_pool import UID_POOL, _uids_of_processes

    assert r["uid"] not in UID_POOL.in_use()
    deadline = time.monotonic() + 3  # a process killed at teardown may take a moment to be reaped
    while _uids_of_processes(r["uid"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _uids_of_processes(r["uid"]) == [] or r["uid"] in slots_held_elsewhere()


