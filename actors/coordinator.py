"""Coordinator: starts the run's long-lived actors and hosts the WHALE loop (whale_ray.loop) over them.

The loop is library code handed its roles; here each role is a Ray actor behind a thin adapter that waits
for results, except for weights, which travel from the Trainer to the PolicyServer as an object ref.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import ray

from actors.harness_proposer import HarnessProposer
from actors.policy_server import PolicyServer
from actors.sandbox_evaluator import CLUSTER, EvaluatorPool
from actors.trainer import Trainer
from whale_ray.config import WhaleConfig
from whale_ray.domain import get_domain
from whale_ray.loop import Roles, RunDirectory, WhaleLoop
from whale_ray.proposers.registry import proposer_options
from whale_ray.resources import check_cluster, trainer_bundle
from whale_ray.run_state import CycleRow
from whale_ray.schedules import has_phase

log = logging.getLogger(__name__)


class _Remote:
    """An actor handle as the plain object the loop calls: a method call returns its result, except the
    methods named in `by_ref`, which return the object ref (so weights go actor to actor, not via here)."""

    def __init__(self, handle: "ray.actor.ActorHandle", by_ref: tuple[str, ...] = ()):
        self.handle, self._by_ref = handle, by_ref

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self.handle, name)
        if name in self._by_ref:
            return lambda *args, **kwargs: method.remote(*args, **kwargs)
        return lambda *args, **kwargs: ray.get(method.remote(*args, **kwargs))


class Coordinator:
    def __init__(self, cfg: WhaleConfig, base_model: str):
        self.cfg = cfg
        schedule_trains = has_phase(cfg, "weight")
        check_cluster(cfg, schedule_trains)  # a role no node can hold is an error now, not an actor pending for ever
        run = RunDirectory(cfg.run_dir)
        domain = get_domain(cfg.domain)
        splits = domain.load_splits(cfg.data, cfg.seed)
        state = run.state
        p = cfg.policy
        # The PolicyServer starts at the latest weights on record, the Trainer from the same checkpoint.
        model = str(run.root / state.checkpoint) if state.checkpoint else base_model
        res = cfg.resources
        self.policy = PolicyServer.options(**res.policy_server.options(), scheduling_strategy=CLUSTER).remote(
            model, engine=p.engine, max_batch=p.max_batch, batch_wait_ms=p.batch_wait_ms,
            version=state.weight_version, device=p.device, dtype=p.dtype, seed=cfg.seed)
        self.services = domain.start_services(cfg, splits)
        self.pool = EvaluatorPool(cfg.domain, self.policy, cfg.sandbox, self.services, resources=res.evaluator)
        self.trainer = None
        if schedule_trains:
            self.trainer = Trainer.options(num_cpus=0, scheduling_strategy=CLUSTER).remote(
                base_model, cfg.weight, str(run.root / "trainer"), seed=cfg.seed,
                resources_per_worker=trainer_bundle(res, cfg.weight.use_gpu))
            if state.checkpoint:
                ray.get(self.trainer.load_checkpoint.remote(str(run.root / state.checkpoint)))
        self.proposer = HarnessProposer.options(**res.proposer.options(), scheduling_strategy=CLUSTER).remote(
            cfg.harness_phase.proposer, domain.skill_text, cfg.seed, **proposer_options(cfg.harness_phase))
        roles = Roles(policy=_Remote(self.policy), pool=self.pool, proposer=_Remote(self.proposer),
                      trainer=_Remote(self.trainer, by_ref=("latest_weights",)) if self.trainer else None)
        self.loop = WhaleLoop(cfg, roles, run, domain, splits)

    def run(self, on_cycle: Callable[[CycleRow], None] | None = None) -> list[CycleRow]:
        """Runs (or resumes) the schedule; however it ends, the run's actors and their CPUs/GPUs are given
        back at once (the next trial of a sweep, or the next run of this process, needs them)."""
        try:
            return self.loop.run(on_cycle)
        finally:
            self.shutdown()

    def snapshot(self) -> dict[str, Any]:
        state = self.loop.state
        return {"progress": self.loop.progress.snapshot(), "history": [r.model_dump() for r in state.history],
                "ledger": state.ledger.model_dump(), "phase_wall_s": dict(state.phase_wall_s),
                "best": state.best.model_dump() if state.best else None}

    def shutdown(self) -> None:
        """Ends the run's actors. The Trainer first ends its Ray Train run, whose workers' placement group a
        plain kill of the Trainer would leave reserved. Idempotent."""
        if self.trainer is not None:
            try:
                ray.get(self.trainer.shutdown.remote(), timeout=120)
            except (ray.exceptions.RayError, TimeoutError) as e:  # already dead, or stuck: killed below
                log.warning("Trainer shutdown: %s", e)
        for actor in [self.policy, self.proposer, self.trainer, *self.pool.actors, *self.services.values()]:
            if isinstance(actor, ray.actor.ActorHandle):
                ray.kill(actor)


@ray.remote(num_cpus=0, max_concurrency=4)
class CoordinatorActor:
    """The design card's Coordinator actor: run() works in one thread while snapshot() answers the driver."""

    def __init__(self, cfg: WhaleConfig, base_model: str):
        self._coordinator = Coordinator(cfg, base_model)

    def run(self) -> list[dict[str, Any]]:
        return [r.model_dump() for r in self._coordinator.run()]

    def snapshot(self) -> dict[str, Any]:
        return self._coordinator.snapshot()
