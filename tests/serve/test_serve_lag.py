"""whale_ray/serve/lag.py: a loop kept from its timers shows it as lateness, an idle one does not."""

import asyncio
import time

from whale_ray.serve.lag import LoopLag


def test_a_blocked_loop_shows_as_lateness():
    async def main() -> tuple[dict, dict]:
        lag = LoopLag(interval_s=0.01)
        lag.start()
        lag.start()  # once: a second call starts no second timer
        await asyncio.sleep(0.1)
        idle = lag.stats()
        time.sleep(0.15)  # the loop's thread busy: nothing ready on the loop runs meanwhile
        await asyncio.sleep(0.05)
        return idle, lag.stats()

    idle, blocked = asyncio.run(main())
    assert 5 <= idle["lag_ticks"] <= 11, idle  # one every 10 ms, no more
    assert idle["lag_worst_s"] < 0.05, idle
    assert blocked["lag_worst_s"] >= 0.13, blocked  # the timer due during the block ran ~0.15 s late
    assert blocked["lag_s"] - idle["lag_s"] >= 0.13 and blocked["lag_ticks"] > idle["lag_ticks"], (idle, blocked)


def test_since_counts_only_the_span():
    async def main() -> dict:
        lag = LoopLag(interval_s=0.01)
        lag.start()
        await asyncio.sleep(0.05)
        before = lag.stats()
        time.sleep(0.1)
        await asyncio.sleep(0.03)
        return lag.since(before)

    span = asyncio.run(main())
    assert 1 <= span["lag_ticks"] <= 4 and span["lag_s"] >= 0.08, span
