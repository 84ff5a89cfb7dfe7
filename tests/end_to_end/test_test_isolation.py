"""D_test isolation end to end: after a whale study with a scripted LLM proposer (the real `openai` client against
an OpenAI-compatible server on loopback), no D_test id, question or answer is under archive/ or proposer/, in
what the proposer sent to its model, or in any episode outside the test reports; and no episode's sandbox saw
more of its task than the public fields. (The offline proposer's studies get the same check in
tests/cluster/test_coordinator.py, every condition of every domain.)"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.helpers import FakeOpenAI, reply, small_config, variant
from tests.run_truth import check_no_test_data, check_test_isolation


def prying_script(body: dict[str, Any], index: int) -> dict[str, Any]:
    """A proposer that reads everything it can reach (the archive's listing and traces, and paths outside the
    archive where the run keeps its test reports), then writes two candidates."""
    turn = sum(1 for m in body["messages"] if m["role"] == "assistant")
    if turn == 0:
        return reply(("list_candidates", {}), ("read_file", {"path": "h0/traces.jsonl"}),
                     ("read_file", {"path": "../state.json"}), ("read_file", {"path": "../rollouts"}),
                     ("read_file", {"path": "/etc/hostname"}))
    if turn == 1:
        return reply(("write_candidate", {"code": variant(4), "hypothesis": "four turns and ask for \\boxed{}"}),
                     ("write_candidate", {"code": variant(3), "hypothesis": "three turns"}))
    return reply(content="Done.")


@pytest.mark.slow
def test_no_test_data_reaches_archive_proposer_or_sandbox(tmp_path, ray_cluster, tiny_policy, monkeypatch):
    from actors.coordinator import Coordinator

    monkeypatch.delenv("WHALE_TEST_PROPOSER_KEY", raising=False)  # loopback needs no key
    server = FakeOpenAI(prying_script)
    try:
        cfg = small_config(tmp_path / "run", condition="whale", cycles=1, harness_phase__proposer="llm",
                           harness_phase__endpoint__model="scripted",
                           harness_phase__endpoint__base_url=server.base_url,
                           harness_phase__endpoint__api_key_env="WHALE_TEST_PROPOSER_KEY",
                           harness_phase__llm__retry_backoff_s=0.01)
        Coordinator(cfg, tiny_policy).run()
    finally:
        server.close()
    state = json.loads((cfg.run_dir / "state.json").read_text())
    assert state["finished"] and state["ledger"]["proposer_sessions"] == 1
    assert len(server.requests) >= 2  # the proposer read, then wrote
    session = json.loads((cfg.run_dir / "proposer" / "iter-0002" / "session.json").read_text())
    assert len(session["proposals"]) == 2
    check_test_isolation(cfg, cfg.run_dir)
    check_no_test_data(cfg, {f"proposer request {i}": json.dumps(r) for i, r in enumerate(server.requests)})
