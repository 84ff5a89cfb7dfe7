"""One Tune trial: a full WHALE run in its own run directory, its actors reserved in the trial's placement group,
each cycle's row reported to Tune with the training rollouts spent so far (ASHA's clock).

Resources. The trial's placement group holds one bundle per actor of the run (PolicyServer, each
SandboxEvaluator, the proposer and the retriever where they ask for resources) and an empty head: the trial
function itself only waits. Ray Train's workers are not in it: Ray 2.60's Train (V2, the default) always reserves
its own placement group for the workers (train/v2/_internal/execution/worker_group/worker_group.py creates a
top-level `placement_group()` whatever group the caller runs in; only the deprecated V1 reused the caller's), and
a detached PlacementGroupCleaner removes that group when the Train controller dies, so a stopped trial frees the
workers too. A trial's footprint is therefore its placement group plus its Train workers, and
`max_concurrent_trials: auto` counts both (whale_ray.sweep.tuner), so N trials side by side always leave room
for N Train groups instead of holding every CPU in placement groups that Train cannot use.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from whale_ray.config import WhaleConfig, load_config
from whale_ray.resources import Placement, RoleResources, role_demands
from whale_ray.schedules import has_phase
from whale_ray.sweep.space import as_trial, label

LAUNCHES = "trial_launches.jsonl"  # in each trial's run directory: one line per start and end of a launch


def trial_values(params: dict[str, Any]) -> dict[str, Any]:
    """The settings this trial varies (the point's and the sampled space's), as dotted keys."""
    return {**(params.get("point") or {}), **(params.get("space") or {})}


def trial_config(params: dict[str, Any], trial_id: str = "") -> WhaleConfig:
    """The trial's run config: the base, then its values, then its run directory under the sweep's root. A sweep
    names the directory by the trial's index and values (points may repeat with num_samples); a study by its
    (condition, seed) pair, which is unique, so a relaunch finds the same directory either way."""
    values = trial_values(params)
    if params.get("naming") == "study":
        name = f"{values['condition']}-s{values['seed']}"
    else:
        name = f"{trial_id.rsplit('_', 1)[-1] or 'trial'}-{label(values)}"
    cfg = load_config(None, {**params["base"], **values, "run_dir": str(Path(params["root"]) / name)})
    cfg.run_dir = Path(cfg.run_dir).resolve()
    return as_trial(cfg)


def _bundles(cfg: WhaleConfig) -> list[tuple[str, dict[str, float]]]:
    """(role, bundle) for each actor the trial's placement group holds: every role but the Train workers, and
    none that asks for nothing (a placement group bundle must ask for something)."""
    out = []
    for role, (count, bundle) in role_demands(cfg, has_phase(cfg, "weight")).items():
        if role != "trainer_worker" and any(v > 0 for v in bundle.values()):
            out += [(role, {k: v for k, v in bundle.items() if v > 0})] * count
    return out


def trial_resources(params: dict[str, Any]) -> Any:
    """Tune's resources for a trial (tune.with_resources calls this with the trial's resolved params)."""
    from ray import tune

    return tune.PlacementGroupFactory([{}] + [b for _, b in _bundles(trial_config(params))], strategy="PACK")


def train_footprint(cfg: WhaleConfig) -> dict[str, float]:
    """What the trial's Ray Train workers hold outside its placement group, while a weight phase runs."""
    count, bundle = role_demands(cfg, True)["trainer_worker"] if has_phase(cfg, "weight") else (0, {})
    return {k: count * v for k, v in bundle.items()}


class TrialPlacement(Placement):
    """Every actor of the run in the trial's placement group: a role with a bundle in its own bundle (each
    evaluator in turn in the role's bundles), an actor that asks for nothing in any bundle. Child tasks are not
    captured: Ray Train's controller and workers go to Train's own group."""

    def __init__(self, cfg: WhaleConfig):
        from ray.util import get_current_placement_group

        self.pg = get_current_placement_group()
        self.pins_nodes = self.pg is None  # a placement group's bundles are where they are: no growing by node
        roles = [role for role, _ in _bundles(cfg)]
        offset = len(self.pg.bundle_specs) - len(roles) if self.pg is not None else 0  # a non-empty head first
        self._indices = {r: [offset + i for i, x in enumerate(roles) if x == r] for r in dict.fromkeys(roles)}
        self._next = {r: 0 for r in self._indices}

    def options(self, role: str, resources: RoleResources) -> dict[str, Any]:
        if self.pg is None:  # not inside a trial (a plain call): anywhere, as the default placement
            return super().options(role, resources)
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        index = -1
        if indices := self._indices.get(role):
            index = indices[self._next[role] % len(indices)]
            self._next[role] += 1
        strategy = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=index,
                                                    placement_group_capture_child_tasks=False)
        return {**resources.options(), "scheduling_strategy": strategy}


