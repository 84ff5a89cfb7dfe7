"""The weight phase: online RSFT under the accepted harness.

    until E epochs of D_weight are spent (or, adaptive, the training reward stops improving):
        roll out k samples of the next prompts under the accepted harness
        keep the calls the verifier accepts, fine-tune on their completion tokens
        hand the new weights to the weight sync, which puts them on every PolicyServer;
        every `checkpoint_every` steps, checkpoint and commit

A step's work goes on record only with a checkpoint, so a relaunch restarts from the last checkpoint and
redoes the steps after it with the same prompts and seeds: no optimizer step is lost or taken twice. The Trainer
writes a step's checkpoint while the next step's rollouts run, and the commit waits for the write (before that
step's own work is recorded or trained on); the phase's last checkpoint is waited for at once.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

from whale_ray.loop.context import RunContext
from whale_ray.loop.rollouts import episode_seed, mean_reward, rollout
from whale_ray.loop.run_dir import weight_step_name
from whale_ray.records import Rollout, Task
from whale_ray.rsft import SFTExample, accepted_calls
from whale_ray.run_state import PhaseProgress
from whale_ray.schedules import Phase, weight_phase_should_stop


def training_examples(ctx: RunContext, rollouts: list[Rollout], tasks: list[Task]) -> tuple[list[SFTExample], list[dict]]:
    """The SFT examples of a step and which (task, sample, call) each came from: calls of accepted episodes
    (reward 1, status ok) that `rsft.accepted_calls` lets train (losing votes do not) and that generated tokens."""
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
                sources.append({"task_id": r.task_id, "sample": r.sample, "call": i})
    return examples, sources


def next_prompts(ctx: RunContext, n: int) -> tuple[list[Task], int, int]:
    """The next n prompts of a reshuffled-every-pass walk over D_weight (E may be a fraction)."""
    weight = ctx.splits.weight
    tasks, cursor, weight_pass = [], ctx.run.state.weight_cursor, ctx.run.state.weight_pass
    while len(tasks) < n:
        order = list(range(len(weight)))
        random.Random(episode_seed(ctx.cfg.seed, "weight-pass", weight_pass)).shuffle(order)
        take = order[cursor:cursor + n - len(tasks)]
        tasks += [weight[j] for j in take]
        cursor += len(take)
        if cursor >= len(order):
            cursor, weight_pass = 0, weight_pass + 1
    return tasks, cursor, weight_pass


def weight_phase(ctx: RunContext, cycle: int, prog: PhaseProgress, phase: Phase) -> None:
    cfg, state, trainer, sync = ctx.cfg.weight, ctx.run.state, ctx.roles.trainer, ctx.roles.weights
    n_weight = len(ctx.splits.weight)
    budget = max(1, round(phase.budget * n_weight))
    since_checkpoint = 0
    writing: Path | None = None  # a checkpoint being written while this step's rollouts run
    while prog.prompts_done < budget:
        if phase.adaptive and weight_phase_should_stop(prog.prompts_done / n_weight, prog.step_rewards, ctx.cfg.adaptive):
            break
        started = time.perf_counter()
        n = min(cfg.prompts_per_step, budget - prog.prompts_done)
        tasks, cursor, weight_pass = next_prompts(ctx, n)
        name = weight_step_name(cycle, prog.units_done)
        rollouts = rollout(ctx, state.accepted_harness, tasks, samples=cfg.samples_per_prompt, phase="weight",
                           cycle=cycle, unit=prog.units_done)
        if writing is not None:
            checkpoint_written(ctx, writing)
            writing = None
        ctx.run.write_rollouts(name, "weight", cycle, rollouts)
        examples, sources = training_examples(ctx, rollouts, tasks)
        version_before = state.weight_version
        ctx.report.finish()  # the weights change next: the last cycle's report, if it still waits, runs now
        with ctx.run.timed("weight", "sleep"):
            sync.before_step()
        with ctx.run.timed("weight", "train") as timing:
            metrics = trainer.train_step(examples, version_before)
            # the Trainer's own seconds for the step, and the part of them it spent starting its workers
            timing.update(examples=len(examples), step_s=metrics.get("wall_s"),
                          workers_start_s=metrics.get("workers_start_s", 0.0))
        with ctx.run.timed("weight", "sync"):
            if metrics["trained"]:
                state.weight_version = metrics["version"]
                sync.push(state.weight_version)
            else:
                sync.resume()
        if metrics["trained"]:
            state.ledger.weight_steps += 1
            since_checkpoint += 1
        ctx.run.write_train_step(name.removeprefix("weight-"), {
            "cycle": cycle, "step": prog.units_done, "rollout_file": name, "version_before": version_before,
            "version_after": state.weight_version, "examples": sources, "metrics": metrics})
        reward = mean_reward(rollouts)
        prog.step_rewards.append(reward)
        prog.prompts_done += n
        prog.units_done += 1
        state.weight_cursor, state.weight_pass = cursor, weight_pass
        if since_checkpoint >= cfg.checkpoint_every:
            writing = checkpoint(ctx, wait=False)
            since_checkpoint = 0
        prog.wall_s += time.perf_counter() - started  # on record with the next commit
        if since_checkpoint == 0 and writing is None:
            ctx.run.commit()  # nothing trained since the last checkpoint: the trainer's state is on record
        ctx.progress.set(detail=f"step {prog.units_done}: reward {reward:.3f}, {len(examples)} accepted calls, "
                                f"loss {metrics.get('loss', float('nan')):.3f}")
    started = time.perf_counter()
    if writing is not None:
        checkpoint_written(ctx, writing)
    if since_checkpoint:
        checkpoint(ctx, wait=True)
    if trainer is not None and cfg.release_workers:
        with ctx.run.timed("weight", "release"):
            sync.release()
            trainer.release_workers()  # the harness phase needs no trainer: its CPUs/GPUs go back to the cluster
    prog.wall_s += time.perf_counter() - started
    ctx.run.commit()


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
    ctx.run.state.checkpoint = ctx.run.relative(path)
    ctx.run.commit()
    ctx.run.prune_checkpoints()
