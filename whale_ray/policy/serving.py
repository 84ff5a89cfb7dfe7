"""The PolicyServer's logic without Ray: one engine shared by every episode's concurrent generate calls.

Engines with continuous batching (`VLLMEngine.agenerate`) get each request as it comes: the engine's own
scheduler batches them step by step. Other engines (`TransformersEngine`) sit behind `PolicyBatcher`, which
gathers concurrent calls into one `generate` pass. Either way each reply carries the weight version that the
engine read together with its batch, so a `load_weights` landing mid-batch cannot relabel it.

`actors/policy_server.py` wraps `PolicyService` in a Ray actor; benchmarks drive it directly where Ray is
not installed.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from whale_ray.policy import make_engine
from whale_ray.policy.engine import Engine, GenerationOutput, GenerationRequest, check_request
from whale_ray.policy.weight_sync import SharedWeights, materialize
from whale_ray.records import ModelCall, SamplingParams


def to_call(request: GenerationRequest, out: GenerationOutput) -> ModelCall:
    return ModelCall(
        messages=request.messages, text=out.text, prompt_ids=out.prompt_ids, completion_ids=out.completion_ids,
        logprobs=out.logprobs, weight_version=out.weight_version, finish_reason=out.finish_reason,
    )


@dataclass
class _Pending:
    request: GenerationRequest
    future: asyncio.Future


@dataclass
class BatchStats:
    batches: int = 0
    requests: int = 0
    busy_s: float = 0.0
    sizes: list[int] = field(default_factory=list)

    def summary(self) -> dict[str, float]:
        return {
            "batches": self.batches,
            "requests": self.requests,
            "mean_batch": self.requests / self.batches if self.batches else 0.0,
            "busy_s": round(self.busy_s, 3),
        }


class PolicyBatcher:
    """Gathers concurrent generate calls into batches: waits at most `wait_ms` for company, never
    more than `max_batch` per pass, and runs one engine pass at a time off the event loop."""

    def __init__(self, engine: Engine, *, max_batch: int = 64, wait_ms: float = 5.0):
        self.engine = engine
        self.max_batch = max_batch
        self.wait_s = wait_ms / 1000
        self.stats = BatchStats()
        self._queue: asyncio.Queue[_Pending] | None = None
        self._worker: asyncio.Task | None = None

    def _ensure_worker(self) -> asyncio.Queue:
        if self._queue is None:
            self._queue = asyncio.Queue()
            self._worker = asyncio.get_running_loop().create_task(self._serve())
        return self._queue

    async def generate(self, messages: list[dict[str, str]], sampling: SamplingParams) -> ModelCall:
        request = GenerationRequest(messages, sampling)
        return to_call(request, await self.complete(request))

    async def complete(self, request: GenerationRequest) -> GenerationOutput:
        check_request(request)  # refused alone: a bad request must not fail the batch it would join
        future = asyncio.get_running_loop().create_future()
        self._ensure_worker().put_nowait(_Pending(request, future))
        return await future

    async def _serve(self) -> None:
        assert self._queue is not None
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self._queue.get()]
            deadline = loop.time() + self.wait_s
            while len(batch) < self.max_batch:
                timeout = deadline - loop.time()
                if timeout <= 0 and self._queue.empty():
                    break
                try:
                    batch.append(await asyncio.wait_for(self._queue.get(), max(timeout, 0)))
                except asyncio.TimeoutError:
                    break
            start = time.perf_counter()
            try:
                outputs = await loop.run_in_executor(None, self.engine.generate, [p.request for p in batch])
            except Exception as e:  # a failed pass fails its requests, not the server
                for p in batch:
                    if not p.future.done():
                        p.future.set_exception(e)
                continue
            self.stats.batches += 1
            self.stats.requests += len(batch)
            self.stats.busy_s += time.perf_counter() - start
            for p, out in zip(batch, outputs):
                if not p.future.done():
                    p.future.set_result(out)


class PolicyService:
    """generate / load_weights / version / stats over one engine (see the module docstring)."""

    def __init__(self, model_path: str, *, engine: str = "transformers", max_batch: int = 64,
                 batch_wait_ms: float = 5.0, version: int = 0, **engine_kwargs: Any):
        self.engine = make_engine(engine, model_path, max_batch=max_batch, version=version, **engine_kwargs)
        self.continuous = hasattr(self.engine, "agenerate")
        self.batcher = PolicyBatcher(self.engine, max_batch=max_batch, wait_ms=batch_wait_ms)
        self._requests = 0

    async def generate(self, messages: list[dict[str, str]], sampling: SamplingParams) -> ModelCall:
        request = GenerationRequest(messages, sampling)
        return to_call(request, await self.complete(request))

    async def complete(self, request: GenerationRequest) -> GenerationOutput:
        """One request (chat or raw prompt, optionally streamed through `request.on_token`), batched with
        the others in flight; the engine's output as it is (the OpenAI endpoint needs its top log-probs)."""
        if not self.continuous:
            return await self.batcher.complete(request)
        check_request(request)
        self._requests += 1
        return await self.engine.agenerate(request)

    async def load_weights(self, weights: Any, version: int) -> int:
        """`weights`: a state dict, or the Trainer's `SharedWeights` (opened here, or fetched once through the
        object store where this process cannot see their GPU)."""
        # Off the event loop: the engine waits for the requests in flight to finish on the old weights.
        await asyncio.get_running_loop().run_in_executor(None, self.load_weights_now, weights, version)
        return self.engine.version

    def load_weights_now(self, weights: Any, version: int) -> None:
        state = materialize(weights, version)
        self.engine.load_weights(state, version)
        if isinstance(weights, SharedWeights) and torch.cuda.is_available():
            torch.cuda.synchronize()  # the engine's copies out of the Trainer's buckets are done before we drop them
        del state

    async def sleep(self) -> None:
        """The engine's sleep mode (vLLM with sleep_level > 0) until `wake_up` or `load_weights`; else nothing."""
        if hasattr(self.engine, "sleep"):
            await asyncio.get_running_loop().run_in_executor(None, self.engine.sleep)

    def asleep(self) -> bool:
        return bool(getattr(self.engine, "asleep", False))

    def needs_weights_to_wake(self) -> bool:
        return self.asleep() and getattr(self.engine, "sleep_level", 0) == 2

    async def wake_up(self) -> None:
        if self.asleep():
            await asyncio.get_running_loop().run_in_executor(None, self.engine.wake_up)

    def version(self) -> int:
        return self.engine.version

    def stats(self) -> dict[str, float]:
        if not self.continuous:
            return self.batcher.stats.summary()
        steps = self.engine.steps
        return {"batches": steps, "requests": self._requests,
                "mean_batch": self.engine.tokens / steps if steps else 0.0, "busy_s": 0.0}
