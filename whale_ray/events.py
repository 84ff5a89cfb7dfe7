"""`<run_dir>/events.jsonl`: what happened to a run's actors and nodes, one JSON object per line.

Faults (an actor or a node lost, episodes redone), recoveries (an actor back, the run rolled back to its last
commit) and cluster changes (evaluators added or removed) are appended and flushed as they happen, from any
thread. The file is a log, not state: a relaunch appends to it and never drops it, and `whale status` shows
its last lines.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

EVENTS_FILE = "events.jsonl"
KEPT = 50  # recent events held in memory for the progress line


class EventLog:
    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / EVENTS_FILE
        self._lock = threading.Lock()
        self._recent: list[dict[str, Any]] = []
        self._count = 0

    def emit(self, kind: str, message: str, **data: Any) -> dict[str, Any]:
        """Appends one event: `kind` (actor_lost, actor_restarted, episodes_redone, rolled_back, node_joined,
        node_left, evaluators_added, ...), a sentence for people, and the facts as fields."""
        now = time.time()
        event = {"time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)), "ts": round(now, 3), "kind": kind,
                 "message": message, **data}
        line = json.dumps(event, default=str)
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a") as f:  # one write of one line: appends from threads do not interleave
                f.write(line + "\n")
            self._count += 1
            self._recent = (self._recent + [{**event, "seq": self._count}])[-KEPT:]
        log.warning("%s: %s", kind, message)
        return event

    def since(self, seq: int) -> list[dict[str, Any]]:
        """The recent events after sequence number `seq` (1-based, counted in this process)."""
        with self._lock:
            return [e for e in self._recent if e["seq"] > seq]


def read_events(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every event on record (lines that are not JSON objects are skipped)."""
    path = Path(run_dir) / EVENTS_FILE
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict):
            out.append(event)
    return out
