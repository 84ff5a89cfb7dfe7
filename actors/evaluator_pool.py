"""EvaluatorPool: a phase's episodes handed out from one queue, in small chunks, to SandboxEvaluators.

    queue of chunks ──► every ready evaluator keeps at most `slots + chunk` episodes in flight, and is
                        handed the next chunk as one of its own finishes: a faster one takes more work
    a chunk lost with its evaluator or node ──► its episodes go back to the front of the queue with the same
                        seeds, and are counted once; a loss while the node stayed up (the episode may
                        have killed its evaluator) is charged to the episode, at most
                        `sandbox.episode_retries` times; a loss with its node is not (nodes may keep leaving)
    every `faults.poll_s` ──► a fixed pool replaces lost evaluators; an elastic one (`evaluators: auto` or
                        {min, max}) adds evaluators on every node with free resources, new nodes included;
                        and `on_poll` runs (the Coordinator's: the weight sync brings a PolicyServer
                        restarted by Ray to the weights on record, actors/weight_sync.py)
    several PolicyServer replicas (policy.replicas) ──► every evaluator is given them all and sends each model
                        call to the one it has the fewest calls waiting on (actors/sandbox_evaluator.py)

Every episode result names the node it ran on. Events (evaluators lost and added, nodes joining and
leaving, episodes redone) go to the run's EventLog.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import ray
from ray.exceptions import ActorUnavailableError, RayActorError

from actors.sandbox_evaluator import SandboxEvaluator
from whale_ray.config import CORES_PER_EVALUATOR, SandboxConfig
from whale_ray.events import EventLog
from whale_ray.records import EpisodeResult
from whale_ray.resources import Placement, RoleResources

log = logging.getLogger(__name__)

LOST = (RayActorError, ActorUnavailableError)  # the evaluator (or its node) is gone: its chunk is redone


@dataclass
class _Member:
    handle: "ray.actor.ActorHandle"
    ready_ref: Any  # the actor's first reply (its node id); None once it came
    node: str | None = None  # where it runs, once ready
    target: str | None = None  # the node it was pinned to, if any
    inflight: int = 0
    lost: bool = False


@dataclass
class _Chunk:
    item: int
    jobs: list[int]  # indices into the item's jobs
    avoid: frozenset = frozenset()  # nodes it was lost on: a redone chunk goes elsewhere while it can


@dataclass
class _Phase:
    """One `run` call's bookkeeping."""

    work: list[Any]
    results: list[list[EpisodeResult | None]]
    queue: deque = field(default_factory=deque)
    inflight: dict = field(default_factory=dict)  # ref -> (member, chunk)
    tries: dict = field(default_factory=dict)  # (item, job) -> times lost
    left: int = 0


def free_resources() -> dict[str, dict[str, float]]:
    """node id -> its resources not held by any actor or task now. Ray has no public call for this per node
    (ray.available_resources() is the cluster's sum); this reads the GCS's table, as `ray status` does."""
    from ray._private import state

    return state.available_resources_per_node()


