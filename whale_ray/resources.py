"""Where a run's actors and files go on a cluster: each role's Ray resources, the feasibility check made
before any actor is created, and the shared storage of the run directory and the embedded-policy cache.

    resources:                        # per actor (per Ray Train worker for the trainer), as in ScalingConfig
      policy_server: {num_cpus: 1, num_gpus: 1}
      trainer_worker: {num_cpus: 2, num_gpus: 1}
      evaluator: {num_cpus: 1, resources: {evaluator_node: 0.01}}
      retriever: {num_cpus: 1}
    storage: /mnt/whale               # a path every node mounts: run_dir (if relative) and the cache go there

The defaults are what a single machine has always used; a role that no node of the cluster could ever hold
is one error naming the role, before anything starts, rather than an actor that waits for ever.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, Field


class ResourceError(RuntimeError):
    """The cluster can never satisfy a role's resources (or can't be reached); one line naming what."""


class RoleResources(BaseModel):
    """One actor's resources, as Ray's `.options(num_cpus=, num_gpus=, resources=)` take them."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
    num_cpus: float = Field(0.0, ge=0)
    num_gpus: float = Field(0.0, ge=0)
    resources: dict[str, float] = Field(default_factory=dict)  # custom resources ("accelerator_type:H100": 0.01)

    def options(self) -> dict[str, Any]:
        out: dict[str, Any] = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        if self.resources:
            out["resources"] = dict(self.resources)
        return out

    def bundle(self) -> dict[str, float]:
        """As a placement bundle / Ray Train `resources_per_worker` (zero amounts left out)."""
        out = {"CPU": self.num_cpus, **({"GPU": self.num_gpus} if self.num_gpus else {}), **self.resources}
        return {k: v for k, v in out.items() if v > 0 or k == "CPU"}


def _role(**kwargs: Any) -> Any:
    return Field(default_factory=lambda: RoleResources(**kwargs))


