"""SandboxEvaluator: runs episodes of a harness, each in its own sandboxed subprocess.

An evaluator owns `slots` concurrent sandboxes; the pool spreads chunks of episodes over its
evaluators and can grow or shrink between phases (elastic rollouts).
"""

from __future__ import annotations

import logging
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import ray

from whale_ray.config import SandboxConfig
from whale_ray.domain import get_domain
from whale_ray.records import EpisodeJob, EpisodeResult, ModelCall, SamplingParams
from whale_ray.resources import ResourcesConfig, RoleResources
from whale_ray.sandbox import GenerateFn, SandboxLimits, run_episode
from whale_ray.sandbox.runner import MAX_ERROR_REASON

log = logging.getLogger(__name__)

# A run's actors are placed anywhere on the cluster, never inside a caller's placement group (a Tune
# trial's, say), whose reservation was not sized for them.
CLUSTER = "DEFAULT"


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
        futures = [self._executor.submit(self._one, harness_source, harness_name, job) for job in jobs]
        return [f.result() for f in futures]

    def _one(self, harness_source: str, harness_name: str, job: EpisodeJob) -> EpisodeResult:
        """One episode. Defence in depth: whatever raises on the trusted side for this episode (its domain's
        episode tools, the policy callback, a host bug) becomes this episode's `sandbox_error` with the
        traceback in its reason, and the other episodes of the chunk, the phase and the run go on."""
        t0 = time.monotonic()
        try:
            return run_episode(
                harness_source, job.task.public(), generate=self._generate, tools_path=self._tools_path,
                host_tools={**self._host_tools, **self._domain.episode_tools(job.task, self._services)},
                limits=self._limits, seed=job.seed, harness_name=harness_name,
            )
        except Exception:
            tb = traceback.format_exc()
            log.error("episode of task %r (seed %d) failed on the host side:\n%s", job.task.id, job.seed, tb)
            reason = f"the host failed on this episode (task {job.task.id!r}): {tb}"
            if len(reason) > MAX_ERROR_REASON:
                reason = reason[:200] + " ... " + reason[-(MAX_ERROR_REASON - 205):]
            return EpisodeResult(status="sandbox_error", reason=reason, answer=None, calls=[], events=[],
                                 wall_s=time.monotonic() - t0)


@ray.remote(max_concurrency=64)
class SandboxEvaluator:
    def __init__(self, domain: str, policy: "ray.actor.ActorHandle", sandbox: SandboxConfig,
                 services: dict[str, Any] | None = None):
        cfg = sandbox

        def generate(messages: list[dict[str, str]], sampling: SamplingParams) -> ModelCall:
            return ray.get(policy.generate.remote(messages, sampling))

        self._runner = EpisodeRunner(domain, generate, SandboxLimits.from_config(cfg), cfg.slots, services)

    def run_episodes(self, harness_source: str, harness_name: str, jobs: list[EpisodeJob]) -> list[EpisodeResult]:
        return self._runner.run_episodes(harness_source, harness_name, jobs)


class EvaluatorPool:
    """Spreads episodes over SandboxEvaluator actors in chunks of one evaluator's slot count."""

    def __init__(self, domain: str, policy: "ray.actor.ActorHandle", sandbox: SandboxConfig,
                 services: dict[str, Any] | None = None, resources: RoleResources | None = None):
        """`services` are the domain's shared trusted services (Domain.start_services), given to every evaluator;
        `resources` each evaluator's (config resources.evaluator)."""
        self._domain, self._policy, self._cfg, self._services = domain, policy, sandbox, dict(services or {})
        self._resources = (resources or ResourcesConfig().evaluator).options()
        self._actors: list[ray.actor.ActorHandle] = []
        self.resize(sandbox.evaluators)

    def resize(self, n: int) -> None:
        if n <= 0:
            raise ValueError(f"an evaluator pool needs at least one evaluator, got {n}")
        while len(self._actors) < n:
            self._actors.append(
                SandboxEvaluator.options(**self._resources, scheduling_strategy=CLUSTER).remote(
                    self._domain, self._policy, self._cfg, self._services)
            )
        for actor in self._actors[n:]:
            ray.kill(actor)
        del self._actors[n:]

    @property
    def size(self) -> int:
        return len(self._actors)

    @property
    def actors(self) -> list["ray.actor.ActorHandle"]:
        return list(self._actors)

    def run(self, work: list[Any], on_done: Any) -> list[list[EpisodeResult]]:
        """Every job of every `whale_ray.loop.EpisodeWork` item, all submitted at once; `on_done(n)` per chunk."""
        submitted = [self.submit(w.harness_source, w.harness_name, w.jobs) for w in work]
        results: list[list[Any]] = [[None] * len(w.jobs) for w in work]
        owner = {ref: (i, start) for i, refs in enumerate(submitted) for start, ref in refs}
        while owner:
            ready, _ = ray.wait(list(owner), num_returns=1)
            i, start = owner.pop(ready[0])
            chunk = ray.get(ready[0])
            results[i][start:start + len(chunk)] = chunk
            on_done(len(chunk))
        return results

    def submit(self, harness_source: str, harness_name: str, jobs: list[EpisodeJob]) -> list[tuple[int, ray.ObjectRef]]:
        """Returns (offset of the chunk's first job, ref to its results) pairs."""
        chunk = self._cfg.slots
        refs = []
        for i, start in enumerate(range(0, len(jobs), chunk)):
            actor = self._actors[i % len(self._actors)]
            refs.append((start, actor.run_episodes.remote(harness_source, harness_name, jobs[start:start + chunk])))
        return refs
