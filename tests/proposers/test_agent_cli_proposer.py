"""The `agent-cli` proposer: a small script stands in for the coding-agent binary. It reads the archive,
writes candidates (good and bad ones), and tries to write outside its workspace and to reach the network;
the jail must stop what it must and the proposer must collect only valid candidates."""

from __future__ import annotations

import json
import socket
import threading
import uuid
from pathlib import Path

import pytest

from whale_ray.archive import Archive
from whale_ray.config import HarnessPhaseConfig
from whale_ray.proposers.agent_cli import AgentCLIProposer, parse_agent_usage
from whale_ray.proposers.registry import make_proposer
from whale_ray.proposers.session import Limits
from whale_ray.sandbox.isolation import find_bwrap

REPO = Path(__file__).resolve().parents[2]
H0 = (REPO / "domains" / "math_reasoning" / "h0.py").read_text()
SKILL = (REPO / "domains" / "math_reasoning" / "skill.md").read_text()

pytestmark = pytest.mark.skipif(find_bwrap() is None, reason="bubblewrap is not installed")

AGENT = r'''
import json, os, pathlib, socket, sys, time

ws, ar = pathlib.Path("/workspace"), pathlib.Path("/archive")
mode, host_dir, port, marker = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
report = {"argv": sys.argv[5:], "cwd": os.getcwd()}
task = (ws / "TASK.md").read_text()
report["task"] = {"overview": "Harness iteration 3" in task, "skill": "## What you must not change" in task,
                  "layout": "/archive/" in task}
h0 = (ar / "h0" / "harness.py").read_text()
report["read_trace"] = "turn_budget_exhausted" in (ar / "h0" / "traces.jsonl").read_text()
writes = {}
for target in ["/archive/h0/harness.py", "/archive/evil.txt", host_dir + "/escaped.txt", "/etc/evil", "/evil",
               "/usr/evil", "/workspace/../evil", "/tmp/" + marker]:
    try:
        with open(target, "w") as f:
            f.write("x")
        writes[target] = "written"
    except OSError as e:
        writes[target] = type(e).__name__
report["writes"] = writes
report["env"] = sorted(os.environ)
report["key_present"] = bool(os.environ.get("WHALE_TEST_AGENT_KEY"))
report["visible"] = {p: os.path.exists(p) for p in [host_dir, "/root", "/work", "/archive/h0/scores.json"]}
try:
    socket.create_connection(("127.0.0.1", port), timeout=2).close()
    report["network"] = "connected"
except OSError as e:
    report["network"] = type(e).__name__

c = ws / "candidates"
def cand(name, code, hyp="a hypothesis", parent=None):
    (c / name).mkdir()
    if code is not None:
        (c / name / "harness.py").write_text(code)
    if hyp is not None:
        (c / name / "hypothesis.md").write_text(hyp)
    if parent is not None:
        (c / name / "parent.txt").write_text(parent)

cand("a-four-turns", h0.replace("MAX_TURNS = 2", "MAX_TURNS = 4"), "h0 traces end in turn_budget_exhausted: 4 turns",
     parent="c001")
cand("b-bad-signature", "def run(task):\n    return None\n")
cand("c-link", None)
os.symlink("/etc/passwd", c / "c-link" / "harness.py")
cand("d-duplicate", h0 + "\n# a comment\n")
os.symlink("/archive/h0", c / "e-linked-folder")
cand("f-no-hypothesis", h0.replace("MAX_TURNS = 2", "MAX_TURNS = 6"), hyp=None)
cand("g-five-turns", h0.replace("MAX_TURNS = 2", "MAX_TURNS = 5"), "five turns", parent="nope")
cand("h-one-too-many", h0.replace("MAX_TURNS = 2", "MAX_TURNS = 7"), "seven turns")
(ws / "report.json").write_text(json.dumps(report))
print(json.dumps({"type": "result", "num_turns": 7, "total_cost_usd": 0.0123,
                  "usage": {"input_tokens": 1000, "cache_read_input_tokens": 4000, "cache_creation_input_tokens": 0,
                            "output_tokens": 600}}))
if mode == "hang":
    time.sleep(60)
'''


