"""Model-backed harness proposers behind `whale_ray.proposer.Proposer`, and what they share.

    llm.py            `llm`: a built-in agent loop over the openai client (any OpenAI-compatible endpoint)
    agent_cli.py      `agent-cli`: an external coding-agent command in a bubblewrap jail
    archive_tools.py  the read-only archive tools (list, read, grep, diff, frontier, history)
    prompts.py        the Meta-Harness task text, the archive layout and the archive overview
    session.py        usage, prices, budget limits, the session log and where it is stored
    leakage.py        the D_test leakage check the coordinator runs on every candidate

Both proposers take the run's `HarnessPhaseConfig` and return `Proposal`s; the log of their last
session is `last_session` (a JSON-able dict, secrets redacted).
"""

from __future__ import annotations

from typing import Any


def proposer_options(harness_phase: Any) -> dict[str, Any]:
    """The keyword arguments `make_proposer(kind, ...)` needs for a config's `harness_phase` (JSON-able,
    so they can travel to the HarnessProposer actor)."""
    if harness_phase.proposer == "offline":
        return {"dedupe": harness_phase.offline_dedupe}
    return {"config": harness_phase.model_dump(mode="json")}


__all__ = ["proposer_options"]
