"""New weights from the Trainer to every PolicyServer: one object per `weight.weight_sync` mode, owning both ends.

The loop calls only this object (the `WeightSync` protocol of whale_ray/loop/context.py), from the weight phase:

    before_step()   the servers hold new calls for the step's weights, and their GPU memory goes to the Trainer's
                    step (vLLM's sleep mode, policy.sleep_level)
    push(v)         weight v, which the Trainer holds now, on every server (a sleeping one wakes into it); the
                    held calls go through
    resume()        the servers awake again after a step that trained nothing (a level-2 sleep dropped their
                    weights: those get the current version pushed), and the held calls go through on them
    release()       the servers let go of the Trainer's memory before its workers end (cuda_ipc)

and the Coordinator's evaluator pool calls `follow_restarts()` at every poll: a server restarted by Ray holds its
calls (actors/policy_server.py) until this brings it to the weights on record, the last version pushed. The
PolicyServer only receives; the Trainer only hands out what it is asked for (actors/trainer.py).

The modes:
- object_store (`ObjectStoreSync`): rank 0 of the Trainer puts its CPU state dict in the object store (a ref the
  Trainer actor owns, `Trainer.host_weights`) and every server is handed the ref: the state dict crosses the
  object store once, and nothing between (the Coordinator, the Trainer actor) fetches it.
- cuda_ipc (`CudaIpcSync`): the CUDA IPC handles of rank 0's parameters (whale_ray/policy/cuda_ipc.py); a server
  that cannot see that GPU answers `Unreachable` and gets that version as object_store sends it.
- broadcast (`BroadcastSync`, actors/broadcast_sync.py): rank 0 sends to every replica over a group of their own;
  a server alone (restarted, or woken without weights) gets them as object_store sends them.
"""

from __future__ import annotations

import threading
from typing import Any

import ray

from whale_ray.policy.cuda_ipc import Unreachable


class ObjectStoreSync:
    """weight_sync object_store, and what the other modes fall back on (see the module docstring).

    `trainer`: the Trainer actor (None for a schedule without a weight phase: nothing is ever pushed);
    `servers`: the PolicyServer replicas; `version`: the weights they start on; `sleeps`: vLLM's sleep mode."""

    def __init__(self, trainer: "ray.actor.ActorHandle | None", servers: list["ray.actor.ActorHandle"], *,
                 version: int, sleeps: bool = False) -> None:
        self.trainer, self.servers, self.version, self.sleeps = trainer, list(servers), version, sleeps
        self._probes: dict[int, Any] = {}  # server index -> its `restarted` call not read yet
        # (version, the Trainer's ref of its CPU state dict) last sent: a server restarted while the Trainer takes
        # the next step (weight.max_staleness 1) gets the version on record without asking a Trainer that has
        # moved on. Holding it keeps one more state dict in the object store until the next push.
        self._sent: tuple[int, Any] | None = None
        self._holding = False  # between before_step and push/resume: new calls wait for version + 1
        # One act at a time: the weight phase's thread pushes while the evaluator pool, running a step's rollouts
        # begun beside the step in a thread of its own, follows restarts at its polls.
        self._lock = threading.RLock()

    def before_step(self) -> None:
        with self._lock:
            self._holding = True
            ray.get([s.hold.remote(self.version + 1) for s in self.servers])
            if self.sleeps:
                ray.get([s.sleep.remote() for s in self.servers])

    def push(self, version: int) -> None:
        with self._lock:
            self._probes.clear()  # every server is on `version` after this, a restarted one too
            self._push(version)
            self.version, self._holding = version, False

    def resume(self) -> None:
        with self._lock:
            if self.sleeps:
                awake = ray.get([s.wake_up.remote() for s in self.servers])
                dropped = [s for s, ok in zip(self.servers, awake) if not ok]
                if dropped:
                    self._send(self.version, dropped)
            ray.get([s.unhold.remote() for s in self.servers])
            self._holding = False

    def release(self) -> None:
        pass  # nothing of the Trainer's is held by a server

    def follow_restarts(self) -> None:
        """A server restarted by Ray to the weights on record; never waits for a server that is starting."""
        with self._lock:
            self._follow_restarts()

    def _follow_restarts(self) -> None:
        for i, server in enumerate(self.servers):
            self._probes.setdefault(i, server.restarted.remote())
        ready, _ = ray.wait(list(self._probes.values()), num_returns=len(self._probes), timeout=0)
        for i, probe in list(self._probes.items()):
            if probe not in ready:
                continue
            del self._probes[i]
            held = ray.get(probe)  # a server dead for good raises here: the run's fault path takes it
            if held is not None and self._holding:  # a step is under way: its calls stay the step's weights' to answer
                self.servers[i].hold.remote(self.version + 1)  # runs before what follows: one caller's calls keep order
            if held == self.version:
                ray.get(self.servers[i].serve.remote())
            elif held is not None:
                self._send(self.version, [self.servers[i]])

    def close(self) -> None:
        pass  # nothing to stop: the servers and the Trainer end with the run's actors

    def _push(self, version: int) -> None:
        self._send(version, self.servers)

    def _send(self, version: int, servers: list["ray.actor.ActorHandle"]) -> None:
        if self._sent is None or self._sent[0] != version:
            (ref,) = ray.get(self.trainer.host_weights.remote(version))
            self._sent = (version, ref)
        ray.get([s.load_weights.remote(self._sent[1], version) for s in servers])


class CudaIpcSync(ObjectStoreSync):
    """weight_sync cuda_ipc, training on a GPU (see the module docstring)."""

    def _send(self, version: int, servers: list["ray.actor.ActorHandle"]) -> None:
        shared = ray.get(self.trainer.shared_weights.remote(version))
        calls = [s.load_weights.remote(shared, version) for s in servers]
        unreachable = []
        for server, call in zip(servers, calls):
            try:
                ray.get(call)
            except Unreachable:
                unreachable.append(server)
        if unreachable:
            super()._send(version, unreachable)

    def release(self) -> None:
        ray.get([s.release_shared_weights.remote() for s in self.servers])
