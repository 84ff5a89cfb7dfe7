"""PolicyServer: the policy that generates, shared by every episode of every evaluator.

Requests from many concurrent episodes are gathered into one batch per engine pass; new weights
arrive as an object ref from the Trainer and are loaded in place, without a restart.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import ray

from whale_ray.policy.engine import Engine, GenerationRequest, check_request, make_engine
from whale_ray.records import ModelCall, SamplingParams


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
                version = self.engine.version
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
                    p.future.set_result(ModelCall(
                        messages=p.request.messages, text=out.text, prompt_ids=out.prompt_ids,
                        completion_ids=out.completion_ids, logprobs=out.logprobs, weight_version=version,
                        finish_reason=out.finish_reason,
                    ))


@ray.remote
class PolicyServer:
    def __init__(self, model_path: str, *, engine: str = "transformers", max_batch: int = 64,
                 batch_wait_ms: float = 5.0, version: int = 0, **engine_kwargs: Any):
        self._engine = make_engine(engine, model_path, max_batch=max_batch, **engine_kwargs)
        if version:
            self._engine.load_weights(self._engine.state_dict(), version)
        self._batcher = PolicyBatcher(self._engine, max_batch=max_batch, wait_ms=batch_wait_ms)

    async def generate(self, messages: list[dict[str, str]], sampling: SamplingParams) -> ModelCall:
        return await self._batcher.generate(messages, sampling)

    async def load_weights(self, state_dict: dict, version: int) -> int:
        # Off the event loop: the engine's lock waits for a batch in flight to finish.
        await asyncio.get_running_loop().run_in_executor(None, self._engine.load_weights, state_dict, version)
        return self._engine.version

    def version(self) -> int:
        return self._engine.version

    def stats(self) -> dict[str, float]:
        return self._batcher.stats.summary()
