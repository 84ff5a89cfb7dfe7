"""The `llm` proposer: the real openai client against an OpenAI-compatible server on loopback that replays
scripted proposer turns (tool calls, garbage, 429/5xx, timeouts), over real archives; then the coordinator
with it (leakage rejection, budget stop, session logs, resume) and `whale run --proposer llm`."""

from __future__ import annotations

import gc
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml

from tests.helpers import H0, FakeOpenAI, reply, variant
from whale_ray.archive import Archive
from whale_ray.config import DataConfig, HarnessPhaseConfig, load_config
from whale_ray.domain import get_domain
from whale_ray.proposers.archive_tools import ArchiveTools, ToolInputError
from whale_ray.proposers.base import ProposerError
from whale_ray.proposers.leakage import LeakageGuard
from whale_ray.proposers.llm import LLMProposer, is_loopback
from whale_ray.proposers.registry import PROPOSER_KINDS, make_proposer
from whale_ray.proposers.session import Limits, Usage, budget_exhausted, cost_usd, price_for

REPO = Path(__file__).resolve().parents[2]
SKILL = (REPO / "domains" / "math_reasoning" / "skill.md").read_text()


# ================================================================ an OpenAI-compatible server on loopback
# (FakeOpenAI and reply() are in tests/helpers.py: the D_test isolation test scripts the server too)


def http_error(status: int, headers: dict[str, str] | None = None, body: str = '{"error": {"message": "busy"}}'):
    return ("error", status, headers or {}, body)


def stall(seconds: float):
    """Answer only after `seconds` (longer than the client's timeout), with a reply nobody reads."""
    return ("stall", seconds)


@pytest.fixture
def serve():
    servers: list[FakeOpenAI] = []

    def start(script):
        s = FakeOpenAI(script)
        servers.append(s)
        return s

    yield start
    for s in servers:
        s.close()


# ================================================================ archives with real-looking traces


def math_trace(task_id: str, question: str, completion: str, *, answer: str | None, exhausted: bool) -> dict:
    calls = [{"messages": [{"role": "system", "content": "Solve the problem. You can run python."},
                           {"role": "user", "content": question}],
              "completion": completion, "finish_reason": "stop"}]
    events = [{"type": "tool_call", "name": "python", "code": "print(3 + 4)", "output": "7\n"}]
    if exhausted:
        events.append({"type": "turn_budget_exhausted", "max_turns": 2})
    return {"task": {"id": task_id, "question": question, "steps": 2}, "calls": calls, "events": events,
            "answer": answer, "status": "ok", "reason": ""}


def evaluate(a: Archive, cid: str, successes: list[bool], weight_version: int = 0) -> None:
    rows, traces = [], []
    for i, ok in enumerate(successes):
        q = f"Ann has {i + 3} apples. She gets 4 more. How many apples does Ann have now?"
        if ok:
            t = math_trace(f"h{i}", q, f"{i + 3} + 4 = {i + 7} . \\boxed{{{i + 7}}}", answer=f"\\boxed{{{i + 7}}}",
                           exhausted=False)
        else:
            t = math_trace(f"h{i}", q, "```python\nprint(3 + 4)\n```", answer=None, exhausted=True)
        traces.append(t)
        rows.append({"task_id": f"h{i}", "reward": 1.0 if ok else 0.0, "turns": 1 if ok else 2,
                     "prompt_tokens": 40, "status": "ok"})
    a.record_evaluation(cid, rows, traces, weight_version=weight_version)


def archive_with_history(tmp_path: Path) -> Archive:
    a = Archive(tmp_path / "run" / "archive")
    a.add_candidate(H0, parent=None, hypothesis="seed harness", iteration=1, cycle=0, candidate_id="h0")
    evaluate(a, "h0", [False, False, True, False])
    c1 = a.add_candidate(variant(3), parent="h0", hypothesis="one more turn", iteration=2, cycle=0)
    evaluate(a, c1, [True, False, True, False])
    bad = a.add_candidate("def run(task):\n    return None\n", parent="h0", hypothesis="broken", iteration=2, cycle=0)
    a.mark_invalid(bad, "harness c002/harness.py: run must take exactly two positional parameters")
    return a


