"""`POST /v1/agent/run`: the agent (h* over the served θ), not only the model, on one task.

The harness is untrusted code and runs only inside the sandbox (`whale_ray.sandbox.run_episode`, the layers
of the run's `sandbox:` config); its model calls come back over the RPC channel to the replica's own
PolicyService. The request carries only public task fields: the endpoint has no verifier, no gold answer and
no D_test, so none of them can reach the harness, and the reply has no reward.

A domain's shared trusted services (search_qa's retriever) are started once by `deploy`, in the driver, from
the run's config (`start_agent_services`), and handed to every replica. A domain whose tools need the task's
trusted fields (chess's opponent plays the reference line) cannot run from public fields alone: it is refused
with one line.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable, Optional

from pydantic import BaseModel, ConfigDict, Field

from whale_ray.config import SandboxConfig
from whale_ray.domain import get_domain
from whale_ray.records import EpisodeResult, ModelCall, SamplingParams, Task
from whale_ray.sandbox import SandboxLimits, run_episode
from whale_ray.serve.openai_api import ApiError


class AgentRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    task: dict[str, Any] = Field(description="the domain's public task fields: id, question, public meta")
    model: Optional[str] = None  # which served weights; default: θ* (or the only model)
    seed: int = 0


def start_agent_services(config: dict[str, Any], run_dir: str | None) -> dict[str, Any]:
    """The domain's shared services (Ray actors) for the endpoint's agent, as a run starts them
    (`Domain.start_services`), from the run's resolved `config`; their events go to the followed `run_dir`,
    else to a folder of their own. A domain with no services costs nothing here (no splits read, no folder)."""
    import tempfile

    from whale_ray.config import WhaleConfig
    from whale_ray.domain import Domain

    cfg = WhaleConfig.model_validate(config)
    domain = get_domain(cfg.domain)
    if type(domain).start_services is Domain.start_services:
        return {}
    cfg.run_dir = run_dir or tempfile.mkdtemp(prefix="whale-serve-")
    return domain.start_services(cfg, domain.load_splits(cfg.data, cfg.seed))


class AgentRunner:
    def __init__(self, domain: str, sandbox: SandboxConfig, services: dict[str, Any] | None = None):
        self.domain = get_domain(domain)
        self.limits = SandboxLimits.from_config(sandbox)
        d = self.domain
        self.tools_path = d.sandbox_tools_path if d.sandbox_tools_path.exists() else None
        try:
            self.host_tools: dict[str, Callable[..., str]] | None = d.host_tools(dict(services or {}))
            self.unavailable = ""
        except Exception as e:  # noqa: BLE001 - the domain's own reason, one line
            self.host_tools, self.unavailable = None, f"domain {d.name!r} cannot run agents here: {e}"

    def task(self, fields: dict[str, Any]) -> Task:
        if not isinstance(fields.get("question"), str) or not fields["question"]:
            raise ApiError(400, "task.question must be a non-empty string", param="task.question")
        if any(k.startswith("_") or k == "answer" for k in fields):
            raise ApiError(400, "task: only public fields (no 'answer', no '_' keys)", param="task")
        meta = {k: v for k, v in fields.items() if k not in ("id", "question")}
        return Task(id=str(fields.get("id", "request")), question=fields["question"], answer="", meta=meta)

    async def run(self, harness_source: str, harness_id: str, req: AgentRequest,
                  generate: Callable[[list[dict[str, str]], SamplingParams], ModelCall]) -> dict[str, Any]:
        """One episode in the sandbox, off the event loop (it blocks for its whole wall time)."""
        if self.host_tools is None:
            raise ApiError(400, self.unavailable, param="task", code="agent_unavailable")
        task = self.task(req.task)
        try:
            episode_tools = self.domain.episode_tools(task, {})
        except Exception as e:  # noqa: BLE001
            raise ApiError(400, f"domain {self.domain.name!r}: its episode tools need trusted task fields ({e})",
                           param="task", code="agent_unavailable") from None
        t0 = time.monotonic()
        result = await asyncio.get_running_loop().run_in_executor(None, lambda: run_episode(
            harness_source, task.public(), generate=generate, tools_path=self.tools_path,
            host_tools={**self.host_tools, **episode_tools}, limits=self.limits, seed=req.seed,
            harness_name=f"{harness_id}.py"))
        return reply(result, harness_id, time.monotonic() - t0)


def reply(ep: EpisodeResult, harness_id: str, wall_s: float) -> dict[str, Any]:
    calls = [{"messages": c.messages, "completion": c.text, "weight_version": c.weight_version,
              "finish_reason": c.finish_reason, "prompt_tokens": len(c.prompt_ids),
              "completion_tokens": len(c.completion_ids)} for c in ep.calls]
    return {"object": "agent.run", "harness_id": harness_id, "status": ep.status, "reason": ep.reason,
            "answer": ep.answer, "turns": ep.turns, "tool_calls": ep.tool_calls, "events": ep.events,
            "model_calls": calls, "weight_versions": sorted({c.weight_version for c in ep.calls}),
            "wall_s": round(wall_s, 3), "peak_memory_bytes": ep.peak_memory_bytes}
