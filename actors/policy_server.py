"""PolicyServer: the policy that generates, shared by every episode of every evaluator.

A Ray actor around `whale_ray.policy.serving.PolicyService`: concurrent requests from many episodes share
the engine's running batch (continuous batching; policy.batching "pass": one gathered generate pass at a
time). It only receives weights: the run's weight sync (actors/weight_sync.py, actors/broadcast_sync.py)
hands each version in (`load_weights`: a CPU state dict, or CUDA IPC handles of the Trainer's GPU buckets,
whale_ray/policy/cuda_ipc.py; `receive_weights`: this replica's part of a broadcast) and the engine loads it
in place, without a restart. With vLLM's sleep mode (policy.sleep_level) the sync puts it to sleep for each
Trainer step and wakes it (`wake_up`), or loads weights into it, after.

Restarted by Ray after a crash (the Coordinator gives it `max_restarts` and `max_task_retries`, so the
episodes' calls in flight are sent again), it comes back on the weights it was first started with and holds
every generate call until the sync brings it to the weights on record (`restarted` tells the sync; a load or
`serve` lets the calls through), so that no call is answered by older weights than the run's. While the Trainer
takes a step the sync holds new calls for the step's weights (`hold`), so that the next step's episodes can start
their sandboxes beside the step and still be answered by the weights they are meant for.
"""

from __future__ import annotations

import asyncio
from typing import Any

import ray

from whale_ray.config import WhaleConfig
from whale_ray.events import EventLog
from whale_ray.policy.serving import PolicyService
from whale_ray.policy.weight_broadcast import GroupSpec, Receiver
from whale_ray.records import ModelCall, SamplingParams
from whale_ray.resources import Placement


@ray.remote
class PolicyServer:
    def __init__(self, model_path: str, *, engine: str = "transformers", max_batch: int = 64,
                 batch_wait_ms: float = 5.0, version: int = 0, events_dir: str | None = None,
                 batching: str = "continuous", **engine_kwargs: Any):
        self._service = PolicyService(model_path, engine=engine, max_batch=max_batch, batch_wait_ms=batch_wait_ms,
                                      version=version, batching=batching, **engine_kwargs)
        self._receiver = Receiver()  # weight_sync broadcast: this replica's group with the Trainer's rank 0
        self._events = EventLog(events_dir) if events_dir else None
        self._held = ray.get_runtime_context().was_current_actor_reconstructed
        self._until: int | None = None  # `hold`: calls wait for this weight version (the Trainer's step)
        self._serving: asyncio.Event | None = None  # made on the actor's event loop by the first call that waits

    def _waits(self) -> bool:
        return self._held or (self._until is not None and self._service.version() < self._until)

    def _wake_waiters(self) -> None:
        """The calls that wait look again at what they wait for."""
        if self._serving is not None:
            self._serving.set()
            self._serving = None

    def _release(self) -> None:
        """A restarted server is on the weights on record now: the held calls go through (unless a `hold` still
        keeps them for a newer version)."""
        if self._held:
            self._held = False
            version = self._service.version()
            if self._events is not None:
                self._events.emit("actor_restarted", f"the PolicyServer was restarted by Ray and serves weight "
                                  f"version {version}", actor="PolicyServer", version=version)
        self._wake_waiters()

    async def generate(self, messages: list[dict[str, str]], sampling: SamplingParams) -> ModelCall:
        while self._waits():
            self._serving = self._serving or asyncio.Event()
            await self._serving.wait()
        return await self._service.generate(messages, sampling)

    def hold(self, version: int) -> None:
        """Calls from now on wait until the server holds weight `version` or `unhold` (the calls in flight finish as
        they are): while the Trainer takes a step, episodes may start, and their calls are the new weights' to
        answer."""
        self._until = version

    def unhold(self) -> None:
        """The step trained nothing: the held calls go through on the weights the server has."""
        self._until = None
        self._wake_waiters()

    async def load_weights(self, weights: Any, version: int) -> int:
        """Weight `version` (a state dict or `SharedWeights`), in place; returns the version."""
        loaded = await self._service.load_weights(weights, version)
        self._release()
        return loaded

    async def receive_weights(self, spec: GroupSpec, rank: int, version: int) -> int:
        """Take part, as `rank`, in the broadcast of weight `version` (actors/broadcast_sync.py), then load it as
        `load_weights` does; returns the version."""
        state = await asyncio.get_running_loop().run_in_executor(None, self._receiver.receive, spec, rank, version)
        return await self.load_weights(state, version)

    def broadcast_group(self) -> tuple | None:
        """The `GroupSpec.key` of the broadcast group this replica holds (None: none, e.g. restarted by Ray)."""
        return self._receiver.group()

    def restarted(self) -> int | None:
        """The weight version a server restarted by Ray holds while it holds its calls back; None once it serves."""
        return self._service.version() if self._held else None

    def serve(self) -> None:
        """Serve the weights it holds (a restarted server whose start-up weights are the ones on record)."""
        self._release()

    def release_shared_weights(self) -> None:
        """Before the Trainer's workers end: drop the views of their GPU memory (weight.weight_sync cuda_ipc)."""
        self._service.release_shared_weights()

    async def sleep(self) -> None:
        await self._service.sleep()

    async def wake_up(self) -> bool:
        """Awake again on the weights it served before it slept; False where a level-2 sleep dropped them (a
        `load_weights` then wakes it)."""
        if self._service.needs_weights_to_wake():
            return False
        await self._service.wake_up()
        return True

    def version(self) -> int:
        return self._service.version()

    def stats(self) -> dict[str, float]:
        return self._service.stats()


def start_policy_servers(cfg: WhaleConfig, model_path: str, placement: Placement, *, version: int = 0,
                         **options: Any) -> list["ray.actor.ActorHandle"]:
    """The run's `policy.replicas` PolicyServers on `model_path`, with the config's engine settings; `options`:
    events_dir, and Ray's max_restarts / max_task_retries."""
    p = cfg.policy
    restarts = {k: options.pop(k) for k in ("max_restarts", "max_task_retries") if k in options}
    return [PolicyServer.options(**placement.options("policy_server", cfg.resources.policy_server), **restarts).remote(
        model_path, engine=p.engine, max_batch=p.max_batch, batch_wait_ms=p.batch_wait_ms, batching=p.batching,
        version=version, device=p.device, dtype=p.dtype, seed=cfg.seed, **p.engine_options(), **options)
        for _ in range(p.replicas)]
