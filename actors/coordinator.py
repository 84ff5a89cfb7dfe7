"""Coordinator: starts the run's long-lived actors and hosts the WHALE loop (whale_ray.loop) over them.

The loop is library code handed its roles; here each role is a Ray actor behind a thin adapter that waits
for results, except for weights: the loop hands each new version to the run's weight sync, one object per
`weight.weight_sync` mode that owns both ends of the hand-off, the Trainer's and every PolicyServer replica's
(actors/weight_sync.py, actors/broadcast_sync.py). Each new version is on every replica before the loop goes
on, and every evaluator sends each model call to the replica it waits on least.

Faults, in two layers (each written to `<run_dir>/events.jsonl`):
1. absorbed where they happen: the pool redoes the episodes of a lost evaluator or node and replaces it
   (actors/evaluator_pool.py); Ray restarts the PolicyServer, the Trainer and the Retriever and sends their
   calls in flight again, and they come back at the latest weights (a restarted PolicyServer holds its calls
   until the weight sync, at the pool's next poll, brings it there: actors/policy_server.py; trainer.py);
   the Trainer starts a new Ray Train run after a lost worker and takes the step again.
2. anything else that kills a role mid-call (restarts used up, a Trainer back at an older version): the
   run goes back to its last commit and goes on in the same launch, with every actor started afresh,
   exactly as a relaunch would resume it: nothing is lost and nothing counted twice.
An actor whose constructor fails is not a fault when the failure is the input's (actors/start_failure.py): a
bad-input error, or the same error on two starts in a row, ends the run at once with `StartFailed`, one line
naming the input, before the run directory records a run.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import ray
from ray.exceptions import ActorUnavailableError, ObjectLostError, RayActorError

from actors.broadcast_sync import BroadcastSync
from actors.evaluator_pool import EvaluatorPool
from actors.harness_proposer import HarnessProposer
from actors.policy_server import start_policy_servers
from actors.sandbox_evaluator import PolicyLost
from actors.start_failure import StartFailure, start_failure
from actors.trainer import StaleTrainer, Trainer
from actors.weight_sync import CudaIpcSync, ObjectStoreSync
from whale_ray.config import WhaleConfig
from whale_ray.domain import get_domain
from whale_ray.events import EventLog
from whale_ray.launch import InputError
from whale_ray.loop import Roles, RunDirectory, WhaleLoop
from whale_ray.loop.whale import trains_again
from whale_ray.policy.weight_broadcast import WeightBroadcastError
from whale_ray.proposers.registry import proposer_options
from whale_ray.resources import Placement, RoleResources, check_cluster, trainer_bundle
from whale_ray.rsft_defaults import resolve_run_config
from whale_ray.run_state import CycleRow
from whale_ray.schedules import has_phase, plan

log = logging.getLogger(__name__)

# A role lost mid-call: roll back to the last commit and go on (layer 2 above). ObjectLostError: the weights a
# Trainer worker put died with it before every server had read them.
FAULTS = (RayActorError, ActorUnavailableError, ObjectLostError, StaleTrainer, PolicyLost, WeightBroadcastError)


class StartFailed(InputError):
    """An actor of the run cannot start on its input (a bad-input error, or the same error on two starts in a
    row); the message is one line naming it. `whale run` prints it and exits 2."""


class _Remote:
    """An actor handle as the plain object the loop calls: a method call returns its result."""

    def __init__(self, handle: "ray.actor.ActorHandle"):
        self.handle = handle

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self.handle, name)
        return lambda *args, **kwargs: ray.get(method.remote(*args, **kwargs))


def make_weight_sync(cfg: WhaleConfig, trainer: "ray.actor.ActorHandle | None", servers: list["ray.actor.ActorHandle"],
                     version: int, events: EventLog) -> ObjectStoreSync:
    """The weight sync of the run's `weight.weight_sync` mode (actors/weight_sync.py), from `version` on."""
    w, p = cfg.weight, cfg.policy
    sleeps = p.engine == "vllm" and p.sleep_level > 0
    mode = w.sync_mode if trainer is not None else "object_store"  # without a Trainer nothing is ever pushed
    if mode == "broadcast":
        return BroadcastSync(trainer, servers, version=version, cfg=w.broadcast, use_gpu=w.use_gpu, sleeps=sleeps,
                             events=events)
    sync = CudaIpcSync if mode == "cuda_ipc" else ObjectStoreSync
    return sync(trainer, servers, version=version, sleeps=sleeps)


