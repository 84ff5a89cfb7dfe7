"""Coordinator: runs the alternation of weight and harness phases and owns the run directory.

    for each cycle of the schedule:
        weight phase:  roll out D_weight prompts under the accepted harness, keep verified
                       samples, fine-tune on them, push the new weights to the PolicyServer
        harness phase: evaluate the incoming harness, then propose, validate and evaluate
                       candidates on D_harness; accept the frontier's top
        select the best-so-far (theta*, h*) on D_val; report mean@8 on D_test

The run directory is the truth: state.json is rewritten after every weight step, harness
iteration and evaluation, so relaunching the same command resumes where the last one stopped.
"""

from __future__ import annotations

import hashlib
import random
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pyarrow.parquet as pq
import ray

from actors.harness_proposer import HarnessProposer
from actors.policy_server import PolicyServer
from actors.sandbox_evaluator import CLUSTER, EpisodeJob, EvaluatorPool
from actors.trainer import Trainer
from whale_ray.archive import Archive, ArchiveError
from whale_ray.config import WhaleConfig, dump_config
from whale_ray.domain import Splits, get_domain
from whale_ray.harness import check_harness_source
from whale_ray.proposers import proposer_options
from whale_ray.proposers.leakage import LeakageGuard
from whale_ray.proposers.session import (
    PARTIAL_FILE,
    budget_exhausted,
    load_session,
    logged_sessions,
    remaining_limits,
    retire_partial,
    session_dir,
    total_usage,
    write_session,
)
from whale_ray.records import EpisodeResult, Rollout, Task, rollouts_to_table
from whale_ray.rsft import accepted_examples
from whale_ray.run_state import CycleRow, PhaseProgress, RunState, Selection
from whale_ray.schedules import Phase, harness_phase_should_stop, plan, weight_phase_should_stop
from whale_ray.storage import atomic_write_text


def episode_seed(*parts: Any) -> int:
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


@dataclass
class Progress:
    """What the driver shows while the run works; read from another thread."""

    cycle: int = 0
    cycles: int = 0
    phase: str = "starting"
    detail: str = ""
    done: int = 0
    total: int = 0


