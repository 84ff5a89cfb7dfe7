"""The Ray Tune side of a sweep: the Tuner (new, or restored from the sweep's root), its searcher, its ASHA
scheduler on training rollouts, and how many trials run side by side."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from ray.tune.schedulers import ASHAScheduler

from whale_ray.sweep.space import SweepConfig, edge_configs
from whale_ray.sweep.trial import _bundles, run_trial, train_footprint, trial_resources

EXPERIMENT = "whale-sweep"
TIME_ATTR = "training_rollouts"  # ASHA's clock: weight + harness rollouts spent so far


class PersistentASHA(ASHAScheduler):
    """Tune's ASHA, saving its rungs after every decision: Ray 2.60 checkpoints an experiment's searcher but not
    its scheduler (tune_controller.save_to_dir), so a restored sweep would forget every trial's rung values and
    stop nothing. This uses ASHA's own save/restore."""

    def __init__(self, path: Path, **kwargs: Any):
        super().__init__(**kwargs)
        self._path = str(path)

    def __setstate__(self, state: dict) -> None:
        """Unpickled from the Tuner's state (a restored sweep): the rungs as last saved, not as first pickled."""
        self.__dict__.update(state)
        if Path(self._path).is_file():
            path = self._path
            self.restore(path)
            self._path = path

    def _save(self) -> None:
        tmp = self._path + ".tmp"
        self.save(tmp)
        os.replace(tmp, self._path)

    def on_trial_result(self, tune_controller: Any, trial: Any, result: dict) -> str:
        action = super().on_trial_result(tune_controller, trial, result)
        self._save()
        return action

    def on_trial_complete(self, tune_controller: Any, trial: Any, result: dict) -> None:
        super().on_trial_complete(tune_controller, trial, result)
        self._save()

    def on_trial_add(self, tune_controller: Any, trial: Any) -> None:
        if trial.trial_id not in self._trial_info:  # a restored trial keeps its bracket
            super().on_trial_add(tune_controller, trial)


def auto_concurrency(sweep: SweepConfig, cluster: dict[str, float]) -> int:
    """How many trials the cluster holds side by side: its totals over the largest trial's placement group plus
    its Train workers (which Train reserves in a group of its own; see whale_ray.sweep.trial)."""
    need: dict[str, float] = {}
    for cfg in edge_configs(sweep):
        one: dict[str, float] = dict(train_footprint(cfg))
        for _, bundle in _bundles(cfg):
            for k, v in bundle.items():
                one[k] = one.get(k, 0.0) + v
        for k, v in one.items():
            need[k] = max(need.get(k, 0.0), v)
    fits = [math.floor(cluster.get(k, 0.0) / v + 1e-9) for k, v in need.items() if v > 0]
    return max(1, min(fits, default=1))


def make_tuner(sweep: SweepConfig, root: Path, base_model: str, naming: str = "index") -> Any:
    """A Tuner over the sweep; restored when the root holds one, so a relaunch reruns no finished or stopped
    trial and restarts the running ones (which resume from their run directories)."""
    import ray
    from ray import tune

    # The experiment's trial table is saved every second (Tune's default is at most every 10 s), so a sweep
    # killed just after a trial ended does not start that trial again on relaunch.
    os.environ.setdefault("TUNE_GLOBAL_CHECKPOINT_S", "1")
    root = Path(root).resolve()
    trainable = tune.with_resources(run_trial, trial_resources)
    experiment = root / "tune" / EXPERIMENT
    scheduler = None
    if sweep.scheduler.kind == "asha":
        s = sweep.scheduler
        # metric and mode on the scheduler (and searcher), not the TuneConfig: a restored Tuner brings them back
        # set, and Tune refuses them given twice
        scheduler = PersistentASHA(root / "tune" / "asha.pkl", time_attr=TIME_ATTR, max_t=s.max_rollouts,
                                   grace_period=s.grace_rollouts, reduction_factor=s.reduction_factor,
                                   metric=sweep.metric, mode="max")
    if tune.Tuner.can_restore(str(experiment)):  # the scheduler comes back from the Tuner's own pickle
        return tune.Tuner.restore(str(experiment), trainable, resume_unfinished=True, resume_errored=True,
                                  param_space=param_space(sweep, root, base_model, naming))
    concurrent = sweep.max_concurrent_trials
    if concurrent == "auto":
        concurrent = auto_concurrency(sweep, ray.cluster_resources())
    search = sweep.search
    if search.kind == "random":  # Tune's own generator: grids, points and random sampling, seeded
        from ray.tune.search import BasicVariantGenerator

        searcher: Any = BasicVariantGenerator(random_state=search.seed, max_concurrent=concurrent)
        concurrent = None  # the generator limits itself; Tune ignores (and warns about) the other limit
    else:
        searcher = tune.search.create_searcher(search.kind, metric=sweep.metric, mode="max", seed=search.seed,
                                               random_state_seed=search.seed)
    tune_config = tune.TuneConfig(num_samples=sweep.num_samples, max_concurrent_trials=concurrent,
                                  scheduler=scheduler, search_alg=searcher)
    return tune.Tuner(trainable, param_space=param_space(sweep, root, base_model, naming), tune_config=tune_config,
                      run_config=tune.RunConfig(name=EXPERIMENT, storage_path=str(root / "tune"), verbose=0,
                                                failure_config=tune.FailureConfig(max_failures=0)))


def param_space(sweep: SweepConfig, root: Path, base_model: str, naming: str) -> dict[str, Any]:
    from whale_ray.config import dotted_keys

    space: dict[str, Any] = {"base": dotted_keys(sweep.base), "root": str(root), "cwd": os.getcwd(),
                             "model": base_model, "naming": naming}
    if points := sweep.point_overrides():
        from ray import tune

        space["point"] = tune.grid_search(points)
    if sweep.space:
        space["space"] = {key: dist.to_tune() for key, dist in sweep.space.items()}
    return space