def trace(i: int, exhausted: bool) -> dict:
    return {"task": {"id": f"h{i}", "question": f"Ann has {i} pens. How many pens does Ann have?"},
            "calls": [{"messages": [{"role": "user", "content": "q"}], "completion": "```python\nprint(1)\n```",
                       "finish_reason": "stop"}],
            "events": [{"type": "turn_budget_exhausted"}] if exhausted else [], "answer": None, "status": "ok",
            "reason": ""}


@pytest.fixture
def archive(tmp_path) -> Archive:
    a = Archive(tmp_path / "run" / "archive")
    a.add_candidate(H0, parent=None, hypothesis="seed", iteration=1, cycle=0, candidate_id="h0")
    rows = [{"task_id": f"h{i}", "reward": float(i == 0), "turns": 2, "prompt_tokens": 30, "status": "ok"}
            for i in range(3)]
    a.record_evaluation("h0", rows, [trace(i, i > 0) for i in range(3)], weight_version=0)
    c1 = a.add_candidate(H0.replace("MAX_TURNS = 2", "MAX_TURNS = 3"), parent="h0", hypothesis="3 turns",
                         iteration=2, cycle=0)
    a.record_evaluation(c1, rows, [trace(i, i > 1) for i in range(3)], weight_version=0)
    return a


@pytest.fixture
def listener():
    """A TCP listener on the host's loopback: can the jailed agent reach it?"""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    stop = threading.Event()

    def accept():
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
                conn.close()
            except OSError:
                pass

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield srv.getsockname()[1]
    stop.set()
    t.join()
    srv.close()


def config(tmp_path: Path, port: int, *, mode: str = "normal", marker: str = "m", **agent) -> HarnessPhaseConfig:
    script = tmp_path / "agent" / "fake_agent.py"
    script.parent.mkdir(exist_ok=True)
    script.write_text(AGENT)
    host_dir = tmp_path / "host"
    host_dir.mkdir(exist_ok=True)
    return HarnessPhaseConfig.model_validate({
        "proposer": "agent-cli", "candidates_per_iteration": 2,
        "endpoint": {"model": "agent-model", "api_key_env": "WHALE_TEST_AGENT_KEY"},
        "agent_cli": {"command": ["/usr/bin/python3", str(script), mode, str(host_dir), str(port), marker,
                                  "{prompt}", "--model", "{model}", "{n}"],
                      "ro_binds": [str(script.parent)], "env": {"AGENT_MODE": "test"}, **agent},
    })


