"""PolicyServer: the policy that generates, shared by every episode of every evaluator.

A Ray actor around `whale_ray.policy.serving.PolicyService`: concurrent requests from many episodes share
the engine's running batch (continuous batching; policy.batching "pass": one gathered generate pass at a
time); new weights arrive from
the Trainer (a CPU state dict by object ref, or CUDA IPC handles of its GPU buckets when it trains on a GPU:
whale_ray/policy/weight_sync.py) and are loaded in place, without a restart.

With vLLM's sleep mode (policy.sleep_level), the weight phase puts the server to sleep for each Trainer
step; the step's new weights wake it. A step that trained nothing wakes it with `wake_up`, which at level 2
(weights dropped) reloads the Trainer's current weights.

Restarted by Ray after a crash (the Coordinator gives it `max_restarts` and `max_task_retries`, so the
episodes' calls in flight are sent again), it comes back serving the latest weights, not the ones it was
first started with: it asks `weights_from` (the run's Trainer) for its version and, if that is newer, its
weights, before it answers any call.

With `weight.weight_sync: broadcast` the weights come by `receive_weights` instead: this replica's part of a
broadcast from the Trainer's rank 0 (whale_ray/policy/weight_broadcast.py), received off the event loop so
that generate calls go on meanwhile.
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
                 batch_wait_ms: float = 5.0, version: int = 0, weights_from: "ray.actor.ActorHandle | None" = None,
                 events_dir: str | None = None, batching: str = "continuous", **engine_kwargs: Any):
        self._service = PolicyService(model_path, engine=engine, max_batch=max_batch, batch_wait_ms=batch_wait_ms,
                                      version=version, batching=batching, **engine_kwargs)
        self._trainer = weights_from
        self._receiver = Receiver()  # weight_sync broadcast: this replica's group with the Trainer's rank 0
        if ray.get_runtime_context().was_current_actor_reconstructed:
            self._come_back(weights_from, EventLog(events_dir) if events_dir else None)

    def _come_back(self, trainer: "ray.actor.ActorHandle | None", events: EventLog | None) -> None:
        version = self._service.version()
        if trainer is not None:
            latest = ray.get(trainer.version.remote())
            if latest != version:
                self._service.load_weights_now(ray.get(trainer.latest_weights.remote(latest)), latest)
                version = latest
        if events is not None:
            events.emit("actor_restarted", f"the PolicyServer was restarted by Ray and serves weight version {version}",
                        actor="PolicyServer", version=version)

    async def generate(self, messages: list[dict[str, str]], sampling: SamplingParams) -> ModelCall:
        return await self._service.generate(messages, sampling)

    async def load_weights(self, weights: Any, version: int) -> int:
        return await self._service.load_weights(weights, version)

    async def receive_weights(self, spec: GroupSpec, rank: int, version: int) -> int:
        """Take part, as `rank`, in the broadcast of weight `version` (actors/weight_broadcaster.py), then load it as
        `load_weights` does; returns the version."""
        state = await asyncio.get_running_loop().run_in_executor(None, self._receiver.receive, spec, rank, version)
        return await self._service.load_weights(state, version)

    def broadcast_group(self) -> tuple | None:
        """The `GroupSpec.key` of the broadcast group this replica holds (None: none, e.g. restarted by Ray)."""
        return self._receiver.group()

    def release_shared_weights(self) -> None:
        """Before the Trainer's workers end: drop the views of their GPU memory (weight.weight_sync cuda_ipc)."""
        self._service.release_shared_weights()

    async def sleep(self) -> None:
        await self._service.sleep()

    async def wake_up(self) -> int:
        """Awake again on the weights it served before it slept; returns the version."""
        if self._service.needs_weights_to_wake():
            if self._trainer is None:
                raise RuntimeError("PolicyServer.wake_up: level-2 sleep dropped the weights and no Trainer was "
                                   "given (weights_from) to reload them from")
            version = self._service.version()
            await self._service.load_weights(await self._trainer.latest_weights.remote(version), version)
        else:
            await self._service.wake_up()
        return self._service.version()

    def version(self) -> int:
        return self._service.version()

    def stats(self) -> dict[str, float]:
        return self._service.stats()


def start_policy_servers(cfg: WhaleConfig, model_path: str, placement: Placement, *, version: int = 0,
                         **options: Any) -> list["ray.actor.ActorHandle"]:
    """The run's `policy.replicas` PolicyServers on `model_path`, with the config's engine settings; `options`:
    weights_from, events_dir, and Ray's max_restarts / max_task_retries."""
    p = cfg.policy
    restarts = {k: options.pop(k) for k in ("max_restarts", "max_task_retries") if k in options}
    return [PolicyServer.options(**placement.options("policy_server", cfg.resources.policy_server), **restarts).remote(
        model_path, engine=p.engine, max_batch=p.max_batch, batch_wait_ms=p.batch_wait_ms, batching=p.batching,
        version=version, device=p.device, dtype=p.dtype, seed=cfg.seed, **p.engine_options(), **options)
        for _ in range(p.replicas)]
