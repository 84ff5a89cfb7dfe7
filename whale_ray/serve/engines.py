"""How a replica reaches its engines (`serve.engine_layout`): in its own process, or in an actor of its own.

Either way each served model gives the replica the same interface: `tokenizer` and `max_context` (the replica
renders, counts and bounds prompts itself), `version`, `complete` (streaming through `request.on_token`),
`generate` (the agent's calls), `load` (a checkpoint on record) and `stats`.

- layout "replica" (the default; whale_ray/config.py says why): each model's `PolicyService` in the replica's
  process (`LocalEngine`).
- layout "actor": the replica's models' `PolicyService`s in one `EngineActor`, a Ray actor that
  the replica starts on its own node and owns (it dies with the replica), holding the replica's Ray CPUs and GPUs
  (serve.replica_cpus, replica_gpus), the replica itself none. Why: Serve runs each request's Python in the
  replica (the route, the body, the reply, request metrics, the access log); beside the engine's sampling
  thread in one process that Python holds the GIL the engine needs between its forward passes (py-spy on the
  replica, 2 cores, 32 clients: the engine thread ran in ~18 % of samples). In an actor of its own the engine
  has its process's GIL to itself; the requests and their tokens and outputs cross a socket in batches (one frame
  per batch of arrivals, one per batch of events: whale_ray/serve/channel.py). Each replica keeps its own engines,
  so a weight swap is what it was: the replica loads each version into them, and the requests in flight
  finish on the weights they started with.
"""

from __future__ import annotations

import asyncio
import os

import ray
import torch

from whale_ray.policy.engine import GenerationOutput, GenerationRequest, check_request
from whale_ray.policy.serving import PolicyService, to_call
from whale_ray.policy.tiny import load_tokenizer
from whale_ray.records import ModelCall, SamplingParams
from whale_ray.serve.channel import Channel, Link
from whale_ray.serve.follow import Weights, load_state_dict
from whale_ray.serve.lag import LoopLag
from whale_ray.serve.spec import EndpointSpec

ENGINE_START_S = 600.0  # the engine actor's start: placed, the model loaded (vLLM on a GPU: under a minute)


def _service(weights: Weights, spec: EndpointSpec) -> PolicyService:
    p = spec.policy
    return PolicyService(weights.path, engine=p.engine, max_batch=p.max_batch, batch_wait_ms=p.batch_wait_ms,
                         version=weights.version, device=p.device, dtype=p.dtype, batching=p.batching)


async def _load(service: PolicyService, weights: Weights) -> int:
    """Reads the checkpoint off the event loop, then loads it (the requests in flight finish first)."""
    state = await asyncio.get_running_loop().run_in_executor(None, load_state_dict, weights.path)
    return await service.load_weights(state, weights.version)


def _threads(spec: EndpointSpec) -> None:
    if spec.serve.replica_cpus >= 1:
        torch.set_num_threads(int(spec.serve.replica_cpus))  # replicas sharing a node do not oversubscribe it


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


@ray.remote
class EngineActor:
    """One replica's `PolicyService`s, by model name, in a process of their own (the module docstring says why),
    fed and read in batches over the socket of whale_ray/serve/channel.py."""

    def __init__(self, start: dict[str, Weights], spec: EndpointSpec):
        _threads(spec)
        self.services = {name: _service(w, spec) for name, w in start.items()}
        self._link = Link(self.services)
        self._lag = LoopLag()  # how late this loop (beside the engine's thread, under one GIL) runs what is ready

    def max_context(self, name: str) -> int:
        return self.services[name].engine.max_context

    async def link(self, node_id: str) -> tuple:
        """Where the replica on node `node_id` connects, and with which key (whale_ray/serve/channel.py)."""
        self._lag.start()
        return await self._link.address(node_id == ray.get_runtime_context().get_node_id())

    async def load(self, name: str, weights: Weights) -> int:
        return await _load(self.services[name], weights)

    def stats(self, name: str) -> dict[str, float]:
        # the engine's process (GET /health shows it), and the hop's batching (all models together)
        return {**self.services[name].stats(), "pid": os.getpid(), "submits": self._link.submits,
                "in_flight": len(self._link.tasks), **self._link.timing, **self._lag.stats()}


class ActorEngine:
    """One model of the replica's `EngineActor`, reached through the replica's one `Channel` to it."""

    def __init__(self, actor: "ray.actor.ActorHandle", channel: Channel, name: str, weights: Weights):
        self.actor, self.channel, self.name = actor, channel, name
        self.tokenizer = load_tokenizer(weights.path)
        self.max_context: int = ray.get(actor.max_context.remote(name))
        self.version = weights.version  # this replica alone loads weights into its actor

    async def complete(self, request: GenerationRequest) -> GenerationOutput:
        check_request(request)  # refused here, without a round trip
        return await self.channel.complete(self.name, request)

    async def generate(self, messages: list[dict[str, str]], sampling: SamplingParams) -> ModelCall:
        request = GenerationRequest(messages, sampling)
        return to_call(request, await self.complete(request))

    async def load(self, weights: Weights) -> None:
        self.version = await self.actor.load.remote(self.name, weights)

    async def stats(self) -> dict[str, float]:
        # the channel's round trips (all the replica's models together) beside the actor's seconds within them
        return {**await self.actor.stats.remote(self.name), **self.channel.timing}


def start_engines(start: dict[str, Weights], spec: EndpointSpec) -> dict[str, LocalEngine | ActorEngine]:
    """Each model's engine, on the weights `start` names for it, in the layout the spec asks for."""
    if spec.serve.engine_layout == "replica":
        _threads(spec)
        return {name: LocalEngine(w, spec) for name, w in start.items()}
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    c = spec.serve
    # on the replica's node: the hop stays local, and the checkpoints the replica reads are there too
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)
    actor = EngineActor.options(num_cpus=c.replica_cpus, num_gpus=c.replica_gpus,
                                scheduling_strategy=here).remote(start, spec)
    try:  # an actor the cluster has no room for stays pending: the replica would wait on it for ever
        ray.get(actor.__ray_ready__.remote(), timeout=ENGINE_START_S)
    except ray.exceptions.GetTimeoutError:
        ray.kill(actor)
        raise RuntimeError(f"serve.engine_layout actor: the replica's engine actor was not up after {ENGINE_START_S:.0f} s; "
                           f"it asks for {c.replica_cpus:g} CPU and {c.replica_gpus:g} GPU (serve.replica_cpus, "
                           "replica_gpus): is there room for it on the cluster?") from None
    channel = Channel(actor)
    return {name: ActorEngine(actor, channel, name, w) for name, w in start.items()}
