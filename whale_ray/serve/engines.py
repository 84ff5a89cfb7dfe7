"""How a replica reaches its engines, by `serve.preset` (whale_ray/config.py says why each is put together so).

Either way each served model gives the replica the same interface: `tokenizer` and `max_context` (the replica
renders, counts and bounds prompts itself), `version`, `complete` (streaming through `request.on_token`),
`generate` (the agent's calls), `load` (a checkpoint on record) and `stats`.

- preset "cpu": each model's `PolicyService` in the replica's process (`LocalEngine`); each replica has engines of
  its own and loads each version into them, and the requests in flight finish on the weights they started with.
- preset "gpu": one `EngineActor` for every replica of the endpoint, started by `deploy` before the replicas
  (`start_shared`: named and detached, the endpoint's rather than any replica's; `undeploy` ends it), holding
  serve.engine_cpus and engine_gpus, the replicas none (`SharedEngine`). Each replica reaches it over a socket of
  its own (whale_ray/serve/channel.py: the requests, their tokens and outputs cross in batches), and asks it to
  load every version it sees on record; the actor loads a version once (`EngineActor.load` never goes back), so
  the replicas' requests share one batch and one copy of the weights.

An engine actor that dies (its process killed, its node lost) is restarted by Ray (`RESTARTS`) on the weights the
run directory has on record then (whale_ray/policy/restart.py; a replica never answers on weights older than those);
the requests in flight fail with a 503 and Retry-After (whale_ray/serve/channel.py's `EngineLost`), the ones that
arrive meanwhile wait for it. One that is gone for good (its restarts used up) fails the replicas' health checks,
so Serve replaces them.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import time

import ray
import torch

from whale_ray.policy.checkpoint import load_tokenizer
from whale_ray.policy.engine import GenerationOutput, GenerationRequest, check_request
from whale_ray.policy.restart import Weights, come_back, restarted
from whale_ray.policy.serving import PolicyService, to_call
from whale_ray.records import ModelCall, SamplingParams
from whale_ray.serve.channel import Channel, Link
from whale_ray.serve.follow import follower_of, load_state_dict, start_weights
from whale_ray.serve.lag import LoopLag
from whale_ray.serve.spec import EndpointSpec

log = logging.getLogger(__name__)
ENGINE_START_S = 600.0  # the engine actor's start: placed, the model loaded (vLLM on a GPU: under a minute)
SHARED_NAME, SHARED_NAMESPACE = "whale-engine", "whale-serve"  # preset gpu's engine actor
RESTARTS = -1  # Ray restarts a dead engine actor however often it dies (each restart is logged)


def _service(weights: Weights, spec: EndpointSpec) -> PolicyService:
    p = spec.policy
    return PolicyService(weights.path, engine=p.engine, max_batch=p.max_batch, batch_wait_ms=p.batch_wait_ms,
                         version=weights.version, device=p.device, dtype=p.dtype, batching=p.batching)


async def _load(service: PolicyService, weights: Weights) -> int:
    """Reads the checkpoint off the event loop, then loads it (the requests in flight finish first)."""
    state = await asyncio.get_running_loop().run_in_executor(None, load_state_dict, weights.path)
    return await service.load_weights(state, weights.version)


def _threads(spec: EndpointSpec) -> None:
    if spec.serve.engine_cpus >= 1:
        torch.set_num_threads(int(spec.serve.engine_cpus))  # engines sharing a node do not oversubscribe it


class LocalEngine:
    def __init__(self, weights: Weights, spec: EndpointSpec):
        self.service = _service(weights, spec)
        self.tokenizer = self.service.engine.tokenizer
        self.max_context: int = self.service.engine.max_context

    @property
    def version(self) -> int:
        return self.service.version()

    async def complete(self, request: GenerationRequest) -> GenerationOutput:
        return await self.service.complete(request)

    async def generate(self, messages: list[dict[str, str]], sampling: SamplingParams) -> ModelCall:
        return await self.service.generate(messages, sampling)

    async def load(self, weights: Weights) -> None:
        await _load(self.service, weights)

    async def stats(self) -> dict[str, float]:
        return {**self.service.stats(), "pid": os.getpid()}

    def check(self) -> None:  # in the replica's process: it lives as long as the replica
        pass


def _announce(start: dict[str, Weights]) -> None:
    log.warning("the engine actor restarted, on %s", ", ".join(f"{n} v{w.version}" for n, w in start.items()))


@ray.remote
class EngineActor:
    """The endpoint's `PolicyService`s, by model name, in a process of their own (the module docstring says why),
    fed and read in batches over the socket of whale_ray/serve/channel.py."""

    def __init__(self, start: dict[str, Weights], spec: EndpointSpec):
        _threads(spec)
        # restarted: not on `start`, which the run may have moved past
        start = come_back(start, lambda: start_weights(spec, follower_of(spec)), _announce)
        self.restarted = restarted()
        self.services = {name: _service(w, spec) for name, w in start.items()}
        self._link = Link(self.services)
        self._lag = LoopLag()  # how late this loop (beside the engine's thread, under one GIL) runs what is ready
        self._loading = collections.defaultdict(asyncio.Lock)  # by model: one load at a time
        self._loads = collections.Counter()  # by model: the versions loaded

    def describe(self, name: str) -> tuple[int, int]:
        """The model's context and the weight version it serves now."""
        service = self.services[name]
        return service.engine.max_context, service.version()

    async def link(self, node_id: str) -> tuple:
        """Where the replica on node `node_id` connects, and with which key (whale_ray/serve/channel.py)."""
        self._lag.start()
        return await self._link.address(node_id == ray.get_runtime_context().get_node_id())

    async def load(self, name: str, weights: Weights) -> int:
        """Loads `weights` unless the model serves them or newer ones already (it hears of each version from every
        replica, in any order); returns the version it serves."""
        service = self.services[name]
        async with self._loading[name]:
            if weights.version > service.version():
                await _load(service, weights)
                self._loads[name] += 1
        return service.version()

    def stats(self, name: str) -> dict[str, float]:
        # the engine's process (GET /health shows it), and the hop's batching (all models together)
        return {**self.services[name].stats(), "pid": os.getpid(), "restarted": self.restarted,
                "loads": self._loads[name], "submits": self._link.submits,
                "in_flight": len(self._link.tasks), **self._link.timing, **self._lag.stats()}


