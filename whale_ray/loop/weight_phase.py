"""The weight phase: online RSFT under the accepted harness.

    until E epochs of D_weight are spent (or, adaptive, the training reward stops improving):
        roll out k samples of the next prompts under the accepted harness
        keep the calls the verifier accepts, fine-tune on their completion tokens
        hand the new weights to the weight sync, which puts them on every PolicyServer;
        every `checkpoint_every` steps, checkpoint and commit

Inside the phase a step's work goes on record only with a checkpoint, so a relaunch restarts from the last
checkpoint and redoes the steps after it with the same prompts and seeds: no optimizer step is lost or taken
twice. The Trainer writes a step's checkpoint while the next step's rollouts run, and the commit waits for the
write (before that step's own work is recorded or trained on). The phase's last checkpoint is written beside what
follows (the harness phase): the record goes on at weight_version with `checkpoint_pending` naming it, and it is put
on record before the cycle's selection (`settle_checkpoint`). A relaunch in between starts from the checkpoint before
it and trains the steps after that again on their recorded examples (`retrain_unsaved_steps`): no rollout runs twice.

The next step's episodes begin while the Trainer takes this one: their sandboxes start, and their model calls wait
for the step's weights (the weight sync holds them, `before_step`), so every step trains on its own weights' samples.
With `weight.max_staleness: 1` those calls are answered by the weights the servers hold instead (the engine does not
sleep then), so a step trains on samples one version old; each trained call's version is in the step's train/
record. Either way they go on record with their own step: a relaunch runs them again from the checkpoint on record.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from whale_ray.loop.context import RunContext
from whale_ray.loop.rollouts import episode_seed, mean_reward, rollout
from whale_ray.loop.run_dir import weight_step_name
from whale_ray.records import Rollout, Task
from whale_ray.rsft import SFTExample, accepted_calls
from whale_ray.run_state import PhaseProgress
from whale_ray.schedules import Phase, weight_phase_should_stop


def training_examples(ctx: RunContext, rollouts: list[Rollout], tasks: list[Task]) -> tuple[list[SFTExample], list[dict]]:
    """The SFT examples of a step and which (task, sample, call, the call's weight version) each came from: calls of
    accepted episodes (reward 1, status ok) that `rsft.accepted_calls` lets train (losing votes do not) and that
    generated tokens."""
    by_id = {t.id: t for t in tasks}
    marker = ctx.domain.answer_format

    def states_answer(text: str) -> bool:
        return marker is not None and marker.open in text

    examples, sources = [], []
    for r in rollouts:
        if r.reward != 1 or r.status != "ok":
            continue
        task = by_id[r.task_id]
        for i in accepted_calls(r.model_calls, lambda text: ctx.verifier(task, text) == 1, states_answer):
            call = r.model_calls[i]
            if call.completion_ids:
                examples.append((list(call.prompt_ids), list(call.completion_ids)))
                sources.append({"task_id": r.task_id, "sample": r.sample, "call": i,
                                "weight_version": call.weight_version})
    return examples, sources


@dataclass
class Step:
    """A weight step's prompts and rollouts, and where the walk over D_weight stands after them."""

    index: int
    tasks: list[Task]
    cursor: int
    weight_pass: int
    rollouts: list[Rollout]


def next_prompts(ctx: RunContext, n: int, cursor: int, weight_pass: int) -> tuple[list[Task], int, int]:
    """The n prompts after `cursor` of a reshuffled-every-pass walk over D_weight (E may be a fraction)."""
    weight = ctx.splits.weight
    tasks: list[Task] = []
    while len(tasks) < n:
        order = list(range(len(weight)))
        random.Random(episode_seed(ctx.cfg.seed, "weight-pass", weight_pass)).shuffle(order)
        take = order[cursor:cursor + n - len(tasks)]
        tasks += [weight[j] for j in take]
        cursor += len(take)
        if cursor >= len(order):
            cursor, weight_pass = 0, weight_pass + 1
    return tasks, cursor, weight_pass


def roll_out(ctx: RunContext, cycle: int, index: int, n: int, cursor: int, weight_pass: int) -> Step:
    """Step `index`'s n prompts, k samples each, under the accepted harness and the weights the servers hold."""
    tasks, cursor, weight_pass = next_prompts(ctx, n, cursor, weight_pass)
    rollouts = rollout(ctx, ctx.run.state.accepted_harness, tasks, samples=ctx.cfg.weight.samples_per_prompt,
                       phase="weight", cycle=cycle, unit=index)
    return Step(index, tasks, cursor, weight_pass, rollouts)


def weight_phase(ctx: RunContext, cycle: int, prog: PhaseProgress, phase: Phase) -> None:
    cfg, state, trainer, sync = ctx.cfg.weight, ctx.run.state, ctx.roles.trainer, ctx.roles.weights
    n_weight = len(ctx.splits.weight)
    budget = max(1, round(phase.budget * n_weight))

    def step_size(prompts_done: int, step_rewards: list[float]) -> int:
        """The next step's prompt count; 0 once the budget (or, adaptive, the training reward) ends the phase."""
        if prompts_done >= budget or (phase.adaptive and weight_phase_should_stop(
                prompts_done / n_weight, step_rewards, ctx.cfg.adaptive)):
            return 0
        return min(cfg.prompts_per_step, budget - prompts_done)

    settle_checkpoint(ctx)  # an earlier phase's, if no selection came between
    since_checkpoint = 0
    writing: Path | None = None  # a checkpoint being written while this step's rollouts run
    ahead: Future[Step] | None = None  # this step's rollouts, begun while the Trainer took the one before
    while n := step_size(prog.prompts_done, prog.step_rewards):
        started = time.perf_counter()
        step = ahead.result() if ahead else roll_out(ctx, cycle, prog.units_done, n, state.weight_cursor,
                                                     state.weight_pass)
        ahead = None
        if writing is not None:
            checkpoint_written(ctx, writing)
            writing = None
        name = weight_step_name(cycle, step.index)
        ctx.run.write_rollouts(name, "weight", cycle, step.rollouts)
        examples, sources = training_examples(ctx, step.rollouts, step.tasks)
        reward = mean_reward(step.rollouts)
        version_before = state.weight_version
        ctx.report.finish()  # the weights change next: the last cycle's report, if it still waits, runs now
        following = step_size(prog.prompts_done + n, [*prog.step_rewards, reward])
        stale = bool(following and cfg.max_staleness)
        if not stale:
            with ctx.run.timed("weight", "sleep"):
                sync.before_step()  # from here the servers hold new calls for the step's weights
        if following:  # the next step's episodes begin beside the step: their sandboxes start, and their calls are
            # answered by the weights the servers hold (max_staleness 1) or wait for the step's
            ahead = begin(roll_out, ctx, cycle, step.index + 1, following, step.cursor, step.weight_pass)
        metrics = train_step(ctx, examples, version_before)
        if stale:
            ahead.result()  # they ran on the weights before the step: done before those change
        with ctx.run.timed("weight", "sync"):
            if metrics["trained"]:
                state.weight_version = metrics["version"]
                sync.push(state.weight_version)
            elif not stale:  # the servers held their calls for this step: on the weights they have
                sync.resume()
        if metrics["trained"]:
            state.ledger.weight_steps += 1
            since_checkpoint += 1
        staleness = Counter(version_before - s["weight_version"] for s in sources)
        ctx.run.write_train_step(name.removeprefix("weight-"), {
            "cycle": cycle, "step": step.index, "rollout_file": name, "version_before": version_before,
            "version_after": state.weight_version, "examples": sources, "metrics": metrics,
            "staleness": {str(k): v for k, v in sorted(staleness.items())}})
        prog.step_rewards.append(reward)
        prog.prompts_done += n
        prog.units_done += 1
        state.weight_cursor, state.weight_pass = step.cursor, step.weight_pass
        if since_checkpoint >= cfg.checkpoint_every:
            writing = checkpoint(ctx, wait=False)
            since_checkpoint = 0
        prog.wall_s += time.perf_counter() - started  # on record with the next commit
        if since_checkpoint == 0 and writing is None:
            ctx.run.commit()  # nothing trained since the last checkpoint: the trainer's state is on record
        ctx.progress.set(detail=f"step {prog.units_done}: reward {reward:.3f}, {len(examples)} accepted calls, "
                                f"loss {metrics.get('loss', float('nan')):.3f}")
    started = time.perf_counter()
    if since_checkpoint:
        writing = checkpoint(ctx, wait=False)
    if writing is not None and cfg.release_workers:
        checkpoint_written(ctx, writing)  # the workers go next, and rank 0's write with them
    elif writing is not None:  # the phase's last checkpoint: written beside what follows (settle_checkpoint)
        state.checkpoint_pending = ctx.run.relative(writing)
    if trainer is not None and cfg.release_workers:
        with ctx.run.timed("weight", "release"):
            sync.release()
            trainer.release_workers()  # the harness phase needs no trainer: its CPUs/GPUs go back to the cluster
    prog.wall_s += time.perf_counter() - started
    ctx.run.commit()


AHEAD_THREAD = "whale-ahead"  # the name of a thread that runs a step's rollouts begun beside the step before


def begin(fn: Callable[..., Step], *args: Any) -> Future[Step]:
    """`fn(*args)` in a thread of its own; its result, or its error, from the future."""
    pool = ThreadPoolExecutor(1, thread_name_prefix=AHEAD_THREAD)
    try:
        return pool.submit(fn, *args)
    finally:
        pool.shutdown(wait=False)  # the thread ends with its one task


def train_step(ctx: RunContext, examples: list[SFTExample], version: int) -> dict:
    with ctx.run.timed("weight", "train") as timing:
        metrics = ctx.roles.trainer.train_step(examples, version)
        # the Trainer's own seconds for the step, and the part of them it spent starting its workers
        timing.update(examples=len(examples), step_s=metrics.get("wall_s"),
                      workers_start_s=metrics.get("workers_start_s", 0.0))
    return metrics


def checkpoint(ctx: RunContext, *, wait: bool) -> Path | None:
    """The current weights (and optimizer) as checkpoints/v<N>, on record at once; with `wait=False` the Trainer
    writes them in the background and the path comes back for `checkpoint_written`."""
    state = ctx.run.state
    path = ctx.run.checkpoint_path(state.weight_version)
    with ctx.run.timed("weight", "checkpoint") as timing:
        ctx.roles.trainer.save_checkpoint(str(path), state.weight_version, wait=wait)
        timing.update(version=state.weight_version, background=not wait)
    if not wait:
        return path
    on_record(ctx, path)
    return None


def checkpoint_written(ctx: RunContext, path: Path) -> None:
    """Waits for a background write; then the checkpoint, and everything up to the step it holds, goes on record."""
    with ctx.run.timed("weight", "checkpoint") as timing:
        ctx.roles.trainer.checkpoint_written(str(path))
        timing["written"] = True
    on_record(ctx, path)


def on_record(ctx: RunContext, path: Path) -> None:
    state = ctx.run.state
    state.checkpoint, state.checkpoint_version, state.checkpoint_pending = ctx.run.relative(path), state.weight_version, None
    ctx.run.commit()
    ctx.run.prune_checkpoints()


def settle_checkpoint(ctx: RunContext) -> None:
    """Puts the weight phase's last checkpoint on record, once the Trainer has written it (waiting if it still
    writes): before the cycle's selection, which names the checkpoint of the weights it selects."""
    pending = ctx.run.state.checkpoint_pending
    if pending is not None:
        checkpoint_written(ctx, ctx.run.root / pending)


def retrain_unsaved_steps(ctx: RunContext) -> None:
    """A relaunch whose last commit came while the weight phase's last checkpoint was being written: the Trainer
    and the servers hold `checkpoint`, the record is further on. The weight steps on record after the checkpoint are
    trained again on their recorded examples (no rollout runs again, nothing is counted again), the weights go to
    the servers, and the checkpoint is written again in the background."""
    state = ctx.run.state
    if state.checkpoint_pending is None:
        return
    steps = [r for r in map(ctx.run.train_record, state.train_steps)
             if r["metrics"]["trained"] and r["version_before"] >= state.checkpoint_version]
    with ctx.run.timed("weight", "retrain") as timing:
        ctx.roles.weights.before_step()
        for record in steps:
            metrics = ctx.roles.trainer.train_step(recorded_examples(ctx, record), record["version_before"])
            if metrics["version"] != record["version_after"]:
                raise RuntimeError(f"train/ step {record['cycle']}:{record['step']} trained again gave weight version "
                                   f"{metrics['version']}, its record says {record['version_after']}")
        ctx.roles.weights.push(state.weight_version)
        timing.update(steps=len(steps), version=state.weight_version)
    checkpoint(ctx, wait=False)


def recorded_examples(ctx: RunContext, record: dict) -> list[SFTExample]:
    """A weight step's SFT examples, in the order it trained on them, from its rollout file."""
    calls = ctx.run.rollout_calls(record["rollout_file"])
    return [(call["prompt_ids"], call["completion_ids"])
            for call in (calls[s["task_id"], s["sample"]][s["call"]] for s in record["examples"])]
