"""One rollout path for both phases: (harness, task, seed, weight version) in, scored Rollouts out.

Episodes run in the pool; the verifier scores them here, in the trusted process, so neither the gold
answer nor the verifier ever reaches an evaluator's sandbox.
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable

from whale_ray.domain import Domain
from whale_ray.loop.context import Batch, EpisodeWork, RunContext
from whale_ray.records import EpisodeJob, EpisodeResult, Rollout, Task
from whale_ray.run_state import RolloutPhase


def episode_seed(*parts: Any) -> int:
    """A seed from what identifies an episode, so a redone episode replays token for token."""
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little") >> 1


def split_metrics(rollouts: list[Rollout], tasks: dict[str, Task]) -> dict[str, float]:
    """Means over an evaluation beside the reward: the truncation rate, each domain metric, and the reward
    per task group (a benchmark) when the split has more than one."""
    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs)

    out = {"truncation_rate": mean([float(r.truncated) for r in rollouts])}
    for name in sorted({k for r in rollouts for k in r.metrics}):
        out[name] = mean([r.metrics[name] for r in rollouts if name in r.metrics])
    groups: dict[str, list[float]] = {}
    for r in rollouts:
        group = tasks[r.task_id].meta.get("group")
        if group is not None:
            groups.setdefault(str(group), []).append(r.reward)
    if len(groups) > 1:
        for group, rewards in sorted(groups.items()):
            out[f"group:{group}"] = mean(rewards)
        out["group_average"] = mean([mean(g) for g in groups.values()])
    return out


def mean_reward(rollouts: list[Rollout]) -> float:
    return sum(r.reward for r in rollouts) / len(rollouts)


def rollout_many(ctx: RunContext, work: list[tuple[str, list[Task], int]], *, phase: RolloutPhase, cycle: int,
                 unit: int) -> list[list[Rollout]]:
    """`samples` episodes per task for each (harness id, tasks, samples), all in the pool at once, scored. A cycle's
    report waiting on an evaluation under the loaded weights (report.py) sends its episodes into the same call."""
    if not work:
        return []
    own = [Batch(harness_id, tasks, samples, phase, cycle, unit) for harness_id, tasks, samples in work]
    beside = ctx.report.beside()
    results = run_batches(ctx, own + beside, timed_as=phase)
    if beside:
        ctx.report.take(beside, results[len(own):])
    return results[:len(own)]


def run_batches(ctx: RunContext, batches: list[Batch], *, timed_as: str) -> list[list[Rollout]]:
    """Every batch's episodes in one pool call, scored; timed as one act of the phase `timed_as`."""
    plans, items = [], []
    for b in batches:
        meta = [(t, s, episode_seed(ctx.cfg.seed, b.phase, b.cycle, b.unit, b.harness_id, t.id, s))
                for t in b.tasks for s in range(b.samples)]
        plans.append(meta)
        items.append(EpisodeWork(ctx.archive.get(b.harness_id).code, f"{b.harness_id}.py",
                                 [EpisodeJob(task=t, seed=seed) for t, _, seed in meta]))
    ctx.progress.set(done=0, total=sum(len(w.jobs) for w in items))
    done = 0

    def on_done(n: int) -> None:
        nonlocal done
        done += n
        ctx.progress.set(done=done)

    with ctx.run.timed(timed_as, "rollouts") as timing:
        results = ctx.roles.pool.run(items, on_done)
        timing["episodes"] = sum(len(w.jobs) for w in items)
        if report := sum(len(meta) for b, meta in zip(batches, plans) if b.phase != timed_as):
            timing["report_episodes"] = report  # a cycle's report that ran beside this call
    # read once the calls are answered: episodes begun while the Trainer took a step waited for its weights
    version = ctx.run.state.weight_version
    with ctx.run.timed(timed_as, "verify"):
        return [
            [scored(ep, task, ctx.verifier, ctx.domain, phase=b.phase, cycle=b.cycle, harness_id=b.harness_id,
                    sample=sample, seed=seed, weight_version=version)
             for (task, sample, seed), ep in zip(meta, episodes)]
            for b, meta, episodes in zip(batches, plans, results)
        ]


def scored(ep: EpisodeResult, task: Task, verifier: Callable[[Task, str | None], float], domain: Domain,
           **fields: Any) -> Rollout:
    """One episode as a Rollout: the verifier reads only an answer the harness returned (status ok), and the
    domain adds its per-episode metrics. `fields`: phase, cycle, harness_id, sample, seed, weight_version."""
    reward = verifier(task, ep.answer) if ep.status == "ok" else 0.0
    return Rollout.from_episode(ep, task=task, reward=reward, metrics=domain.episode_metrics(task, ep), **fields)


def rollout(ctx: RunContext, harness_id: str, tasks: list[Task], *, samples: int, phase: RolloutPhase, cycle: int,
            unit: int) -> list[Rollout]:
    return rollout_many(ctx, [(harness_id, tasks, samples)], phase=phase, cycle=cycle, unit=unit)[0]
