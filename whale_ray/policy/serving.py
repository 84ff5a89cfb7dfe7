"""The PolicyServer's logic without Ray: one engine shared by every episode's concurrent generate calls.

Both engines batch continuously (`agenerate`): each request is handed to the engine as it comes, and joins
the running batch at the engine's next step. `batching="pass"` puts `PolicyBatcher` in front instead, which
gathers concurrent calls into one `generate` pass at a time (a baseline that benchmarks/serve_throughput.py
measures continuous batching against). Either way each reply
carries the weight version that the engine read when it admitted the request, so a `load_weights` landing
mid-batch cannot relabel it.

`actors/policy_server.py` wraps `PolicyService` in a Ray actor; benchmarks drive it directly where Ray is
not installed.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from whale_ray.policy.cuda_ipc import SharedReader, SharedWeights, materialize
from whale_ray.policy.engine import Engine, GenerationOutput, GenerationRequest, check_request
from whale_ray.policy.engine_registry import make_engine
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
    sizes: deque[int] = field(default_factory=lambda: deque(maxlen=1024))  # of the last passes

    def summary(self) -> dict[str, float]:
        return {
            "batches": self.batches,
            "requests": self.requests,
            "mean_batch": self.requests / self.batches if self.batches else 0.0,
            "busy_s": round(self.busy_s, 3),
        }


class PolicyBatcher:
    """Gathers concurrent generate calls into batches and runs one engine pass at a time off the event loop,
    never more than `max_batch` per pass.

    How long a batch waits for company: `wait_ms` after the first arrival; but while it is smaller than the
    last pass (whose callers are not all back), each arrival gives the next one `wait_ms` or a tenth of the
    last pass's time, whichever is longer, up to half of the last pass's time in all. Callers that come
    back one by one (HTTP clients, whose replies leave one after another) then join one pass instead of
    splitting into two half-size passes that take nearly as long each; callers that all come back at once
    see only `wait_ms`."""

    LINGER, GAP = 0.5, 0.1  # the most a batch waits, and the longest gap between arrivals, as shares of a pass

    def __init__(self, engine: Engine, *, max_batch: int = 64, wait_ms: float = 5.0):
        self.engine = engine
        self.max_batch = max_batch
        self.wait_s = wait_ms / 1000
        self.stats = BatchStats()
        self._queue: asyncio.Queue[_Pending] | None = None
        self._worker: asyncio.Task | None = None
        self._last = (0, 0.0)  # the last pass: its size and seconds

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

    async def _gather(self) -> list[_Pending]:
        assert self._queue is not None
        loop = asyncio.get_running_loop()
        batch = [await self._queue.get()]
        start = loop.time()
        last_size, last_s = self._last
        cap = start + max(self.wait_s, self.LINGER * last_s)
        gap = max(self.wait_s, self.GAP * last_s)
        until = start + (gap if last_size > 1 else self.wait_s)
        while len(batch) < self.max_batch:
            if self._queue.empty():
                timeout = until - loop.time()
                if timeout <= 0:
                    break
                try:
                    batch.append(await asyncio.wait_for(self._queue.get(), timeout))
                except asyncio.TimeoutError:
                    break
            else:
                batch.append(self._queue.get_nowait())
            if len(batch) < last_size:  # the last pass's callers are not all back: wait a gap for the next
                until = max(until, min(loop.time() + gap, cap))
        return batch

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = await self._gather()
            start = time.perf_counter()
            try:
                outputs = await loop.run_in_executor(None, self.engine.generate, [p.request for p in batch])
            except Exception as e:  # a failed pass fails its requests, not the server
                for p in batch:
                    if not p.future.done():
                        p.future.set_exception(e)
                continue
            self._last = (len(batch), time.perf_counter() - start)
            self.stats.batches += 1
            self.stats.requests += len(batch)
            self.stats.sizes.append(len(batch))
            self.stats.busy_s += self._last[1]
            for p, out in zip(batch, outputs):
                if not p.future.done():
                    p.future.set_result(out)


BATCHING = ("continuous", "pass")


class PolicyService:
    """generate / load_weights / version / stats over one engine (see the module docstring)."""

    def __init__(self, model_path: str, *, engine: str = "transformers", max_batch: int = 64,
                 batch_wait_ms: float = 5.0, version: int = 0, batching: str = "continuous", **engine_kwargs: Any):
        if batching not in BATCHING:
            raise ValueError(f"batching must be one of {', '.join(BATCHING)}, got {batching!r}")
        self.engine = make_engine(engine, model_path, max_batch=max_batch, version=version, **engine_kwargs)
        self.continuous = batching == "continuous" and hasattr(self.engine, "agenerate")
        self.batcher = PolicyBatcher(self.engine, max_batch=max_batch, wait_ms=batch_wait_ms)
        self._requests = 0
        self.last_load: dict[str, Any] = {}
        self._shared = SharedReader()  # the Trainer's parameters, opened once per Ray Train run (cuda_ipc)

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
        """`weights`: a state dict, or the Trainer's `SharedWeights` (read here; `Unreachable` where this process
        cannot see their GPU)."""
        # Off the event loop: the engine waits for the requests in flight to finish on the old weights.
        await asyncio.get_running_loop().run_in_executor(None, self.load_weights_now, weights, version)
        return self.engine.version

    def load_weights_now(self, weights: Any, version: int) -> None:
        t0 = time.perf_counter()
        state = materialize(weights, version, self._shared)
        t1 = time.perf_counter()
        self.engine.load_weights(state, version)
        if isinstance(weights, SharedWeights) and torch.cuda.is_available():
            torch.cuda.synchronize()  # the engine's copies out of the Trainer's parameters end before it steps again
        del state
        # where the time of the last load went (benchmarks/gpu_weight_sync.py reads it): opening the handles (the
        # first version of a Ray Train run), then the engine's reload
        self.last_load = {"version": version, "shared": isinstance(weights, SharedWeights),
                          "materialize_s": t1 - t0, "engine_s": time.perf_counter() - t1}

    def release_shared_weights(self) -> None:
        """Let go of the Trainer's GPU memory opened by `load_weights` (before its workers end)."""
        self._shared.close()

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
        # a "batch" is one engine step here: its mean is the rows per forward pass, prefills included
        e = self.engine
        steps, tokens = e.steps, e.tokens
        return {"batches": steps, "prefills": getattr(e, "prefills", 0), "requests": self._requests, "tokens": tokens,
                "mean_batch": tokens / steps if steps else 0.0, "busy_s": round(getattr(e, "busy_s", 0.0), 4),
                "idle_s": round(getattr(e, "idle_s", 0.0), 4), **getattr(e, "timing", {})}
