"""PolicyServer: the policy that generates, shared by every episode of every evaluator.

A Ray actor around `whale_ray.policy.serving.PolicyService`: concurrent requests from many episodes are
batched (by vLLM's scheduler, or gathered into one pass for the transformers engine); new weights arrive as
an object ref from the Trainer and are loaded in place, without a restart.
"""

from __future__ import annotations

from typing import Any

import ray

from whale_ray.policy.serving import PolicyService
from whale_ray.records import ModelCall, SamplingParams


@ray.remote
class PolicyServer:
    def __init__(self, model_path: str, *, engine: str = "transformers", max_batch: int = 64,
                 batch_wait_ms: float = 5.0, version: int = 0, **engine_kwargs: Any):
        self._service = PolicyService(model_path, engine=engine, max_batch=max_batch, batch_wait_ms=batch_wait_ms,
                                      version=version, **engine_kwargs)

    async def generate(self, messages: list[dict[str, str]], sampling: SamplingParams) -> ModelCall:
        return await self._service.generate(messages, sampling)

    async def load_weights(self, state_dict: dict, version: int) -> int:
        return await self._service.load_weights(state_dict, version)

    def version(self) -> int:
        return self._service.version()

    def stats(self) -> dict[str, float]:
        return self._service.stats()
