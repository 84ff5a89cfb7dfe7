"""HarnessProposer: the Ray actor that reads the archive and writes candidate harness files.

A thin shell around `whale_ray.proposer`: all logic is testable without Ray. The actor opens the
archive read-only (the coordinator is its only writer) and returns plain dicts
({"code", "parent", "hypothesis"}) that the coordinator validates, archives and evaluates.
"""

from __future__ import annotations

from typing import Any

import ray

from whale_ray.archive import Archive
from whale_ray.proposer import PROPOSER_KINDS, make_proposer


@ray.remote
class HarnessProposer:
    def __init__(self, kind: str, skill_text: str, seed: int, **options: Any) -> None:
        """`options` go to the proposer (OfflineProposer: other_parent_prob, second_edit_prob, dedupe...)."""
        if kind not in PROPOSER_KINDS:
            raise ValueError(f"unknown proposer kind {kind!r}; choose one of {', '.join(PROPOSER_KINDS)}")
        self.kind = kind
        self.skill_text = skill_text
        self.seed = int(seed)
        self._proposer = make_proposer(kind, **options)
        self._calls = 0
        self._proposals = 0

    def propose(self, archive_root: str, n: int, iteration: int) -> list[dict[str, Any]]:
        archive = Archive(archive_root, read_only=True)
        proposals = self._proposer.propose(archive, n, iteration, skill_text=self.skill_text, seed=self.seed)
        self._calls += 1
        self._proposals += len(proposals)
        return [p.to_dict() for p in proposals]

    def notes(self) -> list[str]:
        """What the last `propose` diagnosed and skipped (for the run log)."""
        return list(getattr(self._proposer, "notes", []))

    def usage(self) -> dict[str, Any]:
        """The proposer's own ledger, kept apart from rollouts (the offline proposer spends no tokens)."""
        return {"kind": self.kind, "calls": self._calls, "proposals": self._proposals,
                "prompt_tokens": 0, "completion_tokens": 0, "cost_usd": 0.0}
