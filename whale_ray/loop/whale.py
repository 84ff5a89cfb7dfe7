"""WHALE, the alternation itself:

    (θ, h) ← (θ0, h0); report (θ0, h0) as row 0
    for each cycle of the schedule (whale_ray.schedules.plan: the condition as data):
        weight phase:  θ ← RSFT(θ | h)          for E epochs of D_weight     (weight_phase.py)
        harness phase: h ← MetaHarness(h | θ)   for I iterations             (harness_phase.py)
        (θ*, h*) ← the pair with the best D_val so far; report its D_test mean@k

The loop is handed its roles (context.Roles) and the run directory; it never starts an actor, so it runs
the same under the Coordinator actor on a cluster and over in-process objects in tests. Every unit of
work ends in a commit of the run directory, so relaunching resumes where the last launch stopped.
"""

from __future__ import annotations

from typing import Callable

from whale_ray import selection
from whale_ray.archive import Archive
from whale_ray.config import WhaleConfig
from whale_ray.domain import Domain, Splits
from whale_ray.loop.context import Progress, Roles, RunContext
from whale_ray.loop.harness_phase import HarnessSearch
from whale_ray.loop.rollouts import mean_reward, rollout, split_metrics
from whale_ray.loop.run_dir import RunDirectory, evaluation_name
from whale_ray.loop.weight_phase import weight_phase
from whale_ray.run_state import CycleRow, Evaluation, PhaseProgress, Selection
from whale_ray.schedules import Phase, plan


class WhaleLoop:
    def __init__(self, cfg: WhaleConfig, roles: Roles, run: RunDirectory, domain: Domain, splits: Splits):
        self.plan = plan(cfg)
        self.progress = Progress(cycles=len(self.plan))
        self.ctx = RunContext(cfg=cfg, domain=domain, splits=splits, verifier=domain.make_verifier(cfg), run=run,
                              archive=Archive(run.root / "archive"), roles=roles, progress=self.progress)
        self.search = HarnessSearch(self.ctx)
        if not run.exists:
            h0 = cfg.harness or domain.h0_path
            self.ctx.archive.add_candidate(h0.read_text(), parent=None, hypothesis=f"seed harness from {h0}",
                                           iteration=0, cycle=0, candidate_id="h0")
            run.create(cfg)
        run.start_launch()

    @property
    def state(self):
        return self.ctx.run.state

    def run(self, on_cycle: Callable[[CycleRow], None] | None = None) -> list[CycleRow]:
        """Runs (or resumes) the schedule; `on_cycle` sees each cycle's row as it is recorded."""
        if not self.state.history:
            self.select_and_report(-1, [], on_cycle)  # row 0: (θ0, h0), the starting point
        for c, phases in enumerate(self.plan):
            if c < self.state.cycle:
                continue
            for i, phase in enumerate(phases):
                if self.phase_finished(c, i):
                    continue
                self.progress.set(cycle=c + 1, phase=phase.label())
                prog = self.enter_phase(c, i, phase)
                if phase.kind == "weight":
                    weight_phase(self.ctx, c, prog, phase)
                else:
                    self.search.run(c, prog, phase)
                self.leave_phase(prog)
            self.select_and_report(c, phases, on_cycle)
        self.state.finished = True
        self.ctx.run.commit()
        self.progress.set(phase="finished", detail="")
        return self.state.history

    # ------------------------------------------------------------------ selection and report
    def select_and_report(self, cycle: int, phases: list[Phase], on_cycle: Callable[[CycleRow], None] | None) -> None:
        """Scores the current pair on D_val, keeps the best-so-far (θ*, h*) and reports it on D_test."""
        state, cfg = self.state, self.ctx.cfg
        accepted = state.accepted_harness
        self.progress.set(phase="select", detail="D_val")
        val = self.evaluate("val", accepted, cfg.eval.val_samples)
        best = state.best
        if selection.improves_on_val(val.mean, None if best is None else best.val):  # ties keep the earlier pair
            best = Selection(weight_version=state.weight_version, checkpoint=state.checkpoint, harness_id=accepted,
                             val=val.mean)
        self.progress.set(phase="report", detail=f"D_test mean@{cfg.eval.test_samples}")
        # θ* is the loaded policy whenever the best just changed; an older best's test score is on record.
        test = self.evaluate("test", best.harness_id, cfg.eval.test_samples, version=best.weight_version)
        rewards = self.ctx.run.rewards("weight", cycle)
        spent, start = state.ledger, state.cycle_start or state.ledger
        row = CycleRow(
            cycle=cycle + 1, phases=" + ".join(p.label() for p in phases) or "start (θ0, h0)",
            weight_rollouts=spent.weight_rollouts - start.weight_rollouts,
            harness_rollouts=spent.harness_rollouts - start.harness_rollouts,
            train_reward=(sum(rewards) / len(rewards)) if rewards else None,
            accepted_harness=accepted, harness_success=(self.ctx.archive.get(accepted).scores or {}).get("success_rate"),
            weight_version=state.weight_version, val=val.mean, best_val=best.val,
            best=f"v{best.weight_version}+{best.harness_id}", test_mean8=test.mean, test_samples=cfg.eval.test_samples,
            wall_s=round(self.ctx.run.cycle_elapsed() if phases else 0.0, 1), test_metrics=test.metrics,
            ledger=spent.model_copy(),
        )
        state.best = best
        state.history.append(row)
        state.cycle, state.phase, state.cycle_start, state.cycle_wall_s = cycle + 1, None, None, 0.0
        self.ctx.run.commit()
        if on_cycle is not None:
            on_cycle(row)

    def evaluate(self, split: str, harness_id: str, samples: int, version: int | None = None) -> Evaluation:
        """`samples` episodes per task of a split for one pair; each pair is evaluated once per run."""
        run = self.ctx.run
        version = run.state.weight_version if version is None else version
        done = run.evaluation(split, version, harness_id, samples)
        if done is not None:
            return done
        assert version == run.state.weight_version, "evaluations run under the loaded weights only"
        tasks = getattr(self.ctx.splits, split)
        rollouts = rollout(self.ctx, harness_id, tasks, samples=samples, phase=split, cycle=run.state.cycle, unit=0)
        run.write_rollouts(evaluation_name(split, version, harness_id), split, run.state.cycle, rollouts)
        result = Evaluation(split=split, weight_version=version, harness_id=harness_id, samples=samples,
                            mean=mean_reward(rollouts), metrics=split_metrics(rollouts, {t.id: t for t in tasks}))
        run.record_evaluation(result)
        run.commit()
        return result

    # ----------------------------------------------------------------------------- phases
    def phase_finished(self, cycle: int, index: int) -> bool:
        p = self.state.phase
        return p is not None and p.cycle == cycle and (p.index > index or (p.index == index and p.done))

    def enter_phase(self, cycle: int, index: int, phase: Phase) -> PhaseProgress:
        state = self.state
        if state.cycle_start is None:
            state.cycle_start = state.ledger.model_copy()
        p = state.phase
        if p is None or p.cycle != cycle or p.index != index:
            state.phase = PhaseProgress(cycle=cycle, index=index, kind=phase.kind)
            self.ctx.run.commit()
        return state.phase

    def leave_phase(self, prog: PhaseProgress) -> None:
        prog.done = True
        self.state.phases_done.append(f"{prog.cycle + 1}:{prog.kind}:{prog.units_done}")
        self.state.phase_wall_s[prog.kind] = self.state.phase_wall_s.get(prog.kind, 0.0) + prog.wall_s
        self.ctx.run.commit()

