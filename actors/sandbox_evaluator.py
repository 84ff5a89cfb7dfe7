"""SandboxEvaluator: runs episodes of a harness, each in its own sandboxed subprocess.

An evaluator owns `slots` concurrent sandboxes; the pool spreads chunks of episodes over its
evaluators and can grow or shrink between phases (elastic rollouts).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import ray

from whale_ray.config import SandboxConfig
from whale_ray.domain import get_domain
from whale_ray.records import EpisodeResult, ModelCall, SamplingParams, Task
from whale_ray.sandbox import GenerateFn, SandboxLimits, run_episode

# A run's actors are placed anywhere on the cluster, never inside a caller's placement group (a Tune
# trial's, say), whose reservation was not sized for them.
CLUSTER = "DEFAULT"


@dataclass(frozen=True)
class EpisodeJob:
    task: Task  # the evaluator is trusted; only task.public() enters the sandbox
    seed: int


class EpisodeRunner:
    """Runs episodes of one harness at a time with `slots` sandboxes in flight."""

    def __init__(self, domain: str, generate: GenerateFn, limits: SandboxLimits, slots: int,
                 services: dict[str, Any] | None = None):
        self._domain = get_domain(domain)
        self._services = dict(services or {})
        d = self._domain
        self._tools_path = d.sandbox_tools_path if d.sandbox_tools_path.exists() else None
        self._host_tools = d.host_tools(self._services)
        self._generate = generate
        self._limits = limits
        self._executor = ThreadPoolExecutor(max_workers=slots, thread_name_prefix="episode")

    def run_episodes(self, harness_source: str, harness_name: str, jobs: list[EpisodeJob]) -> list[EpisodeResult]:
        futures = [
            self._executor.submit(
                run_episode, harness_source, job.task.public(), generate=self._generate, tools_path=self._tools_path,
                host_tools={**self._host_tools, **self._domain.episode_tools(job.task, self._services)},
                limits=self._limits, seed=job.seed, harness_name=harness_name,
            )
            for job in jobs
        ]
        return [f.result() for f in futures]


@ray.remote(max_concurrency=64)
class SandboxEvaluator:
    def __init__(self, domain: str, policy: "ray.actor.ActorHandle", sandbox: dict[str, Any],
                 services: dict[str, Any] | None = None):
        cfg = SandboxConfig.model_validate(sandbox)

        def generate(messages: list[dict[str, str]], sampling: SamplingParams) -> ModelCall:
            return ray.get(policy.generate.remote(messages, sampling))

        self._runner = EpisodeRunner(domain, generate, SandboxLimits.from_config(cfg), cfg.slots, services)

    def run_episodes(self, harness_source: str, harness_name: str, jobs: list[EpisodeJob]) -> list[EpisodeResult]:
        return self._runner.run_episodes(harness_source, harness_name, jobs)


class EvaluatorPool:
    """Spreads episodes over SandboxEvaluator actors in chunks of one evaluator's slot count."""

    def __init__(self, domain: str, policy: "ray.actor.ActorHandle", sandbox: SandboxConfig,
                 services: dict[str, Any] | None = None):
        """`services` are the domain's shared trusted services (Domain.start_services), given to every evaluator."""
        self._domain, self._policy, self._cfg, self._services = domain, policy, sandbox, dict(services or {})
        self._actors: list[ray.actor.ActorHandle] = []
        self.resize(sandbox.evaluators)

    def resize(self, n: int) -> None:
        if n <= 0:
            raise ValueError(f"an evaluator pool needs at least one evaluator, got {n}")
        while len(self._actors) < n:
            self._actors.append(
                SandboxEvaluator.options(num_cpus=0.25, scheduling_strategy=CLUSTER).remote(
                    self._domain, self._policy, self._cfg.model_dump(), self._services)
            )
        for actor in self._actors[n:]:
            ray.kill(actor)
        del self._actors[n:]

    @property
    def size(self) -> int:
        return len(self._actors)

    def submit(self, harness_source: str, harness_name: str, jobs: list[EpisodeJob]) -> list[tuple[int, ray.ObjectRef]]:
        """Returns (offset of the chunk's first job, ref to its results) pairs."""
        chunk = self._cfg.slots
        refs = []
        for i, start in enumerate(range(0, len(jobs), chunk)):
            actor = self._actors[i % len(self._actors)]
            refs.append((start, actor.run_episodes.remote(harness_source, harness_name, jobs[start:start + chunk])))
        return refs
