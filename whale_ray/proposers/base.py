"""The one contract every harness proposer implements: `propose(...)` returns a `Session`.

A session is one call for one harness iteration: up to `n` proposals (new candidate code, its parent,
its hypothesis) and the session's log (`SessionLog.to_dict()`: messages, tool calls, notes, the stop
reason and the usage), which the coordinator keeps under <run_dir>/proposer/iter-NNNN/session.json.
Every kind takes the same arguments, so whoever drives a proposer never asks which kind it is.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Iterator

from whale_ray.archive import Archive
from whale_ray.proposers.session import Limits, SessionLog


class ProposerError(ValueError):
    """The proposer cannot work: no candidate in the archive, a missing API key or tool, a bad config."""


@dataclass
class Proposal:
    code: str
    parent: str
    hypothesis: str

    def to_dict(self) -> dict[str, str]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Proposal":
        return cls(code=d["code"], parent=d["parent"], hypothesis=d["hypothesis"])


@dataclass(frozen=True)
class Session:
    """What one `propose` call returns. It iterates over its proposals."""

    proposals: list[Proposal]
    log: dict[str, Any]  # JSON-able, secrets redacted; "usage" is what the session spent

    def __iter__(self) -> Iterator[Proposal]:
        return iter(self.proposals)

    def __len__(self) -> int:
        return len(self.proposals)


class Proposer(ABC):
    """A harness proposer. Subclasses set `kind` and implement `_session`; `propose` opens the log,
    runs the session, and closes the log with the session's count, wall time and proposals."""

    kind: ClassVar[str]

    last_session: dict[str, Any] | None = None  # the log of the latest session (also in its Session)

    def propose(self, archive: Archive, n: int, iteration: int, *, skill_text: str, seed: int,
                limits: Limits | None = None, log_path: str | Path | None = None) -> Session:
        """Up to `n` new candidates for harness iteration `iteration` (fewer when the proposer finds no
        more). `limits` is what is left of the run's proposer budget; `log_path` is where a long session
        keeps its log while it works (session.partial.json), so a kill loses none of its spending."""
        limits = limits or Limits()
        log = SessionLog(kind=self.kind, iteration=iteration, n=n, limits=limits.to_dict())
        log.usage.sessions = 1  # from the start: a session killed mid-way (its partial log) was a session too
        proposals = self._session(archive, n, iteration, skill_text=skill_text, seed=seed, limits=limits,
                                  log_path=Path(log_path) if log_path else None, log=log)
        log.usage.wall_s = log.elapsed()
        log.proposals = [p.to_dict() for p in proposals]
        self.last_session = log.to_dict(self.secrets())
        return Session(proposals, self.last_session)

    @abstractmethod
    def _session(self, archive: Archive, n: int, iteration: int, *, skill_text: str, seed: int, limits: Limits,
                 log_path: Path | None, log: SessionLog) -> list[Proposal]:
        """The proposals of one session; what it did goes into `log` (notes, messages, usage, stop_reason)."""

    def secrets(self) -> list[str]:
        """Values to redact from the session log (API keys)."""
        return []


__all__ = ["Proposal", "Proposer", "ProposerError", "Session"]
