"""HarnessProposer: the Ray actor that reads the archive and writes candidate harness files.

A thin shell around `whale_ray.proposers` (all logic is testable without Ray): every kind implements
the same `Proposer.propose` contract, so nothing here asks which kind it hosts. The actor opens the
archive read-only (the coordinator is its only writer) and returns plain dicts that the coordinator
logs, validates, archives and evaluates.

`session` is what the coordinator calls: the proposals plus the session's log (messages, tool calls,
files read and written, retries, usage), which the coordinator stores under
`<run_dir>/proposer/iter-NNNN/session.json` before it archives the proposals. The API key of a
model-backed proposer is read here, in this trusted process, from the variable the config names.
"""

from __future__ import annotations

from typing import Any

import ray

from whale_ray.archive import Archive
from whale_ray.proposers.registry import make_proposer
from whale_ray.proposers.session import Limits, Usage


@ray.remote
class HarnessProposer:
    def __init__(self, kind: str, skill_text: str, seed: int, **options: Any) -> None:
        """`options` go to the proposer (see `whale_ray.proposers.registry.proposer_options`)."""
        self._proposer = make_proposer(kind, **options)
        self.skill_text = skill_text
        self.seed = int(seed)
        self._calls = 0
        self._proposals = 0
        self._usage = Usage()
        self._notes: list[str] = []

    def session(self, archive_root: str, n: int, iteration: int, limits: dict[str, Any] | None = None,
                log_path: str | None = None) -> dict[str, Any]:
        """{"proposals": [{"code", "parent", "hypothesis"}...], "session": the session log with its "usage"};
        `limits` is what is left of the run's proposer budget, `log_path` where the session keeps its log
        while it works."""
        s = self._proposer.propose(Archive(archive_root, read_only=True), n, iteration, skill_text=self.skill_text,
                                   seed=self.seed, limits=Limits.from_dict(limits), log_path=log_path)
        self._calls += 1
        self._proposals += len(s.proposals)
        self._usage.add(Usage.from_dict(s.log.get("usage")))
        self._notes = list(s.log.get("notes") or [])
        return {"proposals": [p.to_dict() for p in s.proposals], "session": s.log}

    def notes(self) -> list[str]:
        """What the last session diagnosed and skipped (for the run log)."""
        return list(self._notes)

    def usage(self) -> dict[str, Any]:
        """This actor's share of the proposer ledger, kept apart from rollouts (the run's total is in the
        coordinator's state: an actor restarted on resume starts from zero)."""
        u = self._usage
        return {"kind": self._proposer.kind, "calls": self._calls, "proposals": self._proposals,
                "prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
                "cached_tokens": u.cached_tokens, "cost_usd": u.cost_usd, "wall_s": u.wall_s, "retries": u.retries}
