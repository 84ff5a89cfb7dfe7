"""SandboxEvaluator: runs episodes of a harness, each in its own sandboxed subprocess.

An evaluator owns `slots` concurrent sandboxes; actors/evaluator_pool.py hands it chunks of episodes.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import ray

from whale_ray.config import SandboxConfig
from whale_ray.domain import get_domain
from whale_ray.records import EpisodeJob, EpisodeResult, ModelCall, SamplingParams
from whale_ray.sandbox import GenerateFn, SandboxLimits, isolation, run_episode
from whale_ray.sandbox.episode import MAX_ERROR_REASON, become_subreaper

log = logging.getLogger(__name__)


class PolicyLost(RuntimeError):
    """The PolicyServer is gone for good (Ray's restarts used up): not this episode's failure. The chunk fails,
    and the Coordinator rolls the run back to its last commit with a fresh PolicyServer."""


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
        except PolicyLost:
            raise
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
    def __init__(self, domain: str, policy: "ray.actor.ActorHandle | list[ray.actor.ActorHandle]",
                 sandbox: SandboxConfig, services: dict[str, Any] | None = None):
        """`policy`: the PolicyServer, or its replicas (policy.replicas), which hold the same weights whenever
        episodes run: each model call goes to the replica this evaluator has the fewest calls waiting on."""
        cfg = sandbox
        policies = list(policy) if isinstance(policy, (list, tuple)) else [policy]
        waiting, lock = [0] * len(policies), threading.Lock()

        def generate(messages: list[dict[str, str]], sampling: SamplingParams) -> ModelCall:
            with lock:
                i = waiting.index(min(waiting))
                waiting[i] += 1
            try:
                return ray.get(policies[i].generate.remote(messages, sampling))
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
                raise PolicyLost(f"the PolicyServer is gone: {type(e).__name__}") from e
            finally:
                with lock:
                    waiting[i] -= 1

        if cfg.isolation != "unsafe_none":
            try:
                isolation.bwrap_launcher()  # its one-time probe first: it would leave its init as our zombie
            except isolation.SetupError:
                pass  # every episode reports it as its sandbox_setup_error
        become_subreaper()  # this process runs episodes only: it reaps their sandboxes' orphaned inits
        self._runner = EpisodeRunner(domain, generate, SandboxLimits.from_config(cfg), cfg.slots, services)
        self._node = ray.get_runtime_context().get_node_id()

    def ready(self) -> str:
        """The node this evaluator runs on; answering at all means it is up."""
        return self._node

    def run_episodes(self, harness_source: str, harness_name: str, jobs: list[EpisodeJob]) -> list[EpisodeResult]:
        return [dataclasses.replace(ep, node=self._node)
                for ep in self._runner.run_episodes(harness_source, harness_name, jobs)]