def placement_groups(coordinator: Any) -> dict[str, Any]:
    """Each of the run's actors -> the placement group it runs in (hex id, None outside any), asked of the actor
    itself: what launches record, so a sweep can show every actor of a trial is in the trial's group."""
    import ray

    servers = {"policy_server" + (str(i) if i else ""): a for i, a in enumerate(coordinator.policies)}
    actors = {**servers, "proposer": coordinator.proposer, "trainer": coordinator.trainer,
              **{f"evaluator{i}": a for i, a in enumerate(coordinator.pool.actors)}}
    refs = {name: actor.__ray_call__.remote(lambda _: ray.get_runtime_context().get_placement_group_id())
            for name, actor in actors.items() if actor is not None}
    return dict(zip(refs, ray.get(list(refs.values()), timeout=300)))


def _record(run_dir: Path, **event: Any) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / LAUNCHES, "a") as f:
        f.write(json.dumps({**event, "time": time.time()}) + "\n")


def run_trial(params: dict[str, Any]) -> None:
    """The Tune trainable. A run directory that holds a run is resumed (a relaunched sweep restarts the trials
    that were running). The last cycle's row is reported only once the run is finished on record: ASHA may stop
    a trial at any report (max_rollouts), and a stop at the last report must not leave a done run unfinished."""
    from ray import tune

    from actors.coordinator import Coordinator
    from whale_ray.run_state import CycleRow
    from whale_ray.tracking import track_run, trial_tracking

    if os.path.isdir(params["cwd"]):  # Tune starts trials in their own folder; relative paths are the driver's
        os.chdir(params["cwd"])  # (on another node that folder may not exist: give paths there absolute)
    trial_id = tune.get_context().get_trial_id()
    cfg = trial_config(params, trial_id)
    values = trial_values(params)
    _record(cfg.run_dir, event="start", trial_id=trial_id)
    placement = TrialPlacement(cfg)
    coordinator = Coordinator(cfg, params["model"], placement=placement)
    try:
        _record(cfg.run_dir, event="placed", trial_id=trial_id, group=placement.pg and placement.pg.id.hex(),
                actors=placement_groups(coordinator))
    except Exception as e:  # a record for the tests and the curious: never a reason to fail the trial
        _record(cfg.run_dir, event="placed", trial_id=trial_id, error=repr(e)[:300])
    reported: list[int] = []

    def report(row: CycleRow) -> None:
        ledger = coordinator.loop.state.ledger
        tune.report({**row.model_dump(exclude={"ledger"}), **values, "training_rollouts": ledger.training_rollouts,
                     "run_dir": str(cfg.run_dir)})
        reported.append(row.cycle)

    def on_cycle(row: CycleRow) -> None:
        if row.cycle < cfg.cycles:
            report(row)

    outcome = "stopped"
    experiment, tags = trial_tracking(params["root"], params.get("naming", "index"), trial_id, values)
    with track_run(cfg, experiment, tags):  # the trial as a run of the sweep's experiment, its values as tags
        try:
            history = coordinator.run(on_cycle=on_cycle)
            outcome = "finished"
        except BaseException as e:  # SystemExit is Tune stopping the trial at a report
            outcome = "stopped" if isinstance(e, SystemExit) else f"error: {e!r}"[:300]
            raise
        finally:
            _record(cfg.run_dir, event="end", outcome=outcome, trial_id=trial_id)
        try:  # each run's report page, as `whale run` writes it (whale compare links them); never a reason to fail
            from whale_ray.report import write_report

            write_report(cfg.run_dir)
        except Exception as e:  # noqa: BLE001
            _record(cfg.run_dir, event="report", error=repr(e)[:300], trial_id=trial_id)
    if history and history[-1].cycle not in reported:
        report(history[-1])  # also a finished run resumed after its last report was lost


def launches(run_dir: Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / LAUNCHES
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.is_file() else []

