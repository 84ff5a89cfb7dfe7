"""The hop between a replica and the endpoint's engine actor (`serve.preset: gpu`): one stream socket, in batches.

Each replica's `Channel` asks the `EngineActor` once, through Ray, where to connect (`EngineActor.link`: a Unix
socket for a replica on the actor's node, TCP on the node's address otherwise) and with which key, then talks to
the actor's `Link` over that socket alone. Why not Ray calls: a Ray actor call costs each side far more Python
than a frame over a local socket (docs/performance.md), and the engine actor's Python runs under the GIL its
sampling thread needs between forward passes (vLLM's front end talks to its engine core process over sockets for
the same reasons).

Frames are a 4-byte length and a pickle. The requests that arrive within one turn of the replica's event loop go
in one frame (SUBMIT, model, [(request id, request, stream?)]); requests the client gave up on in another
(CANCEL, [ids]). Back comes, in one frame, everything that happened since the last: events (TOKEN, request id,
token, weight version), (DONE, id, GenerationOutput), (FAILED, id, error). A request's tokens are put before its
DONE (the engine's thread calls `on_token` before it resolves the request's future, whose completion reaches the
actor's loop after that), and one reader takes them in order, so a stream sees every token before its end.

The connection's first bytes are the key, checked before anything is unpickled: on TCP, anything on the network
can connect. A closed connection fails the replica's requests in flight with `EngineLost` (the next request connects
afresh) and cancels them in the engine (nobody waits for them any more). An engine actor that died is restarted by
Ray (whale_ray/serve/engines.py); the next connection waits for it, asking it where to connect until it is up.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import hmac
import itertools
import logging
import os
import pickle
import secrets
import shutil
import struct
import tempfile
import time
from typing import Any, Callable, Optional

from whale_ray.policy.engine import GenerationOutput, GenerationRequest

log = logging.getLogger(__name__)
TOKEN, DONE, FAILED = 0, 1, 2
SUBMIT, CANCEL = 0, 1
KEY_BYTES = 32
MAX_FRAME = 1 << 30  # bytes; a longer length prefix is a broken peer, not a batch
_LENGTH = struct.Struct(">I")
RESTART_S = 600.0  # how long a connection waits for an engine actor that Ray is restarting (vLLM: under a minute)


class EngineLost(ConnectionError):
    """The link to the engine actor broke with the request in flight (the actor died; Ray restarts it)."""


def portable(error: BaseException) -> Exception:
    """An error that pickles and that the replica maps as it would the engine's own: a ValueError (a request the
    engine refuses: 400) keeps its type and message, anything else becomes a RuntimeError naming its type."""
    if isinstance(error, ValueError):
        return ValueError(str(error))
    return RuntimeError(f"{type(error).__name__}: {error}")


def _frame(obj: Any) -> bytes:
    body = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return _LENGTH.pack(len(body)) + body


async def _read_frame(reader: asyncio.StreamReader) -> Any:
    (n,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    if n > MAX_FRAME:
        raise ConnectionError(f"the engine link sent a frame of {n} bytes (at most {MAX_FRAME}): closed")
    return pickle.loads(await reader.readexactly(n))


def _is(message: Any, kind: int, size: int) -> bool:
    return isinstance(message, tuple) and len(message) == size and message[0] == kind


class Outbox:
    """One connection's events: put from any thread (the engine's, for tokens), taken in batches by the one task
    that sends them. The loop is woken once per batch, not once per event."""

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


class Link:
    """The engine actor's end: listens, starts what each connection submits on `services` (by model name), and sends
    back what became of it."""

    def __init__(self, services: dict[str, Any]):
        self.services = services
        self.key = secrets.token_bytes(KEY_BYTES)
        self.tasks: dict[tuple[int, int], asyncio.Task] = {}  # in flight, by (connection, the replica's id)
        self.submits = 0  # frames that brought requests (fewer than the requests: they come in batches)
        # the requests answered, and their seconds here, from their frame to their answer's (the engine's, and
        # this loop's around it)
        self.timing = {"answered": 0, "actor_s": 0.0}
        self.connections = itertools.count()

    async def address(self, local: bool) -> tuple:
        """A listener for one connection: ("unix", path, key) for a replica on this node, ("tcp", host, port, key)
        for one elsewhere. It closes once a connection brings the key, and a Unix socket's file goes with it (a
        filesystem path: uvloop, which Serve's loop may be, takes no abstract names). No connection brings the key
        before this returns it, so `server` is bound by the time `keyed` runs."""
        if local:  # in a directory of its own, mode 0700: only this user reaches it
            where = tempfile.mkdtemp(prefix="whale-engine-")
            path = os.path.join(where, "link")

            def keyed() -> None:
                server.close()
                shutil.rmtree(where, ignore_errors=True)
            server = await asyncio.start_unix_server(lambda r, w: self._serve(r, w, keyed), path)
            return "unix", path, self.key
        import ray

        host = ray.util.get_node_ip_address()
        server = await asyncio.start_server(lambda r, w: self._serve(r, w, server.close), host, 0)
        return "tcp", host, server.sockets[0].getsockname()[1], self.key

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     keyed: Callable[[], None]) -> None:
        conn, box = next(self.connections), Outbox(asyncio.get_running_loop())
        sending: Optional[asyncio.Task] = None
        try:
            if not hmac.compare_digest(await reader.readexactly(KEY_BYTES), self.key):
                log.warning("engine link: a connection without the key, closed")
                return
            keyed()
            sending = asyncio.ensure_future(self._send(box, writer))
            while True:
                message = await _read_frame(reader)
                if _is(message, SUBMIT, 3) and message[1] in self.services and isinstance(message[2], list):
                    self._submit(conn, box, *message[1:])
                elif _is(message, CANCEL, 2) and isinstance(message[1], list):
                    for rid in message[1]:
                        task = self.tasks.get((conn, rid))
                        if task is not None:
                            task.cancel()
                else:
                    raise ValueError(f"a frame that is neither (SUBMIT, a served model, [...]) nor (CANCEL, [...]): "
                                     f"{type(message).__name__} {str(message)[:80]}")
        except asyncio.IncompleteReadError:  # the replica went away
            pass
        except Exception as e:  # noqa: BLE001 - a frame that is not the protocol's: this connection ends, not the actor
            log.warning("engine link: connection %d closed: %s: %s", conn, type(e).__name__, e)
        finally:
            if sending is not None:
                sending.cancel()
            for (c, _), task in list(self.tasks.items()):
                if c == conn:
                    task.cancel()
            writer.close()

    def _submit(self, conn: int, box: Outbox, name: str, batch: list[tuple[int, GenerationRequest, bool]]) -> None:
        service, now = self.services[name], time.perf_counter()
        self.submits += 1
        for rid, request, stream in batch:
            if stream:
                request.on_token = lambda t, v, rid=rid: box.put((TOKEN, rid, t, v))
            task = asyncio.ensure_future(service.complete(request))
            self.tasks[conn, rid] = task
            task.add_done_callback(lambda t, rid=rid: self._finished(conn, box, rid, t, now))

    def _finished(self, conn: int, box: Outbox, rid: int, task: asyncio.Task, arrived: float) -> None:
        self.tasks.pop((conn, rid), None)
        if task.cancelled():  # by the replica, or its connection closed: nobody waits for it
            return
        error = task.exception()
        self.timing["answered"] += 1
        self.timing["actor_s"] += time.perf_counter() - arrived
        box.put((DONE, rid, task.result()) if error is None else (FAILED, rid, portable(error)))

    @staticmethod
    async def _send(box: Outbox, writer: asyncio.StreamWriter) -> None:
        while True:
            writer.write(_frame(await box.take()))
            await writer.drain()


@dataclasses.dataclass
class _Waiting:
    future: asyncio.Future
    on_token: Optional[Callable[[int, int], None]]
    start: float


class Channel:
    """The replica's end: `complete(model, request)` for any number of concurrent callers (see the module docstring).
    `node_id`: the replica's node (default this process's), which decides between a Unix socket and TCP."""

    def __init__(self, actor: Any, node_id: Optional[str] = None):
        self.actor = actor
        self.node_id = node_id
        self.ids = itertools.count()
        self.waiting: dict[int, _Waiting] = {}
        self.outgoing: dict[str, list[tuple[int, GenerationRequest, bool]]] = {}
        self.cancelled: list[int] = []
        self.reader: Optional[asyncio.Task] = None  # connects, then reads; None: the next request connects afresh
        self.writer: Optional[asyncio.StreamWriter] = None  # None until connected
        self.flushing = False
        self.dead: Optional[str] = None  # why the actor is gone for good (Ray will not restart it), once it is
        # the requests answered, and their seconds from reaching this channel to their answer read off the socket
        self.timing = {"round_trips": 0, "round_trip_s": 0.0}

    async def complete(self, model: str, request: GenerationRequest) -> GenerationOutput:
        loop = asyncio.get_running_loop()
        if self.reader is None:
            self.reader = loop.create_task(self._read())
        rid = next(self.ids)
        future = loop.create_future()
        self.waiting[rid] = _Waiting(future, request.on_token, time.perf_counter())
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
        if not self.flushing:  # what arrives before this turn of the loop ends goes in the same frame
            self.flushing = True
            loop.call_soon(self._flush)

    def _flush(self) -> None:
        self.flushing = False
        if self.writer is None:  # still connecting: the reader flushes once it is
            return
        outgoing, self.outgoing = self.outgoing, {}
        for model, batch in outgoing.items():
            self.writer.write(_frame((SUBMIT, model, batch)))
        if self.cancelled:
            self.writer.write(_frame((CANCEL, self.cancelled)))
            self.cancelled = []

    async def _connect(self) -> asyncio.StreamReader:
        import ray

        here = self.node_id or ray.get_runtime_context().get_node_id()
        deadline = time.monotonic() + RESTART_S
        while True:
            try:
                kind, *where, key = await self.actor.link.remote(here)
                break
            except ray.exceptions.ActorUnavailableError:  # restarting: asked again once it may be up
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)
            except ray.exceptions.ActorDiedError as e:
                self.dead = str(e).splitlines()[0]
                raise
        if kind == "unix":
            reader, writer = await asyncio.open_unix_connection(*where)
        else:
            reader, writer = await asyncio.open_connection(*where)
        writer.write(key)
        self.writer = writer
        self._flush()
        return reader

    async def _read(self) -> None:
        try:
            reader = await self._connect()
            while True:
                for event in await _read_frame(reader):
                    w = self.waiting.get(event[1])
                    if w is None:  # cancelled meanwhile
                        continue
                    if event[0] == TOKEN:
                        if w.on_token is not None:
                            w.on_token(event[2], event[3])
                        continue
                    del self.waiting[event[1]]
                    self.timing["round_trips"] += 1
                    self.timing["round_trip_s"] += time.perf_counter() - w.start
                    if not w.future.done():
                        if event[0] == DONE:
                            w.future.set_result(event[2])
                        else:
                            w.future.set_exception(event[2])
        except Exception as e:  # noqa: BLE001 - every request in flight fails; the next one connects afresh
            cause = getattr(e, "cause", None)  # a RayTaskError (the link call): the actor's own error
            if isinstance(e, asyncio.IncompleteReadError):
                e = ConnectionError("the link closed")
            log.error("the link to the engine actor broke: %s", e)
            if self.writer is not None:
                self.writer.close()
            self.reader, self.writer, self.outgoing, self.cancelled = None, None, {}, []
            error = cause if isinstance(cause, Exception) else EngineLost(f"the engine actor failed: {e}")
            for rid in list(self.waiting):
                w = self.waiting.pop(rid)
                if not w.future.done():
                    w.future.set_exception(error)
