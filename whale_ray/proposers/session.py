"""What one proposer session spent and did: usage, prices, budget limits and the session log.

A session is one `propose` call for one harness iteration. Its log is returned to the coordinator,
which writes it to `<run_dir>/proposer/iter-NNNN/session.json` before it adds the session's candidates
to the archive (so a relaunch never runs a finished session again), and which keeps the proposer
ledger apart from the rollout ledger (see `proposer_ledger`).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Mapping

from whale_ray.storage import atomic_write_text

SESSION_FILE = "session.json"  # a finished session: its proposals are final
PARTIAL_FILE = "session.partial.json"  # a session in progress, rewritten after every turn


@dataclass
class Usage:
    """Tokens, money and time one or more sessions spent. `cost_usd` comes from the config's price table
    (or from the agent CLI's own report)."""

    sessions: int = 0
    calls: int = 0  # model calls that returned
    prompt_tokens: int = 0  # all prompt tokens, cached ones included
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the provider served from its cache
    cost_usd: float = 0.0
    wall_s: float = 0.0
    retries: int = 0  # retried requests (429, 5xx, timeouts)
    estimated_calls: int = 0  # calls without a usage report: their tokens were estimated from text length

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def add(self, other: "Usage") -> "Usage":
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        return self

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["cost_usd"] = round(d["cost_usd"], 8)
        d["wall_s"] = round(d["wall_s"], 3)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> "Usage":
        d = d or {}
        names = {f.name for f in fields(cls)}
        return cls(**{k: type(getattr(cls(), k))(v) for k, v in d.items() if k in names and v is not None})


def price_for(prices: Mapping[str, Any], model: str | None) -> dict[str, float] | None:
    """The price entry for `model` ({"prompt", "completion", "cached"} USD per 1M tokens), or None."""
    if not model or model not in prices:
        return None
    p = prices[model]
    p = p.model_dump() if hasattr(p, "model_dump") else dict(p)
    cached = p.get("cached")
    return {"prompt": float(p.get("prompt") or 0.0), "completion": float(p.get("completion") or 0.0),
            "cached": float(p.get("prompt") or 0.0) if cached is None else float(cached)}


def cost_usd(price: Mapping[str, float] | None, prompt_tokens: int, completion_tokens: int,
             cached_tokens: int) -> float:
    """USD for one call: uncached prompt tokens, cached prompt tokens and completion tokens at their prices."""
    if price is None:
        return 0.0
    cached = max(0, min(cached_tokens, prompt_tokens))
    return ((prompt_tokens - cached) * price["prompt"] + cached * price["cached"]
            + completion_tokens * price["completion"]) / 1e6


@dataclass
class Limits:
    """What is left of the run's proposer budget when a session starts (None: no cap)."""

    max_tokens: int | None = None
    max_cost_usd: float | None = None
    max_wall_s: float | None = None

    def exceeded(self, used: Usage, wall_s: float | None = None) -> str | None:
        """Which cap `used` has reached ("tokens", "cost", "wall"), or None."""
        wall = used.wall_s if wall_s is None else wall_s
        if self.max_tokens is not None and used.tokens >= self.max_tokens:
            return "tokens"
        if self.max_cost_usd is not None and used.cost_usd >= self.max_cost_usd - 1e-12:
            return "cost"
        if self.max_wall_s is not None and wall >= self.max_wall_s:
            return "wall"
        return None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> "Limits":
        d = d or {}
        return cls(max_tokens=d.get("max_tokens"), max_cost_usd=d.get("max_cost_usd"), max_wall_s=d.get("max_wall_s"))


def remaining_limits(harness_phase: Any, spent: Usage) -> Limits:
    """The run's caps (`harness_phase.max_proposer_*`) minus what the run has spent."""
    hp = harness_phase

    def left(cap: float | None, used: float) -> float | None:
        return None if cap is None else max(0.0, cap - used)

    tokens = left(hp.max_proposer_tokens, spent.tokens)
    return Limits(max_tokens=None if tokens is None else int(tokens),
                  max_cost_usd=left(hp.max_proposer_cost_usd, spent.cost_usd),
                  max_wall_s=left(hp.max_proposer_wall_s, spent.wall_s))


def budget_exhausted(harness_phase: Any, spent: Usage) -> str | None:
    """The run-wide proposer cap that `spent` has reached, as a sentence, or None."""
    hp = harness_phase
    if hp.max_proposer_tokens is not None and spent.tokens >= hp.max_proposer_tokens:
        return f"proposer tokens {spent.tokens} >= max_proposer_tokens {hp.max_proposer_tokens}"
    if hp.max_proposer_cost_usd is not None and spent.cost_usd >= hp.max_proposer_cost_usd - 1e-12:
        return f"proposer cost ${spent.cost_usd:.4f} >= max_proposer_cost_usd ${hp.max_proposer_cost_usd:.4f}"
    if hp.max_proposer_wall_s is not None and spent.wall_s >= hp.max_proposer_wall_s:
        return f"proposer wall time {spent.wall_s:.1f} s >= max_proposer_wall_s {hp.max_proposer_wall_s:.1f} s"
    return None


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


@dataclass
class SessionLog:
    """Everything one session did; `to_dict` is what session.json holds."""

    kind: str
    iteration: int
    n: int
    model: str | None = None
    base_url: str | None = None
    started: str = field(default_factory=_now)
    limits: dict[str, Any] = field(default_factory=dict)
    messages: list[dict[str, Any]] = field(default_factory=list)  # the full transcript
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # {turn, name, arguments, ok, error, chars}
    files_read: list[str] = field(default_factory=list)  # archive paths read or searched, in order, once each
    files_written: list[dict[str, Any]] = field(default_factory=list)  # every write: {name, parent, accepted, error}
    retries: list[dict[str, Any]] = field(default_factory=list)  # {turn, attempt, error, wait_s}
    notes: list[str] = field(default_factory=list)
    proposals: list[dict[str, str]] = field(default_factory=list)  # the accepted candidates
    stop_reason: str = ""
    usage: Usage = field(default_factory=Usage)
    _t0: float = field(default_factory=time.monotonic, repr=False)

    def elapsed(self) -> float:
        return time.monotonic() - self._t0

    def read(self, path: str) -> None:
        if path not in self.files_read:
            self.files_read.append(path)

    def to_dict(self, secrets: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if not k.startswith("_")}
        d["usage"] = self.usage.to_dict()
        d["finished"] = _now()
        return redact(d, secrets)

    def write_partial(self, path: Path | None, secrets: list[str] | tuple[str, ...] = ()) -> None:
        """The session so far (session.partial.json), so a killed session's spending is not lost."""
        if path is None:
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(path, json.dumps({**self.to_dict(secrets), "partial": True}, ensure_ascii=False))
        except OSError as e:  # logging must never end a session
            self.notes.append(f"could not write {path}: {e}")


def redact(obj: Any, secrets: list[str] | tuple[str, ...]) -> Any:
    """`obj` with every occurrence of a secret (8 characters or more) replaced by '***'."""
    secrets = [s for s in secrets if s and len(s) >= 8]
    if not secrets:
        return obj

    def walk(x: Any) -> Any:
        if isinstance(x, str):
            for s in secrets:
                x = x.replace(s, "***")
            return x
        if isinstance(x, dict):
            return {walk(k): walk(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [walk(v) for v in x]
        return x

    return walk(obj)


def estimate_tokens(text: str) -> int:
    """A rough token count (4 characters a token) for servers that report no usage."""
    return max(1, math.ceil(len(text) / 4))




# ------------------------------------------------------------------------------ the run directory


def session_dir(run_dir: str | Path, iteration: int) -> Path:
    """Where the proposer session of harness iteration `iteration` is logged (outside the archive)."""
    return Path(run_dir) / "proposer" / f"iter-{iteration:04d}"


def load_session(directory: Path) -> dict[str, Any] | None:
    """The finished session logged in `directory`, or None when there is none."""
    path = Path(directory) / SESSION_FILE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError:
        return None  # cannot happen with atomic writes; then the session runs again


def write_session(directory: Path, record: dict[str, Any]) -> Path:
    """Store a finished session (atomically): from now on its proposals are final."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / SESSION_FILE
    atomic_write_text(path, json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    (directory / PARTIAL_FILE).unlink(missing_ok=True)
    return path


def retire_partial(directory: Path) -> Path | None:
    """A session killed before it finished left session.partial.json: rename it to aborted-<k>.json (its
    spending is then counted by `logged_sessions`) so that the session runs afresh."""
    directory = Path(directory)
    partial = directory / PARTIAL_FILE
    if not partial.is_file():
        return None
    k = 1
    while (directory / f"aborted-{k}.json").exists():
        k += 1
    target = directory / f"aborted-{k}.json"
    partial.rename(target)
    return target


def logged_sessions(directory: Path) -> list[tuple[str, Usage]]:
    """(name, usage) of every session logged in `directory`: aborted ones, then the finished one.
    The names are stable, so recording them in a dict counts each once however often it is read."""
    directory = Path(directory)
    out = []
    paths = sorted(directory.glob("aborted-*.json"), key=lambda p: int(p.stem.split("-")[1]))
    if (directory / SESSION_FILE).is_file():
        paths.append(directory / SESSION_FILE)
    for path in paths:
        try:
            usage = Usage.from_dict(json.loads(path.read_text(encoding="utf-8")).get("usage"))
        except ValueError:
            usage = Usage()
        out.append((f"{directory.name}/{path.stem}", usage))
    return out


def total_usage(sessions: Mapping[str, Mapping[str, Any]]) -> Usage:
    total = Usage()
    for u in sessions.values():
        total.add(Usage.from_dict(u))
    return total


__all__ = ["Usage", "Limits", "SessionLog", "price_for", "cost_usd", "remaining_limits", "budget_exhausted",
           "redact", "estimate_tokens", "SESSION_FILE", "PARTIAL_FILE", "session_dir", "load_session",
           "write_session", "retire_partial", "logged_sessions", "total_usage"]
