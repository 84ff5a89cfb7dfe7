"""`whale calibrate`: how often a model solves a split's tasks under a harness, before any training.

k episodes per task (each at the harness's own sampling settings) run through the same rollout path a run
uses: a PolicyServer on the model, the SandboxEvaluator pool, the sandbox, the domain's verifier in the
trusted process. The result is pass@1 and the unbiased pass@k (Chen et al. 2021) per difficulty (the
domain's `difficulty_field`, or any public task field) and overall, with what explains a low score: how
many final answers carry the domain's marker (`\\boxed{}`, `<answer>`), how many episodes had a completion
cut at max_tokens, ran out of turns, or failed (status other than ok), and the domain's own metrics.

RSFT needs accepted samples: pass@k on D_weight under h0 says whether the weight phase has anything to
train on, and the same table under a harness variant says how much room a harness change has.
"""

from __future__ import annotations

import csv
import datetime
import json
import shlex
import subprocess
import tempfile
from dataclasses import asdict, dataclass, field
from math import comb
from pathlib import Path
from typing import Any, Callable

from whale_ray.config import WhaleConfig
from whale_ray.domain import Domain
from whale_ray.records import Rollout, Task

SPLITS = ("weight", "harness", "val", "test")
ALL = "all"


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 if n - c < k else 1.0 - comb(n - c, k) / comb(n, k)


@dataclass
class GroupStats:
    """One row of the table: the tasks of one difficulty (or all of them)."""

    group: str
    tasks: int
    episodes: int
    correct: int
    pass_at_1: float
    pass_at_k: float
    marked: float | None  # share of final answers holding the domain's answer marker; None: the domain has none
    cut: float  # share of episodes with a completion cut at max_tokens
    out_of_turns: float  # share ended by the harness's turn budget (turn_budget_exhausted)
    failed: float  # share whose status is not ok (harness exception, timeout, ...)
    metrics: dict[str, float] = field(default_factory=dict)  # the domain's per-episode metrics, averaged


@dataclass
class Calibration:
    settings: dict[str, Any]  # domain, model, harness, split, tasks, k, by, seed, engine, date, commit, command
    groups: list[GroupStats]  # one per difficulty, then ALL

    @property
    def overall(self) -> GroupStats:
        return self.groups[-1]

    def to_json(self) -> str:
        return json.dumps({"settings": self.settings, "groups": [asdict(g) for g in self.groups]}, indent=2)

    def write(self, path: Path) -> Path:
        """JSON for a .json path, else CSV (one row per group, the settings repeated in each)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.suffix == ".json":
            path.write_text(self.to_json() + "\n")
            return path
        metric_names = sorted({m for g in self.groups for m in g.metrics})
        with path.open("w", newline="") as f:
            out = csv.writer(f)
            stat_names = [n for n in GroupStats.__dataclass_fields__ if n != "metrics"]
            settings = [k for k in self.settings if k != "command"]
            out.writerow(stat_names + metric_names + settings)
            for g in self.groups:
                row = asdict(g)
                out.writerow([row[n] for n in stat_names] + [g.metrics.get(m) for m in metric_names]
                             + [self.settings[k] for k in settings])
        return path


def group_stats(group: str, rollouts: list[Rollout], k: int, marker: str | None) -> GroupStats:
    by_task: dict[str, list[float]] = {}
    for r in rollouts:
        by_task.setdefault(r.task_id, []).append(r.reward)
    n = len(rollouts)

    def share(pred: Callable[[Rollout], bool]) -> float:
        return sum(1 for r in rollouts if pred(r)) / n

    names = sorted({m for r in rollouts for m in r.metrics})
    return GroupStats(
        group=group, tasks=len(by_task), episodes=n, correct=int(sum(r.reward for r in rollouts)),
        pass_at_1=sum(sum(v) / len(v) for v in by_task.values()) / len(by_task),
        pass_at_k=sum(pass_at_k(len(v), int(sum(v)), min(k, len(v))) for v in by_task.values()) / len(by_task),
        marked=None if marker is None else share(lambda r: marker in (r.answer or "")),
        cut=share(lambda r: any(c["finish_reason"] == "length" for c in r.calls)),
        out_of_turns=share(lambda r: r.truncated), failed=share(lambda r: r.status != "ok"),
        metrics={m: sum(r.metrics[m] for r in rollouts if m in r.metrics) / sum(1 for r in rollouts if m in r.metrics)
                 for m in names},
    )


def summarize(rollouts: list[Rollout], tasks: list[Task], k: int, by: str | None,
              marker: str | None) -> list[GroupStats]:
    """A row per value of the public task field `by` (numbers in numeric order), then ALL; ALL alone without `by`."""
    if by is None:
        return [group_stats(ALL, rollouts, k, marker)]
    value = {t.id: t.public().get(by, "-") for t in tasks}
    groups: dict[Any, list[Rollout]] = {}
    for r in rollouts:
        groups.setdefault(value[r.task_id], []).append(r)
    order = sorted(groups, key=lambda v: (not isinstance(v, (int, float)), v if isinstance(v, (int, float)) else str(v)))
    return [group_stats(str(v), groups[v], k, marker) for v in order] + [group_stats(ALL, rollouts, k, marker)]


def difficulty_field(domain: Domain, tasks: list[Task], by: str | None) -> str | None:
    """The public task field to break the table down by: `by`, else the domain's (None: the domain grades none,
    and the table has the overall row only); ValueError naming a field no task has."""
    chosen = by or domain.difficulty_field
    if chosen is not None and not any(chosen in t.public() for t in tasks):
        fields = sorted({f for t in tasks for f in t.public()} - {"id", "question"})
        raise ValueError(f"--by {chosen}: no task has a public field {chosen!r} (fields: {', '.join(fields) or 'none'})")
    return chosen


def commit() -> str | None:
    """The repository's commit (with "+" when the work tree differs from it), where git knows one."""
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+" if dirty else "")


