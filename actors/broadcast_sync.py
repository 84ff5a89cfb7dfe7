"""New weights by broadcast (`weight.weight_sync: broadcast`): the Trainer's rank 0 sends while every PolicyServer
replica receives, the two sides made to meet here.

Where it sits. `BroadcastSync` is the weight sync of this mode (actors/weight_sync.py has the interface the loop
calls, and the other modes): its `push(v)` is one `broadcast_weights` call on the Trainer actor (its rank-0 worker
sends) and one `receive_weights` call on every replica, all started at once. A server alone (restarted by Ray,
or woken from a level-2 sleep without weights) gets the weights through the object store, as `ObjectStoreSync`
sends them.

The group (whale_ray/policy/weight_broadcast.py): Trainer rank 0 is rank 0, replica i is rank i + 1. The
store's server lives in this object (in the Coordinator's process, on its node's address, `weight.broadcast.port`
or any free one): its address is known before any member starts, and it outlives them all. A generation of the
group is built once and serves every version until it no longer holds: before each broadcast every member
says which group it holds, by store address and generation (a Trainer whose Ray Train run was released or
restarted after a lost worker, or a PolicyServer restarted by Ray, hold none; a member that outlived an earlier
broadcaster holds one of that store), and any difference, or another set of replicas (one added or lost),
builds the next generation under a new store prefix (never an old one: its stale addresses would send members
to peers that are gone).

Faults, each bounded by `weight.broadcast.timeout_s`:
- a member that is dead for good (Ray gives up restarting it) when asked: `WeightBroadcastError` naming it, at
  once. The run's fault path takes it from there (the Coordinator rolls back to its last commit with fresh
  actors, as for any role lost for good).
- anything else (a member slow to answer, say restarting; a member lost during the broadcast; a collective that
  times out): every failed member is named in a `weight_broadcast_failed` event, that version reaches every
  replica through the object store instead (the Trainer's `host_weights`; a replica that is gone by then
  fails that load as a lost role), and the next version builds a new group.
The broadcast calls are never retried by Ray: a retried receive on a restarted replica would join a group its
peers have left.
"""

from __future__ import annotations

import logging
import time

import ray
import torch

from actors.weight_sync import ObjectStoreSync
from whale_ray.config import WeightBroadcastConfig
from whale_ray.events import EventLog
from whale_ray.policy.weight_broadcast import GroupSpec, WeightBroadcastError

log = logging.getLogger(__name__)


class BroadcastSync(ObjectStoreSync):
    """Sends each new version from the Trainer's rank 0 to the replicas (see the module docstring); `servers` may be
    replaced by another set of replicas (one added or lost): the next version builds a group of those."""

    def __init__(self, trainer: "ray.actor.ActorHandle", servers: list["ray.actor.ActorHandle"], *, version: int,
                 cfg: WeightBroadcastConfig, use_gpu: bool, sleeps: bool = False, events: EventLog | None = None):
        super().__init__(trainer, servers, version=version, sleeps=sleeps)
        self.cfg, self.events = cfg, events
        self.backend = "nccl" if use_gpu else "gloo"
        self.host = ray.util.get_node_ip_address()
        self._store = torch.distributed.TCPStore(self.host, cfg.port, is_master=True, wait_for_workers=False)
        self.port = self._store.port
        self.generation = 0  # of the last group built; 0: none yet
        self._members: list[str] = []  # the actor ids it was built for
        self.last: dict[str, object] = {}  # the last push: its version, seconds and how it went (broadcast or not)

    def _names(self) -> list[str]:
        return ["the Trainer's rank 0"] + [f"PolicyServer replica {i} (actor {h._actor_id.hex()[:12]})"
                                           for i, h in enumerate(self.servers)]

    def _push(self, version: int) -> None:
        """Weight `version` on every replica, by broadcast, else through the object store (module docstring)."""
        t0 = time.perf_counter()
        failures = self._broadcast(version)
        if not failures:
            self.last = {"version": version, "seconds": time.perf_counter() - t0, "by": "broadcast"}
            return
        self.generation += 1  # whatever held, the next version builds a new group
        message = (f"weight broadcast of version {version} failed ({'; '.join(failures)}); it goes to the replicas "
                   "through the object store, and the next version builds a new group")
        if self.events is not None:
            self.events.emit("weight_broadcast_failed", message, version=version, failures=failures)
        log.warning("%s", message)
        self._send(version, self.servers)
        self.last = {"version": version, "seconds": time.perf_counter() - t0, "by": "object_store"}

    def _broadcast(self, version: int) -> list[str]:
        """The broadcast of `version`; the failed members, named ([] when every replica has it)."""
        members = [self.trainer, *self.servers]
        names = self._names()
        held, failures = self._results([m.broadcast_group.remote() for m in members], names, self.cfg.timeout_s,
                                       dead_is_fatal=True)
        if failures:
            return failures
        ids = [m._actor_id.hex() for m in members]
        key = (self.host, self.port, self.generation)  # a member may hold a group of another broadcaster's store
        if self.generation == 0 or ids != self._members or any(h != key for h in held):
            self.generation += 1
            self._members = ids
        spec = GroupSpec(self.host, self.port, self.generation, len(members), self.backend, self.cfg.timeout_s,
                         self.cfg.bucket_mb << 20)
        calls = [self.trainer.broadcast_weights.options(max_task_retries=0).remote(spec, version)]
        calls += [h.receive_weights.options(max_task_retries=0).remote(spec, i + 1, version)
                  for i, h in enumerate(self.servers)]
        # every member bounds building the group and then the broadcast by timeout_s each
        return self._results(calls, names, 2 * self.cfg.timeout_s + 5)[1]

    @staticmethod
    def _results(refs: list, names: list[str], timeout: float, *, dead_is_fatal: bool = False) -> tuple[list, list[str]]:
        """Each call's result (None where it failed) and a line per failed call naming its member; with
        `dead_is_fatal`, a member that Ray reports dead raises `WeightBroadcastError` naming it."""
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        done = set(ready)
        results, failures = [], []
        for ref, name in zip(refs, names):
            result = None
            if ref not in done:
                failures.append(f"{name}: no answer within {timeout:.0f} s")
            else:
                try:
                    result = ray.get(ref)
                except ray.exceptions.ActorDiedError as e:
                    if dead_is_fatal:  # asked with the actor's own retries: it will not come back
                        raise WeightBroadcastError(f"weight broadcast: {name} is dead: {_first_line(e)}") from e
                    failures.append(f"{name}: lost ({_first_line(e)})")
                except Exception as e:
                    failures.append(f"{name}: {_first_line(e)}")
            results.append(result)
        return results, failures

    def close(self) -> None:
        """Stop the store's server (members still in a group see it gone at their next build)."""
        self._store = None


def _first_line(e: BaseException) -> str:
    cause = getattr(e, "cause", None) or e  # a RayTaskError names the actor's own exception
    return f"{type(cause).__name__}: {(str(cause).strip().splitlines() or [''])[0][:300]}"
