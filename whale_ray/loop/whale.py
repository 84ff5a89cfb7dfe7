"""WHALE, the alternation itself:

    (θ, h) ← (θ0, h0); report (θ0, h0) as row 0
    for each cycle of the schedule (whale_ray.schedules.plan: the condition as data):
        weight phase:  θ ← RSFT(θ | h)          for E epochs of D_weight     (weight_phase.py)
        harness phase: h ← MetaHarness(h | θ)   for I iterations             (harness_phase.py)
        (θ*, h*) ← the pair with the best D_val so far; report its D_test mean@k       (report.py)

The loop is handed its roles (context.Roles) and the run directory; it never starts an actor, so it runs
the same under the Coordinator actor on a cluster and over in-process objects in tests. Every unit of
work ends in a commit of the run directory, so relaunching resumes where the last launch stopped.
"""

from __future__ import annotations

from typing import Callable

from whale_ray.archive import Archive
from whale_ray.config import WhaleConfig
from whale_ray.domain import Domain, Splits
from whale_ray.loop.context import Progress, Roles, RunContext
from whale_ray.loop.harness_phase import HarnessSearch
from whale_ray.loop.report import Report
from whale_ray.loop.run_dir import RunDirectory
from whale_ray.loop.weight_phase import retrain_unsaved_steps, settle_checkpoint, weight_phase
from whale_ray.run_state import CycleRow, PhaseProgress, RunState
from whale_ray.schedules import Phase, plan


class WhaleLoop:
    def __init__(self, cfg: WhaleConfig, roles: Roles, run: RunDirectory, domain: Domain, splits: Splits):
        self.plan = plan(cfg)
        self.progress = Progress(cycles=len(self.plan))
        self.ctx = RunContext(cfg=cfg, domain=domain, splits=splits, verifier=domain.make_verifier(cfg), run=run,
                              archive=Archive(run.root / "archive"), roles=roles, progress=self.progress)
        self.report = self.ctx.report = Report(self.ctx)
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
        self.report.on_row = on_cycle
        retrain_unsaved_steps(self.ctx)  # a relaunch first brings the weights to the record
        self.report.finish()  # and reports a cycle whose evaluations were cut short
        if not self.state.history:
            self.report.close(-1, [])  # row 0: (θ0, h0), the starting point
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
            settle_checkpoint(self.ctx)  # the weight phase's last checkpoint, written beside the harness phase
            self.report.close(c, phases)  # selection and report: beside the next cycle's first episodes
        self.report.finish()
        self.state.finished = True
        self.ctx.run.commit()
        self.progress.set(phase="finished", detail="")
        return self.state.history

    # ----------------------------------------------------------------------------- phases
    def phase_finished(self, cycle: int, index: int) -> bool:
        return phase_finished(self.state, cycle, index)

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


def phase_finished(state: RunState, cycle: int, index: int) -> bool:
    p = state.phase
    return p is not None and p.cycle == cycle and (p.index > index or (p.index == index and p.done))


def trains_again(schedule: list[list[Phase]], state: RunState) -> bool:
    """Whether a launch at `state` has Trainer steps ahead: a weight phase not finished, or steps on record to train
    again (a relaunch before the weight phase's last checkpoint was on record). A launch without any starts no Ray
    Train run; the Coordinator asks before it makes the loop, so that the run starts beside the other actors'."""
    if state.finished:
        return False
    if state.checkpoint_pending is not None:  # retrain_unsaved_steps' own test
        return True
    return any(phase.kind == "weight" and not phase_finished(state, c, i)
               for c, phases in enumerate(schedule) if c >= state.cycle for i, phase in enumerate(phases))
