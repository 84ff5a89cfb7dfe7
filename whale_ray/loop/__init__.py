"""The WHALE loop as library code: the cycle (whale.py), the weight phase, the harness phase, the rollout
path and the run directory. It is handed its roles (context.Roles), so it runs under the Coordinator actor
on a cluster and over in-process objects in tests alike."""

from whale_ray.loop.context import (
    EpisodePool,
    EpisodeWork,
    Progress,
    Proposer,
    Roles,
    RunContext,
    TrainerRole,
    WeightSync,
)
from whale_ray.loop.rollouts import episode_seed, split_metrics
from whale_ray.loop.run_dir import RunDirectory
from whale_ray.loop.whale import WhaleLoop

__all__ = ["EpisodePool", "EpisodeWork", "Progress", "Proposer", "Roles", "RunContext", "RunDirectory", "TrainerRole",
           "WeightSync", "WhaleLoop", "episode_seed", "split_metrics"]