def hp(base_url: str, **over: Any) -> HarnessPhaseConfig:
    tree: dict[str, Any] = {
        "proposer": "llm", "candidates_per_iteration": 2,
        "endpoint": {"model": "scripted", "base_url": base_url, "api_key_env": "WHALE_TEST_PROPOSER_KEY",
                     "timeout_s": 5, "max_retries": 3},
        "llm": {"retry_backoff_s": 0.01, "retry_max_backoff_s": 0.05, "max_turns": 12},
        "prices": {"scripted": {"prompt": 2.0, "completion": 10.0, "cached": 0.5}},
    }
    for k, v in over.items():
        section, _, leaf = k.rpartition("__")
        (tree.setdefault(section, {}) if section else tree)[leaf] = v
    return HarnessPhaseConfig.model_validate(tree)


@pytest.fixture(autouse=True)
def no_key(monkeypatch):
    monkeypatch.delenv("WHALE_TEST_PROPOSER_KEY", raising=False)


# ================================================================ sessions


def test_session_reads_code_scores_and_raw_traces_then_writes_candidates(tmp_path, serve):
    a = archive_with_history(tmp_path)
    new1, new2 = variant(5), variant(4, "Solve the problem step by step. You can run python.")
    server = serve([
        reply(("list_files", {"path": "."}), ("list_candidates", {})),
        reply(("read_file", {"path": "c001/harness.py", "limit": 30}), ("read_file", {"path": "h0/scores.json"})),
        reply(("read_file", {"path": "h0/traces.jsonl", "offset": 1, "limit": 2}), usage=(1200, 50, 800)),
        reply(("grep", {"pattern": "turn_budget_exhausted", "glob": "traces.jsonl"}),
              ("diff", {"a": "h0", "b": "c001"}), ("show_frontier", {"k": 3})),
        reply(("write_candidate", {"code": new1, "hypothesis": "3 of 4 h0 traces end in turn_budget_exhausted "
                                                                 "after one python call: allow 5 turns",
                                   "parent": "c001"})),
        reply(("write_candidate", {"code": new2, "hypothesis": "step-by-step prompt with 4 turns"}),
              content="Writing the second one now."),
    ])
    proposer = make_proposer("llm", config=hp(server.base_url))
    props = proposer.propose(a, 2, 3, skill_text=SKILL, seed=0).proposals

    assert [p.code for p in props] == [new1, new2]
    assert [p.parent for p in props] == ["c001", "c001"]  # the second defaults to the frontier top (c001)
    assert "turn_budget_exhausted" in props[0].hypothesis
    s = proposer.last_session
    assert s["stop_reason"] == "done" and len(server.requests) == 6
    # what the proposer saw: the skill text, the history (incl. the invalid candidate's reason), raw traces
    system, opening = s["messages"][0]["content"], s["messages"][1]["content"]
    assert "## What you must not change" in system and "traces.jsonl" in system
    assert "Harness iteration 3" in opening and "INVALID: harness c002/harness.py" in opening
    assert "| c001 | h0 | 2 | 0 | evaluated | 0 | 0.500 |" in opening
    tool_results = [m["content"] for m in s["messages"] if m["role"] == "tool"]
    traces = next(r for r in tool_results if r.startswith("h0/traces.jsonl (lines 1-2 of 4)"))
    assert '"finish_reason": "stop"' in traces and '"turn_budget_exhausted"' in traces  # raw JSON lines
    assert any("h0/traces.jsonl:1:" in r for r in tool_results)  # grep hits
    assert any("+MAX_TURNS = 3" in r for r in tool_results)  # the diff
    assert any("Pareto frontier under weight version 0" in r for r in tool_results)
    assert {"h0/traces.jsonl", "c001/harness.py", "h0/scores.json"} <= set(s["files_read"])
    assert [w["accepted"] for w in s["files_written"]] == [True, True]
    assert [t["name"] for t in s["tool_calls"]][:2] == ["list_files", "list_candidates"]
    # what the server got: the tools as OpenAI function tools, the model name, the reply cap
    first = server.requests[0]
    assert first["model"] == "scripted" and first["max_completion_tokens"] == 8192
    assert {t["function"]["name"] for t in first["tools"]} == {
        "list_files", "read_file", "grep", "diff", "show_frontier", "list_candidates", "write_candidate"}
    # the ledger: tokens as reported, cost from the price table (cached tokens at their own price)
    u = s["usage"]
    assert (u["calls"], u["prompt_tokens"], u["completion_tokens"], u["cached_tokens"]) == (6, 6200, 550, 800)
    expected = sum(cost_usd(price_for({"scripted": {"prompt": 2.0, "completion": 10.0, "cached": 0.5}}, "scripted"),
                            p, c, k) for p, c, k in [(1000, 100, 0)] * 5 + [(1200, 50, 800)])
    assert u["cost_usd"] == pytest.approx(expected) and u["retries"] == 0 and u["sessions"] == 1
    json.dumps(s)  # the session log is plain JSON
    # nothing of the run directory beyond the archive, and the archive is unchanged
    assert not any("state.json" in r for r in tool_results)
    assert Archive(a.root).ids() == ["h0", "c001", "c002"]


