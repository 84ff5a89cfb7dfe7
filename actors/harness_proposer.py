"""HarnessProposer: the Ray actor that reads the archive and writes candidate harness files.

A thin shell around `whale_ray.proposer` and `whale_ray.proposers`: all logic is testable without Ray.
The actor opens the archive read-only (the coordinator is its only writer) and returns plain dicts
({"code", "parent", "hypothesis"}) that the coordinator validates, archives and evaluates.

`session` is what the coordinator calls: the proposals plus the session's log (messages, tool calls,
files read and written, retries, usage), which the coordinator stores under
`<run_dir>/proposer/iter-NNNN/session.json` before it archives the proposals. The API key of a
model-backed proposer is read here, in this trusted process, from the variable the config names.
"""

from __future__ import annotations

import time
from typing import Any

import ray

from whale_ray.archive import Archive
from whale_ray.proposer import PROPOSER_KINDS, make_proposer
from whale_ray.proposers.session import Limits, SessionLog


@ray.remote
class HarnessProposer:
    def __init__(self, kind: str, skill_text: str, seed: int, **options: Any) -> None:
        """`options` go to the proposer (OfflineProposer: other_parent_prob, second_edit_prob, dedupe...;
        llm and agent-cli: config=<harness_phase as a dict>)."""
        if kind not in PROPOSER_KINDS:
            raise ValueError(f"unknown proposer kind {kind!r}; choose one of {', '.join(PROPOSER_KINDS)}")
        self.kind = kind
        self.skill_text = skill_text
        self.seed = int(seed)
        self._proposer = make_proposer(kind, **options)
        self._calls = 0
        self._proposals = 0
        self._usage: dict[str, float] = {}

    def propose(self, archive_root: str, n: int, iteration: int) -> list[dict[str, Any]]:
        return self.session(archive_root, n, iteration)["proposals"]

    def session(self, archive_root: str, n: int, iteration: int, limits: dict[str, Any] | None = None,
                log_path: str | None = None) -> dict[str, Any]:
        """{"proposals": [...], "session": the session log with its "usage"}; `limits` is what is left of
        the run's proposer budget, `log_path` where a model-backed proposer keeps its log while it works."""
        archive = Archive(archive_root, read_only=True)
        started = time.monotonic()
        if self.kind == "offline":
            proposals = self._proposer.propose(archive, n, iteration, skill_text=self.skill_text, seed=self.seed)
            log = SessionLog(kind="offline", iteration=iteration, n=n, notes=list(self._proposer.notes),
                             stop_reason="done", proposals=[p.to_dict() for p in proposals])
            log.usage.sessions = 1
            log.usage.wall_s = time.monotonic() - started
            session = log.to_dict()
        else:
            proposals = self._proposer.propose(archive, n, iteration, skill_text=self.skill_text, seed=self.seed,
                                               limits=Limits.from_dict(limits), log_path=log_path)
            session = self._proposer.last_session
        self._calls += 1
        self._proposals += len(proposals)
        for k, v in (session.get("usage") or {}).items():
            self._usage[k] = self._usage.get(k, 0) + v
        return {"proposals": [p.to_dict() for p in proposals], "session": session}

    def notes(self) -> list[str]:
        """What the last `propose` diagnosed and skipped (for the run log)."""
        return list(getattr(self._proposer, "notes", []))

    def usage(self) -> dict[str, Any]:
        """This actor's share of the proposer ledger, kept apart from rollouts (the run's total is in the
        coordinator's state: an actor restarted on resume starts from zero)."""
        u = self._usage
        return {"kind": self.kind, "calls": self._calls, "proposals": self._proposals,
                "prompt_tokens": int(u.get("prompt_tokens", 0)),
                "completion_tokens": int(u.get("completion_tokens", 0)),
                "cached_tokens": int(u.get("cached_tokens", 0)), "cost_usd": float(u.get("cost_usd", 0.0)),
                "wall_s": float(u.get("wall_s", 0.0)), "retries": int(u.get("retries", 0))}