def run_calibration(cfg: WhaleConfig, model: str, *, harness: Path, split: str, tasks: int | None, k: int,
                    by: str | None, on_done: Callable[[int, int], None] | None = None,
                    rollouts_path: Path | None = None) -> Calibration:
    """Starts a PolicyServer on `model`, the domain's services and the evaluator pool on the connected Ray
    cluster, runs k episodes of `harness` per task of the split (its first `tasks`), scores them and ends
    the actors. `on_done(done, total)` as episodes finish; `rollouts_path`: every episode, as a run stores it."""
    import ray

    from actors.evaluator_pool import EvaluatorPool
    from actors.policy_server import start_policy_servers
    from whale_ray.domain import get_domain
    from whale_ray.loop import EpisodeWork, episode_seed
    from whale_ray.loop.rollouts import scored
    from whale_ray.records import EpisodeJob, rollouts_to_table
    from whale_ray.resources import Placement

    domain = get_domain(cfg.domain)
    splits = domain.load_splits(cfg.data, cfg.seed)
    chosen = getattr(splits, split)[:tasks]
    grading = difficulty_field(domain, chosen, by)
    settings = {"domain": cfg.domain, "model": model, "harness": str(harness), "split": split, "tasks": len(chosen),
                "k": k, "by": grading, "seed": cfg.seed, "engine": cfg.policy.engine,
                "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "commit": commit()}
    name = harness.stem
    jobs = [EpisodeJob(task=t, seed=episode_seed(cfg.seed, "calibrate", name, t.id, s)) for t in chosen for s in range(k)]
    # a domain's services (search_qa's retriever) write their events under run_dir: a folder of their own
    cfg = cfg.model_copy(update={"run_dir": Path(tempfile.mkdtemp(prefix="whale-calibrate-"))}, deep=True)
    if cfg.resources.policy_server.num_gpus == 0 and ray.cluster_resources().get("GPU", 0) >= 1:
        cfg.resources.policy_server.num_gpus = 1  # no Trainer shares it here: the server takes a GPU when there is one
    placement = Placement()
    policies = start_policy_servers(cfg, model, placement)
    services = domain.start_services(cfg, splits, placement)
    pool = EvaluatorPool(cfg.domain, policies, cfg.sandbox, services, resources=cfg.resources.evaluator,
                         placement=placement, poll_s=cfg.faults.poll_s)
    done = 0

    def progress(n: int) -> None:
        nonlocal done
        done += n
        if on_done is not None:
            on_done(done, len(jobs))

    try:
        [episodes] = pool.run([EpisodeWork(harness.read_text(), harness.name, jobs)], progress)
    finally:
        for actor in [*policies, *pool.actors, *services.values()]:
            if isinstance(actor, ray.actor.ActorHandle):
                ray.kill(actor, no_restart=True)
    verifier = domain.make_verifier(cfg)
    rollouts = [scored(ep, job.task, verifier, domain, phase=f"calibrate-{split}", cycle=0, harness_id=name,
                       sample=i % k, seed=job.seed, weight_version=0)
                for i, (job, ep) in enumerate(zip(jobs, episodes))]
    if rollouts_path is not None:
        import pyarrow.parquet as pq

        rollouts_path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(rollouts_to_table(rollouts), rollouts_path)
    marker = domain.answer_format.open if domain.answer_format is not None else None
    return Calibration(settings, summarize(rollouts, chosen, k, grading, marker))


def table(result: Calibration) -> "Any":
    """The result as a rich Table."""
    from rich.table import Table

    s = result.settings
    k = s["k"]
    t = Table(title=f"θ0 on D_{s['split']} of {s['domain']}: {Path(s['model']).name} under {Path(s['harness']).name}, "
                    f"{s['tasks']} tasks x {k} samples")
    metric_names = sorted({m for g in result.groups for m in g.metrics})
    for col in (s["by"] or "", "tasks", "episodes", "correct", "pass@1", f"pass@{k}", "marked", "cut", "out of turns",
                "failed", *metric_names):
        t.add_column(col, justify="left" if col == (s["by"] or "") else "right")
    for g in result.groups:
        pct = lambda x: "-" if x is None else f"{x:.1%}"  # noqa: E731
        t.add_row(g.group, str(g.tasks), str(g.episodes), str(g.correct), f"{g.pass_at_1:.3f}", f"{g.pass_at_k:.3f}",
                  pct(g.marked), pct(g.cut), pct(g.out_of_turns), pct(g.failed),
                  *[f"{g.metrics[m]:.3f}" if m in g.metrics else "-" for m in metric_names],
                  end_section=len(result.groups) > 1 and result.groups[-2] is g)
    t.caption = ("marked: final answers holding the domain's answer marker; cut: episodes with a completion cut at "
                 "max_tokens; out of turns: ended by the turn budget; failed: status other than ok")
    return t


def check_inputs(cfg: WhaleConfig, harness: Path | None, split: str, tasks: int | None, k: int,
                 by: str | None) -> Path:
    """The harness to run, after checking every input before Ray starts; ValueError (one line, naming the input)."""
    from whale_ray.domain import get_domain
    from whale_ray.harness import HarnessError, load_harness_file
    from whale_ray.policy.checkpoint import check_checkpoint

    if k < 1:
        raise ValueError(f"--k {k}: needs at least one episode per task")
    if tasks is not None and tasks < 1:
        raise ValueError(f"--tasks {tasks}: needs at least one task")
    domain = get_domain(cfg.domain)
    chosen = getattr(domain.load_splits(cfg.data, cfg.seed), split)[:tasks]  # DataError: a ValueError naming the file
    domain.check_inputs(cfg)
    difficulty_field(domain, chosen, by)
    path = harness or domain.h0_path
    try:
        load_harness_file(path)
    except HarnessError as e:
        raise ValueError(str(e)) from None
    if cfg.policy.model is not None:
        check_checkpoint(cfg.policy.model)  # CheckpointError: a ValueError naming the directory
    return path


def calibrate_command(cfg: WhaleConfig, args: Any, console: Any) -> int:
    """`whale calibrate` (whale_ray/cli.py parses the flags): check, start Ray, run, print the table, write it."""
    import ray
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from whale_ray.launch import InputError, base_model, start_ray

    try:
        harness = check_inputs(cfg, args.harness, args.split, args.tasks, args.k, args.by)
    except ValueError as e:
        raise InputError(str(e).splitlines()[0]) from None
    start_ray(args.ray_address)
    try:
        model = base_model(cfg)
        bar = Progress(TextColumn("[bold]calibrate"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                       console=console)
        with bar:
            job = bar.add_task("episodes", total=None)
            result = run_calibration(
                cfg, model, harness=harness, split=args.split, tasks=args.tasks, k=args.k, by=args.by,
                on_done=lambda done, total: bar.update(job, completed=done, total=total),
                rollouts_path=args.out.with_suffix(".rollouts.parquet") if args.out else None)
    finally:
        ray.shutdown()
    result.settings["command"] = shlex.join(["whale", *args.argv])
    console.print(table(result))
    if args.out:
        console.print(f"written: {result.write(args.out)} and {args.out.with_suffix('.rollouts.parquet')}",
                      highlight=False)
    return 0