class ResourcesConfig(BaseModel):
    """Each role's resources. Defaults: the single-machine placement whale-ray has always used (the
    evaluators' and the trainer workers' fractions leave room for each other on a 2-core machine)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
    policy_server: RoleResources = _role(num_cpus=1)
    # per Ray Train worker; with weight.use_gpu and num_gpus 0 a worker takes one whole GPU (ScalingConfig's rule)
    trainer_worker: RoleResources = _role(num_cpus=0.5)
    evaluator: RoleResources = _role(num_cpus=0.25)  # per SandboxEvaluator; its sandboxes run in its slots
    retriever: RoleResources = _role()  # search_qa's index
    proposer: RoleResources = _role()  # HarnessProposer (an API client or a jailed agent CLI)
    # False skips the feasibility check, for an autoscaling cluster whose matching nodes join on demand
    check_feasible: bool = True


class Placement:
    """Where a run's actors go; every actor of a run gets its `.options()` from here.

    The default places each actor anywhere on the cluster by its role's resources, never inside a caller's
    placement group (a Tune trial's, say, whose reservation was not sized for it). A sweep hands the
    Coordinator a subclass that puts the trial's actors in the trial's own placement group instead."""

    pins_nodes = True  # on_node works: an elastic evaluator pool can grow node by node (not in a placement group)

    def options(self, role: str, resources: RoleResources) -> dict[str, Any]:
        """`.options()` for one actor of `role` (a key of ResourcesConfig); evaluators spread over the nodes."""
        return {**resources.options(), "scheduling_strategy": "SPREAD" if role == "evaluator" else "DEFAULT"}

    def on_node(self, role: str, resources: RoleResources, node_id: str) -> dict[str, Any]:
        """`.options()` pinning one actor to a node (the elastic evaluator pool grows node by node); only where
        `pins_nodes` (a placement group's bundles are where they are)."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        return {**resources.options(), "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False)}


def role_demands(cfg: Any, trains: bool, cpus: float | None = None) -> dict[str, tuple[int, dict[str, float]]]:
    """role -> (how many actors, one actor's bundle), for the roles this run starts (`trains`: the schedule
    has a weight phase, so Trainer workers) on a cluster of `cpus` CPUs (needed where the evaluators are
    counted from them, `sandbox.evaluators: cores`)."""
    from whale_ray.domain import get_domain

    r: ResourcesConfig = cfg.resources
    out = {"policy_server": (cfg.policy.replicas, r.policy_server.bundle()),
           "evaluator": (cfg.sandbox.pool_bounds(cpus)[0], r.evaluator.bundle()), "proposer": (1, r.proposer.bundle())}
    if trains:
        out["trainer_worker"] = (cfg.weight.num_workers, trainer_bundle(r, cfg.weight.use_gpu))
    for role in get_domain(cfg.domain).service_roles:  # search_qa's retriever, say
        out[role] = (1, getattr(r, role).bundle())
    return out


def trainer_bundle(r: ResourcesConfig, use_gpu: bool) -> dict[str, float]:
    bundle = r.trainer_worker.bundle()
    if use_gpu:
        bundle.setdefault("GPU", 1.0)
    return bundle


def infeasible(demands: dict[str, tuple[int, dict[str, float]]], nodes: list[dict[str, float]]) -> str | None:
    """Why the cluster's alive nodes (their total resources) can never hold these roles, or None. Two
    necessary conditions: each actor fits on one node, and all of them fit in the cluster's totals (every
    role is alive during a weight phase)."""
    for role, (_, bundle) in demands.items():
        if not any(all(node.get(k, 0.0) >= v for k, v in bundle.items()) for node in nodes):
            largest = max(nodes, key=lambda n: n.get("CPU", 0.0), default={})
            have = {k: largest.get(k, 0.0) for k in bundle}
            return (f"resources.{role} asks for {_fmt(bundle)} per actor, but no node of the cluster has that "
                    f"({len(nodes)} node(s); the largest has {_fmt(have)})")
    total: dict[str, float] = {}
    for node in nodes:
        for k, v in node.items():
            total[k] = total.get(k, 0.0) + v
    need: dict[str, float] = {}
    for count, bundle in demands.values():
        for k, v in bundle.items():
            need[k] = need.get(k, 0.0) + count * v
    short = {k: v for k, v in need.items() if v > total.get(k, 0.0) + 1e-9}
    if short:
        parts = ", ".join(f"{k} {v:g} of {total.get(k, 0.0):g}" for k, v in short.items())
        spread = "; ".join(f"{role} {n} x {_fmt(b)}" for role, (n, b) in demands.items() if set(b) & set(short))
        return f"the run's actors need more than the cluster has: {parts} ({spread})"
    return None


def check_cluster(cfg: Any, trains: bool) -> None:
    """Raises ResourceError if the connected Ray cluster can never place this run's actors."""
    import ray

    if not cfg.resources.check_feasible:
        return
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    if why := infeasible(role_demands(cfg, trains, sum(n.get("CPU", 0.0) for n in nodes)), nodes):
        raise ResourceError(why + " (change the resources: section, or set resources.check_feasible: false for "
                            "an autoscaling cluster)")


def _fmt(bundle: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in bundle.items()) + "}" if bundle else "nothing"


# ------------------------------------------------------------------------------------------ storage
PYARROW_SCHEMES = ("s3", "gs", "gcs", "hdfs", "viewfs", "abfs", "abfss", "az", "mock")


def storage_root(storage: Optional[str]) -> Optional[Path]:
    """The local directory of a `storage:` setting: a path, or a file:// URI (read by pyarrow). Other pyarrow
    filesystems (s3://, gs://, ...) are rejected with a clear error: the run directory is written with plain
    file operations (atomic renames), so it needs a filesystem every node mounts (NFS, a ReadWriteMany PVC)."""
    if storage is None:
        return None
    if "://" not in storage:
        return Path(storage).expanduser()
    scheme = storage.split("://", 1)[0].lower()
    if scheme != "file":  # told apart by scheme: opening s3:// or gs:// would already reach the network
        kind = "a pyarrow filesystem URI" if scheme in PYARROW_SCHEMES else "not a path or a known filesystem URI"
        raise ValueError(f"{storage!r}: {kind}, and only local storage is supported yet; give a path that every "
                         "node mounts (NFS, a ReadWriteMany volume), or a file:// URI")
    import pyarrow.fs

    try:
        _, path = pyarrow.fs.FileSystem.from_uri(storage)
    except Exception as e:  # pyarrow.lib.ArrowInvalid
        raise ValueError(f"{storage!r}: not a file:// URI pyarrow can read ({e})") from None
    return Path(path)


def resolve_run_dir(run_dir: Path, storage: Optional[str]) -> Path:
    """A relative run_dir lives under the storage root when one is set; an absolute one stays as given."""
    root = storage_root(storage)
    run_dir = Path(run_dir).expanduser()
    return (root / run_dir if root is not None and not run_dir.is_absolute() else run_dir).resolve()


def cache_dir(storage: Optional[str]) -> Optional[Path]:
    """Where the embedded policies are built: <storage>/cache, unless $WHALE_CACHE says otherwise."""
    root = storage_root(storage)
    return None if root is None else root / "cache"
