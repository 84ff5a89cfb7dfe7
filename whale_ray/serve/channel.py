"""The hop between a replica and its engine actor (`serve.engine_layout: actor`), in batches rather than per request.

A Ray actor call costs both processes some hundred microseconds of Python, under each one's GIL: the engine
actor's GIL is the one its sampling thread needs between forward passes. So the replica's `Channel` sends the
requests that arrived within one turn of its event loop in one `EngineActor.submit` call, and the actor sends
back, through one long-lived streaming call (`EngineActor.events`), everything that happened since its last send:
the tokens sampled for streams, the outputs of requests that finished, their errors. One actor call per batch of
arrivals and one streamed object per batch of events, whatever the number of requests in flight (vLLM's
front end talks to its engine core process the same way, for the same reason).

Events are tuples: (TOKEN, request id, token, weight version), (DONE, id, GenerationOutput), (FAILED, id, error).
A request's tokens are put before its DONE (the engine's thread calls `on_token` before it resolves the request's
future, whose completion reaches the actor's loop after that), and one reader takes them in order, so a stream
sees every token before its end.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
from typing import Any, Callable, Optional

from whale_ray.policy.engine import GenerationOutput, GenerationRequest

log = logging.getLogger(__name__)
TOKEN, DONE, FAILED = 0, 1, 2


def portable(error: BaseException) -> Exception:
    """An error that pickles and that the replica maps as it would the engine's own: a ValueError (a request the
    engine refuses: 400) keeps its type and message, anything else becomes a RuntimeError naming its type."""
    if isinstance(error, ValueError):
        return ValueError(str(error))
    return RuntimeError(f"{type(error).__name__}: {error}")


class Outbox:
    """The actor's events for its replica: put from any thread (the engine's, for tokens), taken in batches by one
    reader on the actor's loop. The loop is woken once per batch, not once per event."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.items: collections.deque = collections.deque()
        self.ready = asyncio.Event()
        self.signalled = False

    def put(self, event: tuple) -> None:
        self.items.append(event)
        if not self.signalled:  # the reader clears this before it drains, so an event put later signals again
            self.signalled = True
            self.loop.call_soon_threadsafe(self.ready.set)

    async def take(self) -> list[tuple]:
        while True:
            await self.ready.wait()
            self.ready.clear()
            self.signalled = False
            got = [self.items.popleft() for _ in range(len(self.items))]
            if got:
                return got


@dataclasses.dataclass
class _Waiting:
    future: asyncio.Future
    on_token: Optional[Callable[[int, int], None]]


class Channel:
    """The replica's end: `complete(model, request)` for any number of concurrent callers (see the module docstring)."""

    def __init__(self, actor: Any):
        self.actor = actor
        self.ids = itertools.count()
        self.waiting: dict[int, _Waiting] = {}
        self.outgoing: dict[str, list[tuple[int, GenerationRequest, bool]]] = {}
        self.cancelled: list[int] = []
        self.reader: Optional[asyncio.Task] = None
        self.flushing = False

    async def complete(self, model: str, request: GenerationRequest) -> GenerationOutput:
        loop = asyncio.get_running_loop()
        if self.reader is None:
            self.reader = loop.create_task(self._read())
        rid = next(self.ids)
        future = loop.create_future()
        self.waiting[rid] = _Waiting(future, request.on_token)
        plain = dataclasses.replace(request, on_token=None)  # a callback into this process does not travel
        self.outgoing.setdefault(model, []).append((rid, plain, request.on_token is not None))
        self._schedule(loop)
        try:
            return await future
        except asyncio.CancelledError:  # the client went away: the engine's row is freed too
            if self.waiting.pop(rid, None) is not None:
                self.cancelled.append(rid)
                self._schedule(loop)
            raise

    def _schedule(self, loop: asyncio.AbstractEventLoop) -> None:
        if not self.flushing:  # what arrives before this turn of the loop ends goes in the same call
            self.flushing = True
            loop.call_soon(self._flush)

    def _flush(self) -> None:
        self.flushing = False
        outgoing, self.outgoing = self.outgoing, {}
        for model, batch in outgoing.items():
            asyncio.ensure_future(self._send(self.actor.submit.remote(model, batch), [rid for rid, _, _ in batch]))
        if self.cancelled:
            rids, self.cancelled = self.cancelled, []
            self.actor.cancel.remote(rids)

    async def _send(self, ref: Any, rids: list[int]) -> None:
        try:
            await ref
        except Exception as e:  # noqa: BLE001 - the actor is gone or refused the call: its callers hear why
            self._fail(rids, e)

    async def _read(self) -> None:
        try:
            async for ref in self.actor.events.remote():
                for event in await ref:
                    w = self.waiting.get(event[1])
                    if w is None:  # cancelled meanwhile
                        continue
                    if event[0] == TOKEN:
                        if w.on_token is not None:
                            w.on_token(event[2], event[3])
                        continue
                    del self.waiting[event[1]]
                    if not w.future.done():
                        if event[0] == DONE:
                            w.future.set_result(event[2])
                        else:
                            w.future.set_exception(event[2])
            raise RuntimeError("the engine actor's event stream ended")
        except Exception as e:  # noqa: BLE001 - every request in flight fails; the next one reads afresh
            log.error("the replica's engine actor failed: %s", e)
            self.reader = None
            self._fail(list(self.waiting), e)

    def _fail(self, rids: list[int], error: Exception) -> None:
        cause = getattr(error, "cause", None)  # a RayTaskError: the actor's own error, not Ray's wrapper
        error = cause if isinstance(cause, Exception) else RuntimeError(f"the replica's engine actor failed: {error}")
        for rid in rids:
            w = self.waiting.pop(rid, None)
            if w is not None and not w.future.done():
                w.future.set_exception(error)
