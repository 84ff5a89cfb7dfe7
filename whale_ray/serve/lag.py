"""How late an event loop runs what is ready: the wait a request's next step has on that loop, beyond its own work.

A timer set for every `interval_s` records how much later than asked it ran: a loop that is busy (or whose thread
waits for the GIL another thread of its process holds, as the engine actor's loop does beside the engine's
sampling thread) runs it late by about as long as anything else ready there waits. The replica's and the engine
actor's loops each keep one; GET /health shows them.
"""

from __future__ import annotations

import asyncio
import time
from typing import Optional

INTERVAL_S = 0.02  # a sample every few engine steps, seldom enough not to keep waking the engine actor's loop


class LoopLag:
    def __init__(self, interval_s: float = INTERVAL_S):
        self.interval_s = interval_s
        self.ticks, self.late_s, self.worst_s = 0, 0.0, 0.0
        self._task: Optional[asyncio.Task] = None

    def start(self) -> None:
        """Starts measuring on the running loop (once; later calls do nothing)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            asked = time.perf_counter() + self.interval_s
            await asyncio.sleep(self.interval_s)
            late = max(0.0, time.perf_counter() - asked)
            self.ticks += 1
            self.late_s += late
            self.worst_s = max(self.worst_s, late)

    def stats(self) -> dict[str, float]:
        """Counters (a reader takes differences over a span): timer runs, their summed and largest lateness."""
        return {"lag_ticks": self.ticks, "lag_s": round(self.late_s, 6), "lag_worst_s": round(self.worst_s, 6)}

    def since(self, before: dict[str, float]) -> dict[str, float]:
        """The timer runs and their summed lateness since `before` (an earlier `stats()`)."""
        now = self.stats()
        return {k: now[k] - before[k] for k in ("lag_ticks", "lag_s")}
