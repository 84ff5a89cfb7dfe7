"""Proposer kinds by name: `harness_phase.proposer` -> the class, imported only when asked for (as in
ray.tune.search), so an offline run never imports the openai client or the jail code."""

from __future__ import annotations

from typing import Any, Callable

from whale_ray.proposers.base import Proposer


def _offline() -> type[Proposer]:
    from whale_ray.proposers.offline import OfflineProposer

    return OfflineProposer


def _llm() -> type[Proposer]:
    from whale_ray.proposers.llm import LLMProposer

    return LLMProposer


def _agent_cli() -> type[Proposer]:
    from whale_ray.proposers.agent_cli import AgentCLIProposer

    return AgentCLIProposer


PROPOSERS: dict[str, Callable[[], type[Proposer]]] = {"offline": _offline, "llm": _llm, "agent-cli": _agent_cli}
PROPOSER_KINDS = tuple(PROPOSERS)


def proposer_class(kind: str) -> type[Proposer]:
    if kind not in PROPOSERS:
        raise ValueError(f"unknown proposer kind {kind!r}; choose one of {', '.join(PROPOSER_KINDS)}")
    return PROPOSERS[kind]()


def make_proposer(kind: str, **options: Any) -> Proposer:
    """The proposer for a config's `harness_phase.proposer` kind, built with `options` (see
    `proposer_options`): offline takes its knobs (dedupe, other_parent_prob...), llm and agent-cli take
    config=<the HarnessPhaseConfig or its dict>."""
    return proposer_class(kind)(**options)


def proposer_options(harness_phase: Any) -> dict[str, Any]:
    """The keyword arguments `make_proposer(kind, ...)` needs for a config's `harness_phase` (JSON-able,
    so they can travel to the HarnessProposer actor)."""
    if harness_phase.proposer == "offline":
        return {"dedupe": harness_phase.offline_dedupe}
    return {"config": harness_phase.model_dump(mode="json")}


__all__ = ["PROPOSERS", "PROPOSER_KINDS", "make_proposer", "proposer_class", "proposer_options"]