class EvaluatorPool:
    def __init__(self, domain: str, policy: "ray.actor.ActorHandle | list[ray.actor.ActorHandle]",
                 sandbox: SandboxConfig, services: dict[str, Any] | None = None, *,
                 resources: RoleResources | None = None, placement: Placement | None = None, events: EventLog | None = None,
                 reserve: dict[str, float] | None = None, poll_s: float = 1.0, nodes: set[str] | None = None,
                 on_poll: Callable[[], None] | None = None):
        """`policy`: the PolicyServer, or its replicas; `services`: the domain's shared trusted services, given
        to every evaluator; `resources`: one evaluator's (config resources.evaluator); `reserve`: resources an
        elastic pool leaves free for the run's other roles when it grows (the Trainer's workers, which come and
        go between phases); `nodes`: the cluster as an earlier pool of the run last saw it (`known_nodes`), so
        the nodes that joined or left while the run rolled back are reported too; `on_poll`: called at every poll
        while episodes run."""
        self._args = (domain, policy, sandbox, dict(services or {}))
        self._resources = resources or RoleResources(num_cpus=0.25)
        self._placement = placement or Placement()
        self._events = events
        self._reserve = dict(reserve or {})
        self._poll_s = poll_s
        self._on_poll = on_poll
        self._retries = sandbox.episode_retries
        cpus = ray.cluster_resources().get("CPU", 0.0)
        self.min, self.max, self.elastic = sandbox.pool_bounds(cpus)
        if sandbox.evaluators == "cores":
            log.info("%d evaluator(s) x %d slots: one per %d of the cluster's %g CPUs (sandbox.evaluators: cores)",
                     self.min, sandbox.slots, CORES_PER_EVALUATOR, cpus)
        if self.elastic and not self._placement.pins_nodes:
            self.max = self.min  # a placement group's bundles are fixed: an elastic pool cannot grow there
        self._chunk = sandbox.chunk or max(1, sandbox.slots // 4)
        self._depth = sandbox.slots + self._chunk
        self._members: list[_Member] = []
        self._nodes: set[str] | None = set(nodes) if nodes is not None else None
        for _ in range(self.min):
            self._spawn()

    # ------------------------------------------------------------------------------ members
    def _spawn(self, node: str | None = None) -> _Member:
        opts = (self._placement.on_node("evaluator", self._resources, node) if node
                else self._placement.options("evaluator", self._resources))
        handle = SandboxEvaluator.options(**opts, max_restarts=0).remote(*self._args)
        member = _Member(handle, handle.ready.remote(), target=node)
        self._members.append(member)
        return member

    def _lose(self, member: _Member, why: str) -> None:
        if member.lost:
            return
        member.lost = True
        self._members.remove(member)
        ray.kill(member.handle)
        self._emit("evaluator_lost", f"an evaluator on node {_short(member.node or member.target)} is gone ({why}); "
                   f"{len(self._members)} left", node=member.node)

    @property
    def size(self) -> int:
        """Evaluators alive or starting."""
        return len(self._members)

    @property
    def actors(self) -> list["ray.actor.ActorHandle"]:
        return [m.handle for m in self._members]

    @property
    def known_nodes(self) -> set[str] | None:
        """The alive nodes at the last look at the cluster (None before the first)."""
        return None if self._nodes is None else set(self._nodes)

    def nodes(self) -> dict[str, int]:
        """node id -> ready evaluators on it."""
        out: dict[str, int] = {}
        for m in self._members:
            if m.node is not None:
                out[m.node] = out.get(m.node, 0) + 1
        return out

    # ---------------------------------------------------------------------------------- work
    def run(self, work: list[Any], on_done: Callable[[int], None]) -> list[list[EpisodeResult]]:
        """Every job of every `whale_ray.loop.EpisodeWork` item, in order; `on_done(n)` per finished chunk."""
        ph = _Phase(work, [[None] * len(w.jobs) for w in work])
        for i, w in enumerate(work):
            for start in range(0, len(w.jobs), self._chunk):
                ph.queue.append(_Chunk(i, list(range(start, min(start + self._chunk, len(w.jobs))))))
        ph.left = sum(len(w.jobs) for w in work)
        next_poll = 0.0
        while ph.left:
            if time.monotonic() >= next_poll:
                self._follow_cluster()
                if self._on_poll is not None:
                    self._on_poll()
                next_poll = time.monotonic() + self._poll_s
            self._dispatch(ph)
            waiting = list(ph.inflight) + [m.ready_ref for m in self._members if m.ready_ref is not None]
            if not waiting:  # no evaluator alive or starting: the next poll starts some
                time.sleep(self._poll_s)
                continue
            done, _ = ray.wait(waiting, num_returns=1, timeout=self._poll_s)
            for ref in done:
                if ref in ph.inflight:
                    self._finish(ph, ref, on_done)
                else:
                    self._became_ready(ref)
        return ph.results  # type: ignore[return-value]

    def _dispatch(self, ph: _Phase) -> None:
        ready = [m for m in self._members if m.ready_ref is None]
        while ph.queue and ready:
            chunk = ph.queue[0]
            elsewhere = [m for m in ready if m.node not in chunk.avoid] or ready  # a dying node's peers die too
            member = min(elsewhere, key=lambda m: m.inflight)  # the least loaded first
            if member.inflight + len(chunk.jobs) > self._depth:
                return
            ph.queue.popleft()
            w = ph.work[chunk.item]
            ref = member.handle.run_episodes.remote(w.harness_source, w.harness_name, [w.jobs[j] for j in chunk.jobs])
            member.inflight += len(chunk.jobs)
            ph.inflight[ref] = (member, chunk)

    def _finish(self, ph: _Phase, ref: Any, on_done: Callable[[int], None]) -> None:
        member, chunk = ph.inflight.pop(ref)
        member.inflight -= len(chunk.jobs)
        try:
            episodes = ray.get(ref)
        except LOST as e:
            # Ray reports an actor lost with its node once the GCS has marked the node dead, so this read agrees
            # with the error; the node's fault is not the episode's.
            node_left = member.node is not None and member.node not in _alive_nodes()
            self._lose(member, type(e).__name__ + (" with its node" if node_left else ""))
            self._redo(ph, _Chunk(chunk.item, chunk.jobs, chunk.avoid | {member.node}), on_done, charge=not node_left)
            return
        for j, ep in zip(chunk.jobs, episodes):
            ph.results[chunk.item][j] = ep
        ph.left -= len(chunk.jobs)
        on_done(len(chunk.jobs))

    def _redo(self, ph: _Phase, chunk: _Chunk, on_done: Callable[[int], None], charge: bool) -> None:
        """The chunk's episodes go back to the front of the queue, same jobs and seeds; an episode `charge`d
        with more than `episode_retries` losses is recorded as a sandbox error instead (its count stays the
        planned one)."""
        again, given_up = [], []
        for j in chunk.jobs:
            key = (chunk.item, j)
            ph.tries[key] = ph.tries.get(key, 0) + int(charge)
            (again if ph.tries[key] <= self._retries else given_up).append(j)
        if again:
            ph.queue.appendleft(_Chunk(chunk.item, again, chunk.avoid))
            self._emit("episodes_redone", f"{len(again)} episode(s) lost with their evaluator go back to the queue",
                       episodes=len(again))
        for j in given_up:
            ph.results[chunk.item][j] = EpisodeResult(
                status="sandbox_error", answer=None, calls=[], events=[], wall_s=0.0,
                reason=f"the episode was lost with its evaluator {ph.tries[(chunk.item, j)]} times")
        if given_up:
            ph.left -= len(given_up)
            on_done(len(given_up))

    def _became_ready(self, ref: Any) -> None:
        member = next(m for m in self._members if m.ready_ref == ref)
        try:
            member.node = ray.get(ref)
        except LOST as e:
            self._lose(member, f"it never started: {type(e).__name__}")
            return
        member.ready_ref = None

    # ------------------------------------------------------------------------------ the cluster
    def _follow_cluster(self) -> None:
        alive = _alive_nodes()
        if self._nodes is not None:
            for node in sorted(alive - self._nodes):
                self._emit("node_joined", f"node {_short(node)} joined the cluster", node=node)
            for node in sorted(self._nodes - alive):
                self._emit("node_left", f"node {_short(node)} left the cluster", node=node)
                for m in [m for m in self._members if (m.node or m.target) == node]:
                    self._lose(m, "its node left")
        self._nodes = alive
        if self.elastic:
            self._grow(alive)
        added = 0
        while len(self._members) < self.min:  # replace what was lost
            self._spawn()
            added += 1
        if added:
            self._emit("evaluators_added", f"{added} evaluator(s) started to replace lost ones", count=added)

    def _grow(self, alive: set[str]) -> None:
        """Starts evaluators where the free resources (less the reserve) hold them, up to `max`."""
        if any(m.ready_ref is not None for m in self._members):
            return  # resources of an evaluator still starting are not counted as taken yet: wait for it
        bundle = self._resources.bundle()
        free = {n: r for n, r in free_resources().items() if n in alive}
        spare = {k: sum(r.get(k, 0.0) for r in free.values()) - self._reserve.get(k, 0.0) for k in bundle}
        added: dict[str, int] = {}
        for node, res in sorted(free.items(), key=lambda kv: -kv[1].get("CPU", 0.0)):
            fit = min(math.floor((min(res.get(k, 0.0), spare[k]) + 1e-9) / v) if v > 0 else 10**6
                      for k, v in bundle.items())
            for _ in range(min(fit, self.max - len(self._members))):
                self._spawn(node)
                added[node] = added.get(node, 0) + 1
                for k, v in bundle.items():
                    spare[k] -= v
        for node, n in added.items():
            self._emit("evaluators_added", f"{n} evaluator(s) started on node {_short(node)} (pool {len(self._members)})",
                       node=node, count=n)

    def _emit(self, kind: str, message: str, **data: Any) -> None:
        if self._events is not None:
            self._events.emit(kind, message, **data)
        else:
            log.info("%s: %s", kind, message)


def _alive_nodes() -> set[str]:
    return {n["NodeID"] for n in ray.nodes() if n.get("Alive")}


def _short(node: str | None) -> str:
    return (node or "?")[:8]