def test_agent_cli_writes_only_its_workspace_and_its_valid_candidates_are_collected(tmp_path, archive, listener,
                                                                                   monkeypatch):
    key = "sk-agent-" + uuid.uuid4().hex
    monkeypatch.setenv("WHALE_TEST_AGENT_KEY", key)
    monkeypatch.setenv("WHALE_TEST_OTHER_SECRET", "not for the agent")
    marker = f"whale-jail-{uuid.uuid4().hex}"
    log_path = tmp_path / "run" / "proposer" / "iter-0003" / "session.partial.json"
    proposer = make_proposer("agent-cli", config=config(tmp_path, listener, marker=marker))
    props = proposer.propose(archive, 2, 3, skill_text=SKILL, seed=0, log_path=log_path)

    workspace = log_path.parent / "workspace"
    report = json.loads((workspace / "report.json").read_text())
    # the agent saw the task, the skill text and the archive (read-only), with its trace files
    assert report["task"] == {"overview": True, "skill": True, "layout": True} and report["read_trace"]
    assert report["argv"][0].startswith("You are the proposer")
    assert report["argv"][1:] == ["--model", "agent-model", "2"]
    assert report["cwd"] == "/workspace"
    # every write outside the workspace failed; /tmp is the jail's own
    writes = report["writes"]
    assert writes.pop(f"/tmp/{marker}") == "written" and not Path(f"/tmp/{marker}").exists()
    assert all(v != "written" for v in writes.values()), writes
    assert not (tmp_path / "host" / "escaped.txt").exists() and not (archive.root / "evil.txt").exists()
    assert Archive(archive.root).get("h0").code == H0
    assert report["visible"] == {str(tmp_path / "host"): False, "/root": False, "/work": False,
                                 "/archive/h0/scores.json": True}
    # only the allow-listed environment and the named key
    assert "WHALE_TEST_OTHER_SECRET" not in report["env"] and report["key_present"]
    assert {"PATH", "HOME", "TMPDIR", "AGENT_MODE", "WHALE_TEST_AGENT_KEY"} <= set(report["env"])
    assert report["network"] == "connected"  # network is the agent's business by default
    # collected: the valid, new candidates in name order, at most n
    assert [p.hypothesis for p in props] == ["h0 traces end in turn_budget_exhausted: 4 turns", "five turns"]
    assert [p.parent for p in props] == ["c001", "h0"]  # "nope" is not a candidate: the frontier top (a tie: h0)
    s = proposer.last_session
    errors = {w["name"]: w.get("error", "") for w in s["files_written"] if not w["accepted"]}
    assert set(errors) == {"b-bad-signature", "c-link", "d-duplicate", "e-linked-folder", "f-no-hypothesis",
                           "h-one-too-many"}
    assert "two positional parameters" in errors["b-bad-signature"]
    assert "the same code as h0" in errors["d-duplicate"]
    assert "not a candidate folder" in errors["e-linked-folder"] and "no hypothesis" in errors["f-no-hypothesis"]
    assert errors["c-link"]  # the link to /etc/passwd was not followed
    assert all("root:" not in p.code for p in props)
    # usage from the agent's own JSON report; the key never reaches the log
    u = s["usage"]
    assert (u["prompt_tokens"], u["cached_tokens"], u["completion_tokens"], u["calls"]) == (5000, 4000, 600, 7)
    assert u["cost_usd"] == pytest.approx(0.0123) and s["stop_reason"] == "exit code 0"
    assert key not in json.dumps(s)


def test_agent_cli_network_can_be_cut_and_a_hanging_agent_is_stopped(tmp_path, archive, listener):
    proposer = AgentCLIProposer(config=config(tmp_path, listener, mode="hang", network=False, timeout_s=8))
    log_path = tmp_path / "run" / "proposer" / "iter-0003" / "session.partial.json"
    props = proposer.propose(archive, 2, 3, skill_text=SKILL, seed=0, log_path=log_path)
    s = proposer.last_session
    assert s["stop_reason"] == "timeout after 8 s"
    assert json.loads((log_path.parent / "workspace" / "report.json").read_text())["network"] != "connected"
    assert len(props) == 2  # what it wrote before it hung still counts

    proposer = AgentCLIProposer(config=config(tmp_path, listener, mode="hang", timeout_s=60))
    proposer.propose(archive, 2, 3, skill_text=SKILL, seed=0, limits=Limits(max_wall_s=3))
    assert proposer.last_session["stop_reason"] == "timeout after 3 s"  # the run's wall budget caps it
    workspace = Path(proposer.last_session["notes"][0].split("workspace ", 1)[1].split(";")[0])
    assert not workspace.exists()  # a temporary workspace is removed


def test_agent_usage_formats():
    claude = json.dumps({"type": "result", "total_cost_usd": 0.5, "num_turns": 3,
                         "usage": {"input_tokens": 10, "cache_read_input_tokens": 90, "output_tokens": 5}})
    u, cost = parse_agent_usage(claude)
    assert (u.prompt_tokens, u.cached_tokens, u.completion_tokens, cost) == (100, 90, 5, 0.5)
    codex = "\n".join(json.dumps(e) for e in [
        {"type": "thread.started"},
        {"type": "turn.completed", "usage": {"input_tokens": 100, "cached_input_tokens": 40, "output_tokens": 7}},
        {"type": "turn.completed", "usage": {"input_tokens": 50, "cached_input_tokens": 0, "output_tokens": 3}}])
    u, cost = parse_agent_usage("some log line\n" + codex)
    assert (u.prompt_tokens, u.cached_tokens, u.completion_tokens, cost) == (150, 40, 10, None)
    assert parse_agent_usage("no json at all")[0].tokens == 0