class Coordinator:
    def __init__(self, cfg: WhaleConfig, base_model: str, placement: Placement | None = None):
        """`placement` puts every actor of the run (default: anywhere on the cluster by its role's resources)."""
        # the optimiser's settings the config leaves to the run: the run's recorded ones, else chosen for the checkpoint
        self.cfg = resolve_run_config(cfg, base_model, RunDirectory(cfg.run_dir).recorded_config())
        self.base_model = base_model
        self.placement = placement or Placement()
        self.trains = has_phase(cfg, "weight")
        check_cluster(self.cfg, self.trains)  # a role no node can hold is an error now, not an actor pending for ever
        self.events = EventLog(cfg.run_dir)
        self.domain = get_domain(cfg.domain)
        self.splits = self.domain.load_splits(cfg.data, cfg.seed)
        self.recoveries = 0
        self.pool: EvaluatorPool | None = None  # kept across a roll-back for the cluster it last saw
        self.loop: WhaleLoop | None = None
        self._last_start_failure: StartFailure | None = None
        self._start()

    def _start(self) -> None:
        """The run's actors, at the run directory's last commit, and a loop over them."""
        cfg, place, res = self.cfg, self.placement, self.cfg.resources
        run = RunDirectory(cfg.run_dir)
        state, p = run.state, cfg.policy
        restarts = {"max_restarts": cfg.faults.actor_restarts, "max_task_retries": cfg.faults.actor_restarts}
        # The Trainer and the PolicyServer start at the latest checkpoint on record (the loop trains on from there
        # to the record's weight version if the last one was still being written: weight_phase.retrain_unsaved_steps).
        checkpoint = str(run.root / state.checkpoint) if state.checkpoint else None
        self.trainer, trainer_ready, loaded, self._trainer_start = None, None, None, None
        if self.trains:
            self.trainer = Trainer.options(**place.options("trainer", RoleResources()), **restarts).remote(
                self.base_model, cfg.weight, str(run.root / "trainer"), seed=cfg.seed,
                resources_per_worker=trainer_bundle(res, cfg.weight.use_gpu), events_dir=str(run.root),
                policy_gpu_share=p.gpu_memory_utilization * p.replicas if p.engine == "vllm" and p.sleep_level else 0)
            # Its Ray Train run (a chain of process starts: seconds) starts now, beside the other actors' starts and
            # the first evaluation. The actor runs one call at a time: its readiness is asked for first, so that a
            # constructor's error does not wait behind that start; a checkpoint is only recorded before it.
            trainer_ready = self.trainer.__ray_ready__.options(max_task_retries=0).remote()
            loaded = self.trainer.load_checkpoint.remote(checkpoint) if checkpoint else None
            if trains_again(plan(cfg), state):
                self._trainer_start = self.trainer.start_workers.options(max_task_retries=0).remote()
        self.policies = start_policy_servers(cfg, checkpoint or self.base_model, place,
                                             version=state.checkpoint_version, events_dir=str(run.root), **restarts)
        self.sync = make_weight_sync(cfg, self.trainer, self.policies, state.checkpoint_version, self.events)
        self.services = self.domain.start_services(cfg, self.splits, place)
        reserve = {}
        if self.trains:  # an elastic pool leaves the Trainer's workers room to start again in the next phase
            for k, v in trainer_bundle(res, cfg.weight.use_gpu).items():
                reserve[k] = v * cfg.weight.num_workers
        seen = self.pool.known_nodes if self.pool is not None else None
        self.pool = EvaluatorPool(cfg.domain, self.policies, cfg.sandbox, self.services, resources=res.evaluator,
                                  placement=place, events=self.events, reserve=reserve, poll_s=cfg.faults.poll_s,
                                  nodes=seen, on_poll=self.sync.follow_restarts)
        self.proposer = HarnessProposer.options(**place.options("proposer", res.proposer), max_restarts=0).remote(
            cfg.harness_phase.proposer, self.domain.skill_text, cfg.seed, **proposer_options(cfg.harness_phase))
        roles = Roles(pool=self.pool, proposer=_Remote(self.proposer),
                      trainer=_Remote(self.trainer) if self.trains else None, weights=self.sync if self.trains else None)
        # each actor to wait for, named, with what it was started on (a start failure's line names it)
        starting = [("Trainer", self.trainer, self.base_model, trainer_ready)] if self.trainer is not None else []
        starting += [("PolicyServer", h, checkpoint or self.base_model, None) for h in self.policies]
        starting += [("HarnessProposer", self.proposer, None, None),
                     *((n, h, None, None) for n, h in self.services.items())]
        self._starting = (starting, run, roles, loaded)

    def _await_start(self) -> None:
        """Waits for the actors `_start` made to be constructed, so that a constructor's error surfaces here, named
        (StartFailure), not in whichever call first reaches the dead actor; then the Trainer takes the weights on
        record and the loop is made (a run directory that holds no run yet gets its config.yaml now)."""
        starting, run, roles, loaded = self._starting
        for role, handle, given, ready in starting:
            if not isinstance(handle, ray.actor.ActorHandle):
                continue
            try:  # no retries: a constructor's error is final, and a retry would print it once more
                ray.get(ready or handle.__ray_ready__.options(max_task_retries=0).remote())
            except RayActorError as e:
                failure = start_failure(role, e, given)
                if failure is None:
                    raise
                raise failure from None
        self._last_start_failure = None
        if loaded is not None:
            ray.get(loaded)
        self.loop = WhaleLoop(self.cfg, roles, run, self.domain, self.splits)

    def run(self, on_cycle: Callable[[CycleRow], None] | None = None) -> list[CycleRow]:
        """Runs (or resumes) the schedule, riding out lost actors (see the module docstring); however it ends,
        the run's actors and their CPUs/GPUs are given back at once (a sweep's next trial needs them)."""
        try:
            while True:
                try:
                    if self.loop is None:
                        rolled_back = self._starting is None
                        if rolled_back:
                            self._start()
                        self._await_start()
                        if rolled_back:
                            self.events.emit("recovered", "the run's actors are up again at the last commit",
                                             weight_version=self.loop.state.weight_version)
                    return self.loop.run(on_cycle)
                except StartFailure as e:
                    self._start_failed(e)
                except FAULTS as e:
                    self._roll_back(e)
        finally:
            self.shutdown()

    def _start_failed(self, failure: StartFailure) -> None:
        """Ends the run if the failure is the input's (see the module docstring), else rolls back as for a fault."""
        repeated = failure.same_as(self._last_start_failure)
        if failure.is_input_error or repeated:
            line = failure.line(repeated)
            self.events.emit("start_failed", line, actor=failure.role, error=failure.type_name, input=failure.input)
            raise StartFailed(line) from None
        self._last_start_failure = failure
        self._roll_back(failure)

    def _roll_back(self, fault: BaseException) -> None:
        cause = getattr(fault, "cause", None) or fault  # a RayTaskError names the actor's own exception
        what = f"{type(cause).__name__}: {(str(cause).splitlines() or [''])[0][:300]}"
        where = self.loop.progress.snapshot() if self.loop is not None else {"cycle": None, "phase": "starting"}
        self.recoveries += 1
        if self.recoveries > self.cfg.faults.max_recoveries:
            self.events.emit("gave_up", f"{what}; {self.cfg.faults.max_recoveries} recoveries "
                             "used up (faults.max_recoveries): the run stops here and resumes when relaunched",
                             cycle=where["cycle"], phase=where["phase"])
            raise fault
        self.events.emit("rolled_back", f"{what}; the run goes back to its last commit and "
                         f"goes on with fresh actors (recovery {self.recoveries} of {self.cfg.faults.max_recoveries})",
                         cycle=where["cycle"], phase=where["phase"], error=type(cause).__name__)
        self.shutdown()
        self.loop = self._starting = None

    def snapshot(self, events_after: int = 0) -> dict[str, Any]:
        if self.loop is None:  # while the actors start (the first time, or after a roll-back)
            phase = "recovering" if self.recoveries else "starting"
            return {"progress": {"cycle": 0, "cycles": 0, "phase": phase, "detail": "", "done": 0, "total": 0},
                    "history": [], "ledger": {}, "phase_wall_s": {}, "best": None,
                    "events": self.events.since(events_after)}
        state = self.loop.state
        return {"progress": self.loop.progress.snapshot(), "history": [r.model_dump() for r in state.history],
                "ledger": state.ledger.model_dump(), "phase_wall_s": dict(state.phase_wall_s),
                "best": state.best.model_dump() if state.best else None, "events": self.events.since(events_after)}

    def shutdown(self) -> None:
        """Ends the run's actors. The Trainer first ends its Ray Train run, whose workers' placement group a
        plain kill of the Trainer would leave reserved, unless that run is still starting (a run that ends at its
        start): then it is killed at once, and the next Trainer's start frees the group, as for a lost Trainer.
        Idempotent."""
        starting = self._trainer_start is not None and not ray.wait([self._trainer_start], timeout=0)[0]
        if starting:
            log.warning("Trainer shutdown: its Ray Train run is still starting; the Trainer is killed")
        elif self.trainer is not None:
            try:
                ray.get(self.trainer.shutdown.remote(), timeout=120)
            except (ray.exceptions.RayError, TimeoutError) as e:  # already dead, or stuck: killed below
                log.warning("Trainer shutdown: %s", e)
        for actor in [*self.policies, self.proposer, self.trainer, *self.pool.actors, *self.services.values()]:
            if isinstance(actor, ray.actor.ActorHandle):
                ray.kill(actor, no_restart=True)
        if starting:  # its reply, the killed actor's error, taken here: Ray prints a reply no one took
            try:
                ray.get(self._trainer_start, timeout=30)
            except (ray.exceptions.RayError, TimeoutError):
                pass
        self.sync.close()


def start_coordinator(cfg: WhaleConfig, base_model: str) -> "ray.actor.ActorHandle":
    """The CoordinatorActor on the caller's node (the driver's: the head, for `ray job submit`), never on a
    worker node whose loss would take the run's loop with it."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    return CoordinatorActor.options(scheduling_strategy=here).remote(cfg, base_model)


@ray.remote(num_cpus=0, max_concurrency=4)
class CoordinatorActor:
    """The design card's Coordinator actor: run() works in one thread while snapshot() answers the driver."""

    def __init__(self, cfg: WhaleConfig, base_model: str):
        self._coordinator = Coordinator(cfg, base_model)

    def run(self) -> list[dict[str, Any]]:
        """The run's rows; a StartFailed reaches the caller as the cause of Ray's RayTaskError."""
        return [r.model_dump() for r in self._coordinator.run()]

    def snapshot(self, events_after: int = 0) -> dict[str, Any]:
        return self._coordinator.snapshot(events_after)