class Coordinator:
    def __init__(self, cfg: WhaleConfig, base_model: str):
        self.cfg = cfg
        self.base_model = base_model
        self.run_dir = Path(cfg.run_dir).resolve()
        self.domain = get_domain(cfg.domain)
        self.plan = plan(cfg)
        self.progress = Progress(cycles=len(self.plan))
        self._on_cycle: Callable[[CycleRow], None] | None = None
        self._lock = threading.Lock()
        self.splits: Splits = self.domain.load_splits(cfg.data, cfg.seed)
        self.verifier = self.domain.make_verifier(cfg)
        others = [t.question for t in (*self.splits.weight, *self.splits.harness, *self.splits.val)]
        self.leakage_guard = LeakageGuard([t.question for t in self.splits.test], others)
        self.archive = Archive(self.run_dir / "archive")
        self.state = RunState.load(self.run_dir)
        if self.state is None:
            self.state = self._start_state()
        else:
            self._drop_uncommitted_rollouts()
        self._start_actors()

    # ----------------------------------------------------------------------------- the loop
    def run(self, on_cycle: Callable[[CycleRow], None] | None = None) -> list[CycleRow]:
        """Runs (or resumes) the schedule; `on_cycle` sees each cycle's row as it is recorded."""
        self._on_cycle = on_cycle
        if not self.state.history:
            self.finish_cycle(-1, [], 0.0)  # row 0: (theta0, h0) on D_val and D_test, the starting point
        for c, phases in enumerate(self.plan):
            if c < self.state.cycle:
                continue
            started = time.perf_counter()
            if self.state.cycle_start is None:
                self.state.cycle_start = self.state.ledger.model_copy()
            for i, phase in enumerate(phases):
                if self._phase_finished(c, i):
                    continue
                self._set_progress(cycle=c + 1, phase=phase.label())
                if phase.kind == "weight":
                    self.weight_phase(c, i, phase)
                else:
                    self.harness_phase(c, i, phase)
            self.finish_cycle(c, phases, time.perf_counter() - started)
        self.state.finished = True
        self.state.save(self.run_dir)
        self._set_progress(phase="finished", detail="")
        return self.state.history

    # ------------------------------------------------------------------------ weight phase
    def weight_phase(self, cycle: int, index: int, phase: Phase) -> None:
        prog = self._enter_phase(cycle, index, phase)
        n_weight = len(self.splits.weight)
        budget = max(1, round(phase.budget * n_weight))
        rules = self.cfg.adaptive
        while prog.prompts_done < budget:
            if phase.adaptive and weight_phase_should_stop(prog.prompts_done / n_weight, prog.step_rewards, rules):
                break
            step_started = time.perf_counter()
            n = min(self.cfg.weight.prompts_per_step, budget - prog.prompts_done)
            tasks, cursor, weight_pass = self._next_weight_prompts(n)
            rollouts = self.rollout(self.state.accepted_harness, tasks, samples=self.cfg.weight.samples_per_prompt,
                                    phase="weight", cycle=cycle, unit=prog.units_done)
            # Written before training: a step redone after a crash overwrites the same file.
            self._write_rollouts(f"weight-c{cycle:02d}-s{prog.units_done:04d}", rollouts)
            examples = accepted_examples(rollouts)
            metrics = ray.get(self.trainer.train_step.remote(examples))
            if metrics["trained"]:
                version = metrics["version"]
                ray.get(self.policy.load_weights.remote(self.trainer.latest_weights.remote(), version))
                checkpoint = self.run_dir / "checkpoints" / f"v{version:05d}"
                ray.get(self.trainer.save_checkpoint.remote(str(checkpoint)))
                self.state.weight_version, self.state.checkpoint = version, str(checkpoint.relative_to(self.run_dir))
                self.state.ledger.weight_steps += 1
                self._prune_checkpoints()
            reward = sum(r.reward for r in rollouts) / len(rollouts)
            prog.step_rewards.append(reward)
            prog.prompts_done += n
            prog.units_done += 1
            prog.wall_s += time.perf_counter() - step_started
            self.state.weight_cursor, self.state.weight_pass = cursor, weight_pass
            self.state.save(self.run_dir)
            self._set_progress(detail=f"step {prog.units_done}: reward {reward:.3f}, "
                                      f"{len(examples)} accepted calls, loss {metrics.get('loss', float('nan')):.3f}")
        self._leave_phase(prog)

    def _next_weight_prompts(self, n: int) -> tuple[list[Task], int, int]:
        """The next n prompts of a reshuffled-every-pass walk over D_weight (E may be a fraction)."""
        tasks, cursor, weight_pass = [], self.state.weight_cursor, self.state.weight_pass
        while len(tasks) < n:
            order = list(range(len(self.splits.weight)))
            random.Random(episode_seed(self.cfg.seed, "weight-pass", weight_pass)).shuffle(order)
            take = order[cursor:cursor + n - len(tasks)]
            tasks += [self.splits.weight[j] for j in take]
            cursor += len(take)
            if cursor >= len(order):
                cursor, weight_pass = 0, weight_pass + 1
        return tasks, cursor, weight_pass

    # ----------------------------------------------------------------------- harness phase
    def harness_phase(self, cycle: int, index: int, phase: Phase) -> None:
        prog = self._enter_phase(cycle, index, phase)
        rules = self.cfg.adaptive
        while prog.units_done < phase.budget:
            if phase.adaptive and harness_phase_should_stop(prog.units_done, prog.best_success, rules):
                break
            if prog.units_done > 0 and self._proposer_budget_spent():
                break  # a run-wide proposer cap: harness search ends here, with the state saved
            started = time.perf_counter()
            iteration = self.state.ledger.harness_iterations + 1  # archive-wide, so resume finds its pending
            if prog.units_done == 0:
                candidates = [self._incoming_candidate(cycle, iteration)]
            else:
                candidates = self._proposed_candidates(cycle, iteration)
            self.evaluate_candidates(candidates, cycle, iteration)
            best = self.archive.best(noise_margin=self.cfg.harness_phase.noise_margin,
                                     incumbent=self._incumbent(), weight_version=self.state.weight_version)
            self.state.accepted_harness = best.id
            prog.best_success.append(best.success_rate)
            prog.units_done += 1
            prog.wall_s += time.perf_counter() - started
            self.state.ledger.harness_iterations += 1
            self.state.save(self.run_dir)
            self._set_progress(detail=f"iteration {prog.units_done}: accepted {best.id} "
                                      f"(success {best.success_rate:.3f})")
        self._leave_phase(prog)

    def _incoming_candidate(self, cycle: int, iteration: int) -> str:
        """Iteration 1 evaluates the incoming harness under the current weights (once per version)."""
        pending = self.archive.pending(iteration)
        if pending:
            return pending[0].id
        incoming = self.archive.get(self.state.accepted_harness)
        if incoming.status == "proposed" or self._incumbent() is not None:
            return incoming.id  # the seed before its first evaluation, or already scored under these weights
        return self.archive.add_reevaluation(incoming.id, weight_version=self.state.weight_version, cycle=cycle,
                                             iteration=iteration)

    def _incumbent(self) -> str | None:
        """The accepted harness, when its scores were measured under the current weights."""
        current = self.archive.get(self.state.accepted_harness)
        return current.id if current.weight_version == self.state.weight_version else None

    def _proposed_candidates(self, cycle: int, iteration: int) -> list[str]:
        """The proposer's candidates for this iteration. Its session is logged in <run_dir>/proposer/iter-NNNN/
        session.json before the candidates enter the archive, so a relaunch never runs a finished session
        again (nor counts its usage twice): it adds the proposals the archive still lacks and evaluates
        the pending ones. A session killed mid-way is kept as aborted-<k>.json (its spending counted) and
        runs afresh."""
        sdir = session_dir(self.run_dir, iteration)
        record = load_session(sdir)
        if record is None:
            pending = self.archive.pending(iteration)
            if pending:  # proposed before a restart by a run without session logs: evaluate them
                return [c.id for c in pending]
            retire_partial(sdir)
            self._record_proposer_sessions(sdir)
            limits = remaining_limits(self.cfg.harness_phase, total_usage(self.state.proposer_sessions))
            self._set_progress(detail=f"iteration {iteration}: {self.cfg.harness_phase.proposer} proposer session")
            result = ray.get(self.proposer.session.remote(
                str(self.archive.root), self.cfg.harness_phase.candidates_per_iteration, iteration,
                limits.to_dict(), str(sdir / PARTIAL_FILE)))
            record = {**result["session"], "proposals": result["proposals"], "cycle": cycle}
            write_session(sdir, record)
        self._record_proposer_sessions(sdir)
        done = {(c.code, c.parent, c.hypothesis) for c in self.archive.candidates() if c.iteration == iteration}
        added = 0
        for p in record.get("proposals") or []:
            if (p["code"], p["parent"], p["hypothesis"]) in done:
                continue  # added before a restart
            try:
                self.archive.add_candidate(p["code"], parent=p["parent"], hypothesis=p["hypothesis"],
                                           iteration=iteration, cycle=cycle)
            except ArchiveError:
                continue  # a proposal naming no archive parent: the session log keeps it
            done.add((p["code"], p["parent"], p["hypothesis"]))
            added += 1
        self.state.ledger.candidates_proposed += added
        self.state.save(self.run_dir)
        return [c.id for c in self.archive.pending(iteration)]

    def _record_proposer_sessions(self, directory: Path) -> None:
        """Put the sessions logged in `directory` on record and rebuild the proposer ledger from the record."""
        for name, usage in logged_sessions(directory):
            self.state.proposer_sessions[name] = usage.to_dict()
        total, led = total_usage(self.state.proposer_sessions), self.state.ledger
        led.proposer_sessions, led.proposer_calls, led.proposer_retries = total.sessions, total.calls, total.retries
        led.proposer_prompt_tokens, led.proposer_completion_tokens = total.prompt_tokens, total.completion_tokens
        led.proposer_cached_tokens, led.proposer_cost_usd, led.proposer_wall_s = (
            total.cached_tokens, round(total.cost_usd, 8), round(total.wall_s, 3))

    def _proposer_budget_spent(self) -> bool:
        """True once a run-wide proposer cap (harness_phase.max_proposer_*) is reached; the reason is on the ledger."""
        reason = budget_exhausted(self.cfg.harness_phase, total_usage(self.state.proposer_sessions))
        if reason is not None and self.state.ledger.proposer_stop is None:
            self.state.ledger.proposer_stop = reason
            self.state.save(self.run_dir)
        return reason is not None

    def _leakage(self, cid: str) -> str | None:
        """Why a proposed candidate's code leaks D_test questions, or None. The seed and re-evaluations
        (the parent's code unchanged) are not proposer output and are not checked."""
        c = self.archive.get(cid)
        if c.parent is None or c.code == self.archive.get(c.parent).code:
            return None
        return self.leakage_guard.check(c.code)

    def evaluate_candidates(self, ids: list[str], cycle: int, iteration: int) -> None:
        """Validate (static check, D_test leakage check, then a one-example smoke test in the sandbox) and
        evaluate on D_harness; the candidates of an iteration run side by side in the evaluator pool."""
        valid = []
        for cid in ids:
            if self.archive.get(cid).status != "proposed":
                continue
            try:
                check_harness_source(self.archive.get(cid).code, f"{cid}/harness.py")
            except ValueError as e:
                self._reject(cid, str(e))
                continue
            leak = self._leakage(cid)
            if leak is not None:  # D_test text in the code: never run, never scored
                self._reject(cid, leak)
                self.state.ledger.candidates_leaked += 1
            else:
                valid.append(cid)
        smoke = self.rollout_many([(cid, self.splits.harness[:1], 1) for cid in valid],
                                  phase="validate", cycle=cycle, unit=iteration)
        for cid, (ep,) in zip(valid, smoke):
            self._write_rollouts(f"validate-c{cycle:02d}-i{iteration:03d}-{cid}", [ep])
        self.state.save(self.run_dir)  # rollouts on record before the archive moves on
        passed = []
        for cid, (ep,) in zip(valid, smoke):
            if ep.status == "ok":
                passed.append(cid)
            else:
                self._reject(cid, f"smoke test: {ep.status}: {ep.reason}")
        valid = passed
        per_example = self.cfg.harness_phase.rollouts_per_example
        evaluations = self.rollout_many([(cid, self.splits.harness, per_example) for cid in valid],
                                        phase="harness", cycle=cycle, unit=iteration)
        for cid, rollouts in zip(valid, evaluations):
            self._write_rollouts(f"harness-c{cycle:02d}-i{iteration:03d}-{cid}", rollouts)
            self.state.save(self.run_dir)
            rows = [{"task_id": r.task_id, "reward": r.reward, "turns": r.turns, "prompt_tokens": r.prompt_tokens,
                     "status": r.status, "truncated": r.truncated} for r in rollouts]
            self.archive.record_evaluation(cid, rows, [r.trace for r in rollouts], self.state.weight_version)
        self.state.save(self.run_dir)

    def _reject(self, cid: str, reason: str) -> None:
        self.archive.mark_invalid(cid, reason)
        self.state.ledger.candidates_invalid += 1

    # ------------------------------------------------------------------ selection and report
    def finish_cycle(self, cycle: int, phases: list[Phase], wall_s: float) -> None:
        accepted = self.state.accepted_harness
        self._set_progress(phase="select", detail="D_val")
        val, _ = self.evaluate_split("val", accepted, self.cfg.eval.val_samples)
        best = self.state.best
        if best is None or val > best.val:
            best = Selection(weight_version=self.state.weight_version, checkpoint=self.state.checkpoint,
                             harness_id=accepted, val=val)
        self._set_progress(phase="report", detail="D_test mean@8")
        # theta* is the current policy whenever the best just changed, so its test score is computed
        # under loaded weights; an older best's score is already in the cache.
        test, test_metrics = self.evaluate_split("test", best.harness_id, self.cfg.eval.test_samples,
                                                 version=best.weight_version)
        rewards = self._weight_rewards(cycle)
        spent, start = self.state.ledger, self.state.cycle_start or self.state.ledger
        row = CycleRow(
            cycle=cycle + 1, phases=" + ".join(p.label() for p in phases) or "start (θ0, h0)",
            weight_rollouts=spent.weight_rollouts - start.weight_rollouts,
            harness_rollouts=spent.harness_rollouts - start.harness_rollouts,
            train_reward=(sum(rewards) / len(rewards)) if rewards else None,
            accepted_harness=accepted,
            harness_success=(self.archive.get(accepted).scores or {}).get("success_rate"),
            weight_version=self.state.weight_version, val=val, best_val=best.val,
            best=f"v{best.weight_version}+{best.harness_id}", test_mean8=test, wall_s=round(wall_s, 1),
            test_metrics=test_metrics,
        )
        self.state.best = best
        self.state.history.append(row)
        self.state.cycle = cycle + 1
        self.state.phase = None
        self.state.cycle_start = None
        self.state.save(self.run_dir)
        if self._on_cycle is not None:
            self._on_cycle(row)

    def evaluate_split(self, split: str, harness_id: str, samples: int,
                       version: int | None = None) -> tuple[float, dict[str, float]]:
        """Mean reward and split_metrics of `samples` episodes per task; cached per (split, version, harness)."""
        version = self.state.weight_version if version is None else version
        key = f"{split}|v{version}|{harness_id}|{samples}"
        if key not in self.state.eval_cache:
            assert version == self.state.weight_version, "evaluations run under the loaded weights only"
            tasks = getattr(self.splits, split)
            rollouts = self.rollout(harness_id, tasks, samples=samples, phase=split, cycle=self.state.cycle, unit=0)
            self._write_rollouts(f"{split}-v{version:05d}-{harness_id}", rollouts)
            self.state.eval_cache[key] = sum(r.reward for r in rollouts) / len(rollouts)
            self.state.eval_metrics[key] = split_metrics(rollouts, {t.id: t for t in tasks})
            self.state.save(self.run_dir)
        return self.state.eval_cache[key], self.state.eval_metrics.get(key, {})

    # ---------------------------------------------------------------------------- rollouts
    def rollout(self, harness_id: str, tasks: list[Task], *, samples: int, phase: str, cycle: int,
                unit: int) -> list[Rollout]:
        return self.rollout_many([(harness_id, tasks, samples)], phase=phase, cycle=cycle, unit=unit)[0]

    def rollout_many(self, work: list[tuple[str, list[Task], int]], *, phase: str, cycle: int,
                     unit: int) -> list[list[Rollout]]:
        """Runs `samples` episodes per task for each (harness, tasks, samples) through the evaluator pool,
        all at once, and scores them with the verifier, which lives here in the trusted process."""
        version = self.state.weight_version
        submitted, total = [], 0
        for harness_id, tasks, samples in work:
            meta = [(t, s, episode_seed(self.cfg.seed, phase, cycle, unit, harness_id, t.id, s))
                    for t in tasks for s in range(samples)]
            jobs = [EpisodeJob(task=t, seed=seed) for t, _, seed in meta]
            refs = self.pool.submit(self.archive.get(harness_id).code, f"{harness_id}.py", jobs)
            submitted.append((harness_id, meta, refs))
            total += len(jobs)
        self._set_progress(done=0, total=total)
        owner = {ref: (i, start) for i, (_, _, refs) in enumerate(submitted) for start, ref in refs}
        results: list[list[EpisodeResult | None]] = [[None] * len(meta) for _, meta, _ in submitted]
        done = 0
        while owner:
            ready, _ = ray.wait(list(owner), num_returns=1)
            i, start = owner.pop(ready[0])
            chunk = ray.get(ready[0])
            results[i][start:start + len(chunk)] = chunk
            done += len(chunk)
            self._set_progress(done=done)
        out = []
        for (harness_id, meta, _), episodes in zip(submitted, results):
            out.append([
                Rollout.from_episode(ep, phase=phase, cycle=cycle, harness_id=harness_id, task=task, sample=sample,
                                     seed=seed, weight_version=version,
                                     reward=self.verifier(task, ep.answer) if ep.status == "ok" else 0.0,
                                     metrics=self.domain.episode_metrics(task, ep))
                for (task, sample, seed), ep in zip(meta, episodes)
            ])
        return out

    def _write_rollouts(self, name: str, rollouts: list[Rollout]) -> None:
        """Stores rollouts as rollouts/<name>.parquet and puts them on record (with the next state save).
        Work that is redone after a crash writes the same name, so nothing is counted twice."""
        path = self.run_dir / "rollouts" / f"{name}.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".parquet.tmp")
        pq.write_table(rollouts_to_table(rollouts), tmp)
        tmp.replace(path)
        self.state.rollout_files[name] = len(rollouts)
        counts = {"weight": 0, "harness": 0, "validate": 0, "val": 0, "test": 0}
        for recorded, n in self.state.rollout_files.items():
            counts[recorded.split("-", 1)[0]] += n
        ledger = self.state.ledger
        ledger.weight_rollouts = counts["weight"]
        ledger.harness_rollouts = counts["harness"] + counts["validate"]
        ledger.eval_rollouts = counts["val"] + counts["test"]

    def _weight_rewards(self, cycle: int) -> list[float]:
        rewards = []
        for path in sorted((self.run_dir / "rollouts").glob(f"weight-c{cycle:02d}-*.parquet")):
            rewards += pq.read_table(path, columns=["reward"]).column("reward").to_pylist()
        return rewards

    # -------------------------------------------------------------------------- bookkeeping
    def _start_state(self) -> RunState:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.run_dir / "config.yaml", dump_config(self.cfg))
        h0 = Path(self.cfg.harness) if self.cfg.harness else self.domain.h0_path
        self.archive.add_candidate(h0.read_text(), parent=None, hypothesis=f"seed harness from {h0}",
                                   iteration=0, cycle=0, candidate_id="h0")
        state = RunState(accepted_harness="h0")
        state.save(self.run_dir)
        return state

    def _start_actors(self) -> None:
        model = str(self.run_dir / self.state.checkpoint) if self.state.checkpoint else self.base_model
        p = self.cfg.policy
        self.policy = PolicyServer.options(num_cpus=1, scheduling_strategy=CLUSTER).remote(
            model, engine=p.engine, max_batch=p.max_batch, batch_wait_ms=p.batch_wait_ms,
            version=self.state.weight_version, device=p.device, dtype=p.dtype, seed=self.cfg.seed)
        self.services = self.domain.start_services(self.cfg, self.splits)
        self.pool = EvaluatorPool(self.cfg.domain, self.policy, self.cfg.sandbox, self.services)
        self.trainer = None
        if any(ph.kind == "weight" for phases in self.plan for ph in phases):
            self.trainer = Trainer.options(num_cpus=0, scheduling_strategy=CLUSTER).remote(
                self.base_model, self.cfg.weight.model_dump(), str(self.run_dir / "trainer"), seed=self.cfg.seed)
            if self.state.checkpoint:
                ray.get(self.trainer.load_checkpoint.remote(str(self.run_dir / self.state.checkpoint)))
        self.proposer = HarnessProposer.options(num_cpus=0, scheduling_strategy=CLUSTER).remote(
            self.cfg.harness_phase.proposer, self.domain.skill_text, self.cfg.seed,
            **proposer_options(self.cfg.harness_phase))

    def _drop_uncommitted_rollouts(self) -> None:
        """On resume, rollout files that the state never recorded belong to unfinished work, which is redone."""
        for path in (self.run_dir / "rollouts").glob("*.parquet*"):
            if path.suffix != ".parquet" or path.stem not in self.state.rollout_files:
                path.unlink()

    def _phase_finished(self, cycle: int, index: int) -> bool:
        p = self.state.phase
        return p is not None and p.cycle == cycle and (p.index > index or (p.index == index and p.done))

    def _enter_phase(self, cycle: int, index: int, phase: Phase) -> PhaseProgress:
        p = self.state.phase
        if p is None or p.cycle != cycle or p.index != index:
            self.state.phase = PhaseProgress(cycle=cycle, index=index, kind=phase.kind)
            self.state.save(self.run_dir)
        return self.state.phase

    def _leave_phase(self, prog: PhaseProgress) -> None:
        prog.done = True
        self.state.phases_done.append(f"{prog.cycle + 1}:{prog.kind}:{prog.units_done}")
        self.state.phase_wall_s[prog.kind] = self.state.phase_wall_s.get(prog.kind, 0.0) + prog.wall_s
        self.state.save(self.run_dir)

    def _prune_checkpoints(self) -> None:
        keep = {self.state.checkpoint, self.state.best.checkpoint if self.state.best else None}
        for path in (self.run_dir / "checkpoints").glob("v*"):
            if str(path.relative_to(self.run_dir)) not in keep:
                shutil.rmtree(path, ignore_errors=True)

    def _set_progress(self, **fields: Any) -> None:
        with self._lock:
            for k, v in fields.items():
                setattr(self.progress, k, v)

    # ------------------------------------------------------------------------------ queries
    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"progress": vars(self.progress).copy(), "history": [r.model_dump() for r in self.state.history],
                    "ledger": self.state.ledger.model_dump(), "phase_wall_s": dict(self.state.phase_wall_s),
                    "best": self.state.best.model_dump() if self.state.best else None}


@ray.remote(num_cpus=0, max_concurrency=4)
class CoordinatorActor:
    """Thin shell: run() works in one thread while snapshot() answers the driver from another."""

    def __init__(self, cfg: dict[str, Any], base_model: str):
        self._coordinator = Coordinator(WhaleConfig.model_validate(cfg), base_model)

    def run(self) -> list[dict[str, Any]]:
        return [r.model_dump() for r in self._coordinator.run()]

    def snapshot(self) -> dict[str, Any]:
        return self._coordinator.snapshot()