def test_garbage_replies_and_bad_tool_arguments_get_errors_back(tmp_path, serve):
    a = archive_with_history(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("D_test answers")
    os.symlink(outside, a.root / "escape")  # a link out of the archive
    os.symlink(outside / "secret.txt", a.root / "h0" / "link.txt")
    good = variant(6)
    server = serve([
        reply(content="Let me think about the harness in general terms first."),  # no tool call: a reminder
        reply(content="```python\ndef run(task, agent):\n    return None\n```"),  # code, not via the tool
        reply(("read_file", "{not json"), raw_arguments=True),
        reply(("read_file", {"path": "../state.json"}), ("read_file", {"path": "/etc/passwd"}),
              ("read_file", {"path": "escape/secret.txt"}), ("read_file", {"path": "h0/link.txt"}),
              ("list_files", {"path": ".tmp-c009"}), ("read_file", {"path": "h0/nothere.py"})),
        reply(("read_file", {"path": "h0/harness.py", "offset": "ten"}), ("read_file", {}),
              ("open_file", {"path": "h0/harness.py"}), ("grep", {"pattern": "(unclosed"}),
              ("diff", {"a": "h0", "b": "c999"}), ("read_file", {"path": "h0/harness.py", "colour": "red"}),
              ("read_file", {"path": "h0/harness.py", "offset": 9999})),
        reply(("write_candidate", {"code": "def run(task, agent):\n    return (\n", "hypothesis": "x"}),
              ("write_candidate", {"code": "import numpy\n\ndef run(task, agent):\n    return None\n",
                                   "hypothesis": "numpy"}),
              ("write_candidate", {"code": H0 + "\n# only a comment\n", "hypothesis": "same as h0"}),
              ("write_candidate", {"code": good, "hypothesis": "six turns", "parent": "c404"}),
              ("write_candidate", {"code": good, "hypothesis": "   "})),
        reply(("write_candidate", {"code": "```python\n" + good + "```", "hypothesis": "six turns"})),
    ])
    proposer = LLMProposer(config=hp(server.base_url, llm__nudges=2))
    props = proposer.propose(a, 1, 3, skill_text=SKILL, seed=0).proposals

    assert [p.code.strip() for p in props] == [good.strip()]  # the fenced code was unwrapped
    s = proposer.last_session
    assert s["stop_reason"] == "done"
    results = [m["content"] for m in s["messages"] if m["role"] == "tool"]
    errors = [r for r in results if r.startswith("error:")]
    assert len(errors) == len(results) - 1 == 19
    for needle in ["not valid JSON", "'..' is not allowed", "relative to the archive root",
                   "symbolic links are not followed", "symbolic links are not followed", "hidden files",
                   "no such file", "must be integer", "missing argument(s) path", "unknown tool 'open_file'",
                   "bad regular expression", "no candidate 'c999'", "unknown argument(s) colour", "past the end",
                   "syntax error at line", "not a standard-library module", "the same as h0",
                   "parent 'c404' is not a candidate", "hypothesis is empty"]:
        assert any(needle in e for e in errors), needle
    assert not any("D_test answers" in r for r in results)
    reminders = [m for m in s["messages"] if m["role"] == "user" and "write_candidate" in m["content"]]
    assert len(reminders) == 2
    assert sum(1 for w in s["files_written"] if not w["accepted"]) == 5
    assert len(server.requests) == 7


def test_a_model_that_never_writes_ends_the_session_without_candidates(tmp_path, serve):
    a = archive_with_history(tmp_path)
    server = serve([reply(content="Harnesses are interesting.")] * 10)
    proposer = LLMProposer(config=hp(server.base_url, llm__nudges=2))
    assert proposer.propose(a, 2, 3, skill_text=SKILL, seed=0).proposals == []
    assert "stopped calling tools with 0 of 2" in proposer.last_session["stop_reason"]
    assert len(server.requests) == 3  # the reply plus two reminders


def test_429_5xx_timeouts_and_bad_bodies_are_retried_and_logged(tmp_path, serve):
    a = archive_with_history(tmp_path)
    server = serve([
        http_error(429, {"retry-after": "0"}),
        http_error(503),
        stall(2.0),
        ("raw", "this is not json"),
        reply(("write_candidate", {"code": variant(5), "hypothesis": "five turns"})),
    ])
    proposer = LLMProposer(config=hp(server.base_url, endpoint__timeout_s=0.5, endpoint__max_retries=4))
    props = proposer.propose(a, 1, 3, skill_text=SKILL, seed=0).proposals
    assert len(props) == 1
    s = proposer.last_session
    assert [r["error"].split(":")[0] for r in s["retries"]] == [
        "HTTP 429", "HTTP 503", "timeout", "unusable response (JSONDecodeError"]
    assert all(0 < r["wait_s"] <= 0.05 for r in s["retries"])
    assert [r["attempt"] for r in s["retries"]] == [1, 2, 3, 4]
    assert s["usage"]["retries"] == 4 and s["usage"]["calls"] == 1
    assert len(server.requests) == 5


def test_retries_give_up_and_fatal_errors_end_the_session_cleanly(tmp_path, serve):
    a = archive_with_history(tmp_path)
    server = serve([http_error(500)] * 10)
    proposer = LLMProposer(config=hp(server.base_url, endpoint__max_retries=2))
    assert proposer.propose(a, 1, 3, skill_text=SKILL, seed=0).proposals == []
    assert "gave up after 2 retries" in proposer.last_session["stop_reason"]
    assert len(server.requests) == 3

    server = serve([http_error(401, body='{"error": {"message": "bad key"}}')] * 3)
    proposer = LLMProposer(config=hp(server.base_url))
    assert proposer.propose(a, 1, 3, skill_text=SKILL, seed=0).proposals == []
    assert proposer.last_session["stop_reason"].startswith("error: HTTP 401")
    assert len(server.requests) == 1  # not retried


def test_budget_limits_end_the_session(tmp_path, serve):
    a = archive_with_history(tmp_path)
    loop = [reply(("list_candidates", {}), usage=(1000, 200, 0))] * 20
    server = serve(loop)
    proposer = LLMProposer(config=hp(server.base_url))
    assert proposer.propose(a, 2, 3, skill_text=SKILL, seed=0, limits=Limits(max_tokens=2500)).proposals == []
    s = proposer.last_session
    assert s["stop_reason"] == "budget: tokens" and s["usage"]["calls"] == 3 and len(server.requests) == 3

    server = serve(loop)
    proposer = LLMProposer(config=hp(server.base_url))
    # 1000 prompt at $2/M + 200 completion at $10/M = $0.004 a call
    proposer.propose(a, 2, 3, skill_text=SKILL, seed=0, limits=Limits(max_cost_usd=0.01))
    assert proposer.last_session["stop_reason"] == "budget: cost" and len(server.requests) == 3

    server = serve(loop)
    proposer = LLMProposer(config=hp(server.base_url))
    proposer.propose(a, 2, 3, skill_text=SKILL, seed=0, limits=Limits(max_wall_s=0.0))
    assert proposer.last_session["stop_reason"] == "budget: wall" and len(server.requests) == 0


def test_a_session_logs_its_progress_while_it_works(tmp_path, serve):
    a = archive_with_history(tmp_path)
    partial = tmp_path / "run" / "proposer" / "iter-0003" / "session.partial.json"
    seen = []

    def script(body, i):
        if partial.exists():
            seen.append(json.loads(partial.read_text())["usage"]["calls"])
        return reply(("list_candidates", {})) if i < 3 else reply(
            ("write_candidate", {"code": variant(5), "hypothesis": "five turns"}))

    server = serve(script)
    LLMProposer(config=hp(server.base_url)).propose(a, 1, 3, skill_text=SKILL, seed=0, log_path=partial)
    assert seen == [1, 2, 3]


def test_the_key_comes_from_the_named_variable_and_never_enters_the_log(tmp_path, serve, monkeypatch):
    a = archive_with_history(tmp_path)
    key = "sk-test-0123456789abcdef"
    monkeypatch.setenv("WHALE_TEST_PROPOSER_KEY", key)
    server = serve([reply(("list_candidates", {}), content=f"my key is {key}"),
                    reply(("write_candidate", {"code": variant(5), "hypothesis": f"uses {key}"}))])
    proposer = LLMProposer(config=hp(server.base_url))
    props = proposer.propose(a, 1, 3, skill_text=SKILL, seed=0).proposals
    assert {k.lower(): v for k, v in server.headers[0].items()}["authorization"] == f"Bearer {key}"
    assert key not in json.dumps(proposer.last_session) and "***" in json.dumps(proposer.last_session)
    assert len(props) == 1

    monkeypatch.delenv("WHALE_TEST_PROPOSER_KEY")
    with pytest.raises(ProposerError, match="WHALE_TEST_PROPOSER_KEY"):
        LLMProposer(config=hp("https://api.example.com/v1"))
    LLMProposer(config=hp(server.base_url))  # a loopback endpoint runs without a key
    assert is_loopback("http://localhost:8000/v1") and is_loopback("http://[::1]:1/v1")
    assert not is_loopback("https://api.openai.com/v1") and not is_loopback(None)


def test_config_and_kinds():
    assert PROPOSER_KINDS == ("offline", "llm", "agent-cli")
    with pytest.raises(Exception, match="needs harness_phase.endpoint.model"):
        load_config(None, {"harness_phase.proposer": "llm"})
    with pytest.raises(Exception, match="needs a price for model 'm'"):
        load_config(None, {"harness_phase.proposer": "llm", "harness_phase.endpoint.model": "m",
                           "harness_phase.max_proposer_cost_usd": 1.0})
    cfg = load_config(None, {"harness_phase.proposer": "llm", "harness_phase.endpoint.model": "m",
                             "harness_phase.max_proposer_tokens": 100})
    assert budget_exhausted(cfg.harness_phase, Usage(prompt_tokens=90, completion_tokens=9)) is None
    spent = Usage(prompt_tokens=90, completion_tokens=10)
    assert "max_proposer_tokens 100" in budget_exhausted(cfg.harness_phase, spent)


# ================================================================ the archive tools and the leakage guard


def test_archive_tools_stay_inside_the_archive(tmp_path):
    a = archive_with_history(tmp_path)
    (tmp_path / "run" / "state.json").write_text('{"test": 0.9}')
    os.symlink(tmp_path / "run" / "state.json", a.root / "c001" / "state.json")
    os.symlink("..", a.root / "up")
    (a.root / ".tmp-c009").mkdir()
    tools = ArchiveTools(a, read_max_chars=2000)
    for bad in ["/etc/passwd", "../state.json", "h0/../../state.json", "up/state.json", "c001/state.json",
                ".tmp-c009", "~/x", 5]:
        with pytest.raises(ToolInputError):
            tools.read_file(bad)
    listing, _ = tools.list_files(".")
    assert "h0/" in listing and "up" not in listing and ".tmp" not in listing
    text, _ = tools.grep("test", ".")
    assert "0.9" not in text
    # paging: a long trace line is shown in pieces
    long_line, _ = tools.read_file("h0/traces.jsonl", offset=1, limit=1)
    assert "h0/traces.jsonl" in long_line
    big = a.root / "h0" / "big.txt"
    big.write_text("x" * 5000 + "\n")
    first, _ = tools.read_file("h0/big.txt")
    assert "characters 0..2000 of 5000" in first and "char_offset=2000" in first
    rest, _ = tools.read_file("h0/big.txt", char_offset=4000)
    assert "characters 4000..5000 of 5000" in rest and rest.endswith("\n" + "x" * 1000)


def test_leakage_guard_flags_test_questions_but_not_search_set_text():
    splits = get_domain("math_reasoning").load_splits(DataConfig(), 0)
    test_q = [t.question for t in splits.test]
    others = [t.question for t in (*splits.weight, *splits.harness, *splits.val)]
    guard = LeakageGuard(test_q, others)
    q = next(x for x in test_q if len(x) > 60)
    escaped = json.dumps(q.upper()).replace(" ", "\\n")  # quoting, case and escapes do not hide it
    assert guard.check(f"FEW_SHOT = {escaped}\n") is not None
    assert "D_test" in guard.check(f"# {q}\n")
    assert guard.check(f"EXAMPLE = {others[3]!r}\n") is None  # a D_harness question is fine
    assert guard.check(H0) is None and guard.check(variant(5)) is None
    words = q.split()
    assert guard.check(" ".join(words[:5])) is None  # a few words are not a leak


# ================================================================ through the coordinator


def smart_script(test_questions: list[str], leak: bool = True, usage=(3000, 500, 1000), silent=()):
    """A scripted proposer that reads the default parent's traces, then writes candidates; in iteration 2
    one of them quotes a D_test question (with `leak`); in `silent` iterations it only talks."""

    def script(body: dict[str, Any], index: int) -> dict[str, Any]:
        msgs = body["messages"]
        it = int(re.search(r"Harness iteration (\d+)", msgs[1]["content"]).group(1))
        parent = re.search(r"default parent for a new candidate is (\S+?)\.", msgs[1]["content"]).group(1)
        turn = sum(1 for m in msgs if m["role"] == "assistant")
        if it in silent:
            return reply(content="I would rather describe the harness than write one.", usage=usage)
        if turn == 0:
            return reply(("list_candidates", {}), ("read_file", {"path": f"{parent}/traces.jsonl", "limit": 2}),
                         usage=usage)
        if it == 2:
            calls = [("write_candidate", {"code": variant(4), "hypothesis": "four turns and ask for \\boxed{}"})]
            if leak:
                calls.append(("write_candidate", {"code": variant(3) + f"\nFEW_SHOT = {test_questions[0]!r}\n",
                                                  "hypothesis": "a worked example"}))
            else:
                calls.append(("write_candidate", {"code": variant(3), "hypothesis": "three turns"}))
            return reply(*calls, usage=usage)
        return reply(("write_candidate", {"code": variant(5 + it), "hypothesis": f"{5 + it} turns"}),
                     ("write_candidate", {"code": variant(4, "Solve the problem step by step. You can run python."),
                                          "hypothesis": "step by step"}), usage=usage)

    return script


def coordinator_config(run_dir: Path, base_url: str, **over: Any):
    from tests.helpers import small_config

    over = {"I": 3, **over}
    return small_config(run_dir, condition="mh_only", cycles=1, harness_phase__proposer="llm",
                        harness_phase__endpoint__model="scripted", harness_phase__endpoint__base_url=base_url,
                        harness_phase__endpoint__api_key_env="WHALE_TEST_PROPOSER_KEY",
                        harness_phase__llm__retry_backoff_s=0.01,
                        harness_phase__prices={"scripted": {"prompt": 1.0, "completion": 4.0, "cached": 0.25}},
                        **over)


def stop_actors(coordinator) -> None:
    import ray

    for actor in [*coordinator.policies, coordinator.proposer, *coordinator.pool.actors]:
        ray.kill(actor)
    gc.collect()


@pytest.mark.slow
def test_coordinator_rejects_leaks_logs_sessions_and_stops_on_the_proposer_budget(tmp_path, serve, ray_cluster,
                                                                                  tiny_policy):
    from actors.coordinator import Coordinator
    from whale_ray.report import ledger_lines
    from whale_ray.run_state import RunState

    splits = get_domain("math_reasoning").load_splits(load_config(None, {"data.n_test": 4}).data, 0)
    server = serve(smart_script([t.question for t in splits.test], silent=(3,)))
    # iteration 2: 2 calls x 3500 tokens. Iteration 3 writes nothing and its session stops on its share of
    # the budget (5000 left: 2 calls). Then the run's cap is reached and the phase ends (I = 4).
    cfg = coordinator_config(tmp_path / "run", server.base_url, I=4, harness_phase__max_proposer_tokens=12000)
    coordinator = Coordinator(cfg, tiny_policy)
    coordinator.run()
    stop_actors(coordinator)
    state = RunState.load(cfg.run_dir)
    archive = Archive(cfg.run_dir / "archive")

    assert state.finished and state.phases_done == ["1:harness:3"]  # I = 4, ended after 3 by the budget
    assert "max_proposer_tokens 12000" in state.ledger.proposer_stop
    assert server.sessions() == 2
    silent = json.loads((cfg.run_dir / "proposer" / "iter-0003" / "session.json").read_text())
    assert silent["stop_reason"] == "budget: tokens" and silent["proposals"] == [] and silent["usage"]["calls"] == 2
    assert state.ledger.harness_iterations == 3  # the empty iteration was recorded and the phase went on
    leaked = [c for c in archive.candidates() if c.status == "invalid"]
    assert len(leaked) == 1 and "leakage" in leaked[0].meta["reason"] and "FEW_SHOT" in leaked[0].code
    assert state.ledger.candidates_leaked == 1 and state.ledger.candidates_invalid == 1
    assert not list((cfg.run_dir / "rollouts").glob(f"*-{leaked[0].id}.parquet"))  # never run
    good = [c for c in archive.candidates("evaluated") if c.parent]
    assert [c.hypothesis for c in good] == ["four turns and ask for \\boxed{}"]
    # the session log, outside the archive; the archive lists candidates only
    log = json.loads((cfg.run_dir / "proposer" / "iter-0002" / "session.json").read_text())
    assert log["kind"] == "llm" and log["iteration"] == 2 and len(log["proposals"]) == 2
    assert "h0/traces.jsonl" in log["files_read"]
    assert archive.ids() == ["h0", "c001", "c002"]
    # the proposer ledger, apart from rollouts
    led = state.ledger
    assert (led.proposer_sessions, led.proposer_calls, led.proposer_prompt_tokens, led.proposer_completion_tokens,
            led.proposer_cached_tokens) == (2, 4, 12000, 2000, 4000)
    assert led.proposer_cost_usd == pytest.approx(2 * (4000 * 1.0 + 2000 * 0.25 + 1000 * 4.0) / 1e6)
    lines = "\n".join(ledger_lines(state))
    assert "proposer (separate ledger, not in rollouts): 2 sessions, 4 model calls" in lines
    assert "stopped by the proposer budget" in lines and "as D_test leakage" in lines


def launch_run(config: Path) -> subprocess.Popen:
    """`whale run --config` in its own process group (Ray included), as a user starts it."""
    return subprocess.Popen([sys.executable, "-m", "whale_ray.cli", "run", "--config", str(config)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            env={k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"})


def kill_run_when(proc: subprocess.Popen, ready: Callable[[], bool]) -> None:
    """SIGKILL the whole run (driver, Ray, actors) as soon as `ready()`; pytest's timeout is the only clock."""
    import signal

    while not ready():
        assert proc.poll() is None, "the run ended before its kill point"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@pytest.mark.slow
def test_resume_neither_reruns_a_finished_session_nor_counts_it_twice(tmp_path, serve, tiny_policy):
    """`whale run` killed (SIGKILL of its process group) twice: while iteration 2's candidates are evaluated,
    after its proposer session was logged; and inside iteration 3's session, after one of its calls was answered
    while the proposer waits for the next. The relaunches neither run session 2 again nor lose or double any
    spending: the aborted session's one call is kept as aborted-1, and iteration 3 runs once, afresh."""
    from whale_ray.run_state import RunState

    holding = threading.Event()
    scripted = smart_script([], leak=False)

    def script(body: dict[str, Any], index: int) -> Any:
        msgs = body["messages"]
        in_three = "Harness iteration 3" in msgs[1]["content"]
        if in_three and sum(m["role"] == "assistant" for m in msgs) == 1 and not holding.is_set():
            holding.set()  # the first launch that reaches here is killed while this request waits
            return stall(600)
        return scripted(body, index)

    server = serve(script)
    cfg = coordinator_config(tmp_path / "run", server.base_url)
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({**cfg.model_dump(mode="json"), "policy": {
        **cfg.model_dump(mode="json")["policy"], "model": tiny_policy}}))
    sdir = cfg.run_dir / "proposer"

    kill_run_when(launch_run(config), lambda: (sdir / "iter-0002" / "session.json").is_file())
    assert server.sessions() == 1
    kill_run_when(launch_run(config), holding.is_set)
    assert server.sessions() == 2  # iteration 2's session was not run again
    partial = json.loads((sdir / "iter-0003" / "session.partial.json").read_text())
    assert partial["partial"] and partial["usage"]["calls"] == 1  # what the killed session had spent
    final = launch_run(config)
    assert final.wait(timeout=900) == 0

    state = RunState.load(cfg.run_dir)
    archive = Archive(cfg.run_dir / "archive")
    assert state.finished and state.phases_done == ["1:harness:3"]
    assert server.sessions() == 3  # iteration 3 ran once more, afresh
    assert (sdir / "iter-0003" / "aborted-1.json").is_file()
    assert not (sdir / "iter-0003" / "session.partial.json").exists()
    per_iteration = {}
    for c in archive.candidates():
        per_iteration.setdefault(c.iteration, []).append(c)
    assert len(per_iteration[2]) == 2 and len(per_iteration[3]) == 2  # no duplicates
    assert all(c.status == "evaluated" for c in archive.candidates())
    # the seed was evaluated once
    assert [p.name for p in (cfg.run_dir / "rollouts").glob("harness-*-h0.parquet")] == ["harness-c00-i001-h0.parquet"]
    # the ledger: two finished sessions (2 calls each) plus the aborted one (1 call), each counted once
    led = state.ledger
    assert set(state.proposer_sessions) == {"iter-0002/session", "iter-0003/aborted-1", "iter-0003/session"}
    assert led.proposer_sessions == 3 and led.proposer_calls == 5
    assert led.proposer_prompt_tokens == 5 * 3000 and led.proposer_completion_tokens == 5 * 500


# ================================================================ the command line


def test_whale_run_refuses_a_remote_proposer_without_its_key(tmp_path):
    run_dir = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "-m", "whale_ray.cli", "run", "--proposer", "llm", "--proposer-model", "gpt-x",
         "--proposer-base-url", "https://api.example.com/v1", "--proposer-api-key-env", "WHALE_TEST_PROPOSER_KEY",
         "--run-dir", str(run_dir)], cwd=REPO, capture_output=True, text=True, timeout=120,
        env={"COLUMNS": "400", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 2, out.stdout + out.stderr
    assert "WHALE_TEST_PROPOSER_KEY" in out.stdout and not run_dir.exists()


@pytest.mark.slow
def test_whale_run_with_the_llm_proposer_on_loopback(tmp_path, serve, tiny_policy):
    from tests.helpers import SMALL

    server = serve(smart_script([], leak=False))
    config = tmp_path / "study.yaml"
    tree: dict[str, Any] = {"condition": "mh_only", "cycles": 1, "I": 2, "policy": {"model": tiny_policy}}
    for key, value in SMALL.items():
        if key.split(".")[0] not in ("cycles", "I", "E", "adaptive", "weight"):
            section, _, leaf = key.rpartition(".")
            (tree.setdefault(section, {}) if section else tree)[leaf] = value
    config.write_text(yaml.safe_dump(tree))
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "OPENAI_API_KEY")}
    out = subprocess.run(
        [sys.executable, "-m", "whale_ray.cli", "run", "--config", str(config), "--run-dir", str(run_dir),
         "--proposer", "llm", "--proposer-model", "scripted", "--proposer-base-url", server.base_url],
        cwd=REPO, capture_output=True, text=True, timeout=300, env={**env, "COLUMNS": "400"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    state = json.loads((run_dir / "state.json").read_text())
    assert state["ledger"]["proposer_sessions"] == 1 and state["ledger"]["proposer_prompt_tokens"] == 6000
    assert server.sessions() == 1
    assert "proposer (separate ledger, not in rollouts): 1 sessions" in out.stdout
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["harness_phase"]["endpoint"]["base_url"] == \
        server.base_url
    assert (run_dir / "proposer" / "iter-0002" / "session.json").is_file()
