"""The harness archive: every candidate's code, meta, scores and traces on disk, and views of them.

The folders are the truth; `summary.jsonl` and `frontier.json` are views rebuilt from them.

    <root>/                      (usually <run_dir>/archive)
      h0/                        the seed harness
        harness.py               the candidate's code
        meta.json                id, parent, iteration, cycle, hypothesis, status, reason, weight_version, created, seq
        diff.patch               unified diff against the parent (empty for a seed)
        traces.jsonl             after evaluation: one JSON trace per episode (records.Rollout.trace)
        scores.json              after evaluation: per-episode rows and aggregates. Its presence is
                                 what makes a candidate "evaluated"; it is written last.
      c001/ c002/ ...
      summary.jsonl              one line per evaluated or invalid candidate
      frontier.json              the archive-wide Pareto frontier, and one per weight version

Every file is written atomically (temp file in the same folder, fsync, os.replace). A new candidate
folder is built under a hidden temp name and renamed into place, so a crash never leaves a half-made
candidate; names starting with "." are ignored when reading.

The archive only stores: which candidate is best is `whale_ray.selection`'s call (frontier.json is
written with it). The archive is a plain class (no Ray). One process writes it (the coordinator); any number may read
it (`Archive(root, read_only=True)`, as the proposer does).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable

from whale_ray import selection
from whale_ray.harness import harness_diff
from whale_ray.records import STATUSES
from whale_ray.storage import atomic_write_text, fsync_dir, write_file

CANDIDATE_STATUSES = ("proposed", "invalid", "evaluated")
_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
_AUTO_ID_RE = re.compile(r"^c(\d+)$")


class ArchiveError(ValueError):
    """The archive is missing, inconsistent, or was asked for something it cannot do."""


@dataclass
class Candidate:
    id: str
    code: str
    meta: dict[str, Any]
    scores: dict[str, Any] | None = None  # None until evaluated
    path: Path | None = field(default=None, repr=False)

    @property
    def status(self) -> str:
        return self.meta["status"]

    @property
    def parent(self) -> str | None:
        return self.meta.get("parent")

    @property
    def iteration(self) -> int:
        return self.meta.get("iteration", 0)

    @property
    def cycle(self) -> int:
        return self.meta.get("cycle", 0)

    @property
    def hypothesis(self) -> str:
        return self.meta.get("hypothesis", "")

    @property
    def weight_version(self) -> int | None:
        return self.meta.get("weight_version")

    def _agg(self, key: str) -> float:
        if self.scores is None:
            raise ArchiveError(f"candidate {self.id!r} is {self.status}, not evaluated: it has no {key}")
        return self.scores[key]

    @property
    def success_rate(self) -> float:
        return self._agg("success_rate")

    @property
    def mean_turns(self) -> float:
        return self._agg("mean_turns")

    @property
    def mean_prompt_tokens(self) -> float:
        return self._agg("mean_prompt_tokens")

    @property
    def order(self) -> tuple:
        """Creation order (what `candidates()` sorts by, and selection's last tie-break)."""
        return (self.meta.get("seq", math.inf), self.id)

    def traces(self) -> list[dict[str, Any]]:
        """The episode traces (parsed JSON), empty when not evaluated."""
        if self.path is None or self.scores is None:
            return []
        return _read_traces(self.path / "traces.jsonl")


# --------------------------------------------------------------------------------------------- io


def _dumps(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ArchiveError(f"archive file {path}: not valid JSON ({e})") from None


def _read_traces(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            out.append(json.loads(line))
    return out


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


# ---------------------------------------------------------------------------------------- archive


class Archive:
    """The filesystem archive of harness candidates. See the module docstring for the layout."""

    def __init__(self, root: str | Path, *, read_only: bool = False) -> None:
        self.root = Path(root)
        self.read_only = read_only
        if read_only:
            if not self.root.is_dir():
                raise ArchiveError(f"archive {self.root}: not found")
        else:
            self.root.mkdir(parents=True, exist_ok=True)
            if self.root.is_dir() and any(self._candidate_dirs()):
                self.rebuild_index()  # a crash may have left the views behind the folders

    def __repr__(self) -> str:
        return f"Archive({str(self.root)!r}{', read_only=True' if self.read_only else ''})"

    # ------------------------------------------------------------------------------ reading

    def _candidate_dirs(self) -> Iterable[Path]:
        for p in self.root.iterdir():
            if p.name.startswith(".") or not p.is_dir():
                continue  # temp folders of unfinished writes, stray files
            if (p / "meta.json").is_file() and (p / "harness.py").is_file():
                yield p

    def _load(self, d: Path) -> Candidate:
        meta = _read_json(d / "meta.json")
        code = (d / "harness.py").read_text(encoding="utf-8")
        scores = None
        if (d / "scores.json").is_file():
            scores = _read_json(d / "scores.json")
            # scores.json is the commit point: it wins over a meta.json not yet updated
            meta = {**meta, "status": "evaluated", "weight_version": scores.get("weight_version")}
        elif meta.get("status") == "evaluated":
            meta = {**meta, "status": "proposed"}  # cannot happen with atomic writes; never trust it
        return Candidate(id=d.name, code=code, meta=meta, scores=scores, path=d)

    def __contains__(self, candidate_id: object) -> bool:
        d = self.root / str(candidate_id)
        return (
            isinstance(candidate_id, str) and _ID_RE.match(candidate_id) is not None
            and (d / "meta.json").is_file() and (d / "harness.py").is_file()
        )

    def __len__(self) -> int:
        return sum(1 for _ in self._candidate_dirs())

    def get(self, candidate_id: str) -> Candidate:
        if candidate_id not in self:
            raise ArchiveError(f"archive {self.root}: no candidate {candidate_id!r}")
        return self._load(self.root / candidate_id)

    def candidates(self, status: str | None = None) -> list[Candidate]:
        """All candidates in creation order, optionally only those with `status`."""
        if status is not None and status not in CANDIDATE_STATUSES:
            raise ValueError(f"unknown candidate status {status!r}; expected one of {CANDIDATE_STATUSES}")
        cands = [self._load(d) for d in self._candidate_dirs()]
        cands.sort(key=lambda c: c.order)
        return [c for c in cands if status is None or c.status == status]

    def ids(self) -> list[str]:
        return [c.id for c in self.candidates()]

    def pending(self, iteration: int, *, cycle: int | None = None) -> list[Candidate]:
        """Candidates proposed for `iteration` (and `cycle`, when given) that are neither evaluated
        nor invalid: a restarted harness phase evaluates these instead of proposing again."""
        return [
            c for c in self.candidates("proposed")
            if c.iteration == iteration and (cycle is None or c.cycle == cycle)
        ]

    def weight_versions(self) -> list[int]:
        """The weight versions that candidates were evaluated under, ascending."""
        return sorted({c.weight_version for c in self.candidates("evaluated") if c.weight_version is not None})

    def view_for_proposer(self, *, traces: bool | Iterable[str] = True) -> list[dict[str, Any]]:
        """What a proposer may read: code, meta, scores and traces of evaluated and invalid
        candidates (all from D_harness; the archive never holds test data). `traces` is True (all),
        False (none) or the ids whose traces to include."""
        want = None if traces is True else set() if traces is False else set(traces)
        out = []
        for c in self.candidates():
            if c.status == "proposed":
                continue
            item = {**{k: c.meta.get(k) for k in ("parent", "iteration", "cycle", "hypothesis", "status",
                                                   "reason", "weight_version")},
                    "id": c.id, "code": c.code, "scores": c.scores}
            item["traces"] = c.traces() if (want is None or c.id in want) else None
            out.append(item)
        return out

    # ------------------------------------------------------------------------------ writing

    def _writable(self) -> None:
        if self.read_only:
            raise ArchiveError(f"archive {self.root} was opened read-only")

    def _next_id(self) -> str:
        nums = [int(m.group(1)) for p in self.root.iterdir() if (m := _AUTO_ID_RE.match(p.name))]
        return f"c{max(nums, default=0) + 1:03d}"

    def add_candidate(
        self, code: str, *, parent: str | None, hypothesis: str, iteration: int, cycle: int,
        candidate_id: str | None = None,
    ) -> str:
        """Store a new candidate (status "proposed") and return its id: "c001", "c002"... unless
        `candidate_id` is given ("h0" for the seed harness, say)."""
        self._writable()
        if not isinstance(code, str):
            raise ArchiveError(f"candidate code must be text, got {type(code).__name__}")
        if parent is not None and parent not in self:
            raise ArchiveError(f"archive {self.root}: parent {parent!r} does not exist")
        cid = candidate_id if candidate_id is not None else self._next_id()
        if not _ID_RE.match(cid):
            raise ArchiveError(f"candidate id {cid!r}: use letters, digits, '_' and '-' (at most 64)")
        final = self.root / cid
        if final.exists():
            raise ArchiveError(f"archive {self.root}: candidate {cid!r} already exists")
        parent_code = self.get(parent).code if parent is not None else None
        meta = {
            "id": cid, "parent": parent, "iteration": int(iteration), "cycle": int(cycle),
            "hypothesis": hypothesis, "status": "proposed", "reason": "", "weight_version": None,
            "created": _now(), "seq": len(self),
        }
        diff = "" if parent_code is None else harness_diff(parent_code, code, f"{parent}/harness.py", f"{cid}/harness.py")
        tmp = self.root / f".tmp-{cid}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            write_file(tmp / "harness.py", code)
            write_file(tmp / "diff.patch", diff)
            write_file(tmp / "meta.json", _dumps(meta))
            fsync_dir(tmp)
            os.rename(tmp, final)  # atomic: the folder appears complete or not at all
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        fsync_dir(self.root)
        return cid

    def add_reevaluation(self, candidate_id: str, *, weight_version: int, cycle: int, iteration: int = 1) -> str:
        """A new entry with the code of `candidate_id` (its parent), to be scored under `weight_version`:
        scores are tied to the weights they were measured under, so the incoming harness of a harness
        phase is evaluated again as that phase's iteration 1."""
        old = self.get(candidate_id)
        return self.add_candidate(
            old.code, parent=candidate_id, iteration=iteration, cycle=cycle,
            hypothesis=f"re-evaluate incoming harness under weights v{weight_version}",
        )

    def mark_invalid(self, candidate_id: str, reason: str) -> None:
        """Record that a proposed candidate failed validation (static check or sandbox smoke test)."""
        self._writable()
        c = self.get(candidate_id)
        if c.status == "evaluated":
            raise ArchiveError(f"candidate {candidate_id!r} is already evaluated; it cannot become invalid")
        meta = {**c.meta, "status": "invalid", "reason": str(reason), "invalid_at": _now()}
        atomic_write_text(c.path / "meta.json", _dumps(meta))
        self.rebuild_index()

    def record_evaluation(
        self, candidate_id: str, rows: list[dict[str, Any]], traces: list[str | dict[str, Any]],
        weight_version: int,
    ) -> dict[str, Any]:
        """Store one evaluation of a proposed candidate: per-episode `rows` ({task_id, reward, turns,
        prompt_tokens, status}, optionally truncated and more) and one trace per row (the JSON text
        of records.Rollout.trace, or the dict). Returns the scores written to scores.json."""
        self._writable()
        c = self.get(candidate_id)
        if c.status != "proposed":
            raise ArchiveError(
                f"candidate {candidate_id!r} is {c.status}; only a proposed candidate can be evaluated "
                "(to score it under new weights, add a new candidate with this one as parent)"
            )
        if isinstance(weight_version, bool) or not isinstance(weight_version, int):
            raise ArchiveError(f"weight_version must be an int, got {weight_version!r}")
        if not rows:
            raise ArchiveError(f"evaluation of {candidate_id!r}: no rows")
        if len(traces) != len(rows):
            raise ArchiveError(
                f"evaluation of {candidate_id!r}: {len(rows)} rows but {len(traces)} traces (one trace per episode)"
            )
        trace_lines, trace_dicts = [], []
        for i, t in enumerate(traces):
            try:
                d = json.loads(t) if isinstance(t, str) else t
            except json.JSONDecodeError as e:
                raise ArchiveError(f"evaluation of {candidate_id!r}: trace {i} is not valid JSON ({e})") from None
            if not isinstance(d, dict):
                raise ArchiveError(f"evaluation of {candidate_id!r}: trace {i} is not a JSON object")
            trace_dicts.append(d)
            trace_lines.append(json.dumps(d, ensure_ascii=False))
        clean = [_clean_row(candidate_id, i, r, trace_dicts[i]) for i, r in enumerate(rows)]
        scores = {"id": candidate_id, "weight_version": weight_version, **aggregate(clean), "rows": clean}
        atomic_write_text(c.path / "traces.jsonl", "".join(line + "\n" for line in trace_lines))
        atomic_write_text(c.path / "scores.json", _dumps(scores))  # the commit point
        meta = {**c.meta, "status": "evaluated", "weight_version": weight_version, "evaluated_at": _now()}
        atomic_write_text(c.path / "meta.json", _dumps(meta))
        self.rebuild_index()
        return scores

    def rebuild_index(self) -> None:
        """Rewrite summary.jsonl and frontier.json from the candidate folders."""
        self._writable()
        cands = self.candidates()
        lines = []
        for c in cands:
            if c.status == "proposed":
                continue
            line = {k: c.meta.get(k) for k in ("parent", "iteration", "cycle", "status", "reason",
                                                "weight_version", "hypothesis")}
            line["id"] = c.id
            if c.scores is not None:
                for k in ("n", "success_rate", "mean_turns", "mean_prompt_tokens", "truncation_rate"):
                    line[k] = c.scores.get(k)
            lines.append(json.dumps(line, sort_keys=True, ensure_ascii=False))
        atomic_write_text(self.root / "summary.jsonl", "".join(x + "\n" for x in lines))
        front = selection.frontier(cands)

        def entry(c: Candidate) -> dict[str, Any]:
            return {"id": c.id, "weight_version": c.weight_version, "success_rate": c.success_rate,
                    "mean_turns": c.mean_turns, "mean_prompt_tokens": c.mean_prompt_tokens}

        by_version = {}
        for v in sorted({c.weight_version for c in selection.evaluated(cands) if c.weight_version is not None}):
            f = selection.frontier(cands, v)
            by_version[str(v)] = {"best": f[0].id, "frontier": [entry(c) for c in f]}
        frontier = {
            "objectives": {o.name: o.goal for o in selection.OBJECTIVES},
            "best": front[0].id if front else None,
            "frontier": [entry(c) for c in front],
            "by_weight_version": by_version,
        }
        atomic_write_text(self.root / "frontier.json", _dumps(frontier))


# ---------------------------------------------------------------------------------------- helpers


_REQUIRED_ROW_KEYS = ("task_id", "reward", "turns", "prompt_tokens", "status")


def _clean_row(cid: str, i: int, row: dict[str, Any], trace: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(row, dict):
        raise ArchiveError(f"evaluation of {cid!r}: row {i} is not a dict")
    missing = [k for k in _REQUIRED_ROW_KEYS if k not in row]
    if missing:
        raise ArchiveError(f"evaluation of {cid!r}: row {i} lacks {', '.join(missing)}")
    if row.get("phase") == "test":
        raise ArchiveError(f"evaluation of {cid!r}: row {i} is from D_test; the archive never holds test data")
    if row["status"] not in STATUSES:
        raise ArchiveError(f"evaluation of {cid!r}: row {i} has unknown status {row['status']!r}; expected one of {STATUSES}")
    out = dict(row)
    try:
        out["reward"] = float(row["reward"])
        out["turns"] = int(row["turns"])
        out["prompt_tokens"] = int(row["prompt_tokens"])
    except (TypeError, ValueError):
        raise ArchiveError(f"evaluation of {cid!r}: row {i}: reward, turns and prompt_tokens must be numbers") from None
    out["task_id"] = str(row["task_id"])
    if "truncated" not in out:
        out["truncated"] = any(
            isinstance(e, dict) and e.get("type") == "turn_budget_exhausted" for e in trace.get("events") or []
        )
    out["truncated"] = bool(out["truncated"])
    try:
        json.dumps(out)
    except (TypeError, ValueError):
        raise ArchiveError(f"evaluation of {cid!r}: row {i} is not JSON-serialisable") from None
    return out


def aggregate(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The aggregates stored in scores.json beside the rows."""
    n = len(rows)
    rewards = [r["reward"] for r in rows]
    status_counts: dict[str, int] = {}
    for r in rows:
        status_counts[r["status"]] = status_counts.get(r["status"], 0) + 1
    return {
        "n": n,
        "n_tasks": len({r["task_id"] for r in rows}),
        "success_rate": _mean(rewards),
        "mean_turns": _mean([r["turns"] for r in rows]),
        "mean_prompt_tokens": _mean([r["prompt_tokens"] for r in rows]),
        "truncation_rate": _mean([1.0 if r["truncated"] else 0.0 for r in rows]),
        "status_counts": dict(sorted(status_counts.items())),
    }