class SharedEngine:
    """One model of the endpoint's `EngineActor`, reached through the replica's one `Channel` to it."""

    def __init__(self, actor: "ray.actor.ActorHandle", channel: Channel, name: str, weights: Weights):
        self.actor, self.channel, self.name = actor, channel, name
        self.tokenizer = load_tokenizer(weights.path)
        # the version it serves for every replica: raised by the versions this replica's replies name and loads
        self.max_context, self.version = ray.get(actor.describe.remote(name))

    async def complete(self, request: GenerationRequest) -> GenerationOutput:
        check_request(request)  # refused here, without a round trip
        out = await self.channel.complete(self.name, request)
        self.version = max(self.version, out.weight_version)
        return out

    async def generate(self, messages: list[dict[str, str]], sampling: SamplingParams) -> ModelCall:
        request = GenerationRequest(messages, sampling)
        return to_call(request, await self.complete(request))

    async def load(self, weights: Weights) -> None:
        self.version = await self.actor.load.remote(self.name, weights)

    def check(self) -> None:
        """Raises once the engine actor is gone for good (Serve then replaces this replica)."""
        if self.channel.dead is not None:
            raise RuntimeError(f"model {self.name}: the engine actor is gone for good ({self.channel.dead})")

    async def stats(self) -> dict[str, float]:
        # the channel's round trips (all the replica's models together) beside the actor's seconds within them
        return {**await self.actor.stats.remote(self.name), **self.channel.timing}


def start_engines(start: dict[str, Weights], spec: EndpointSpec) -> dict[str, LocalEngine | SharedEngine]:
    """Each model's engine for one replica, by the spec's preset: in this process on the weights `start` names
    (cpu), or the endpoint's engine actor on whatever weights it serves now (gpu)."""
    if spec.serve.preset == "cpu":
        _threads(spec)
        return {name: LocalEngine(w, spec) for name, w in start.items()}
    actor = ray.get_actor(SHARED_NAME, namespace=SHARED_NAMESPACE)
    channel = Channel(actor)
    return {name: SharedEngine(actor, channel, name, w) for name, w in start.items()}


def start_shared(start: dict[str, Weights], spec: EndpointSpec) -> None:
    """Preset gpu's engine actor, on the weights `start` names, before any replica looks for it; one left by an
    earlier endpoint (its driver killed before `undeploy`) is ended first. An actor the cluster has no room for
    stays pending, and the replicas would wait on it for ever: after ENGINE_START_S it is an error naming what it
    asks for."""
    stop_shared()
    c = spec.serve
    actor = EngineActor.options(name=SHARED_NAME, namespace=SHARED_NAMESPACE, lifetime="detached",
                                max_restarts=RESTARTS, num_cpus=c.engine_cpus,
                                num_gpus=c.gpus_per_engine).remote(start, spec)
    try:
        ray.get(actor.__ray_ready__.remote(), timeout=ENGINE_START_S)
    except ray.exceptions.GetTimeoutError:
        ray.kill(actor)
        raise RuntimeError(f"serve.preset gpu: the endpoint's engine actor was not up after {ENGINE_START_S:.0f} s; "
                           f"it asks for {c.engine_cpus:g} CPU and {c.gpus_per_engine:g} GPU (serve.engine_cpus, "
                           "engine_gpus): is there room for it on the cluster?") from None


def stop_shared(timeout_s: float = 30.0) -> None:
    """Ends the shared engine actor, if there is one, and waits until its name is free."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            actor = ray.get_actor(SHARED_NAME, namespace=SHARED_NAMESPACE)
        except ValueError:
            return
        ray.kill(actor, no_restart=True)
        if time.monotonic() > deadline:
            raise RuntimeError(f"the shared engine actor {SHARED_NAMESPACE}/{SHARED_NAME} was still alive "
                               f"{timeout_s:.0f} s after it was killed")
        time.sleep(0.1)
