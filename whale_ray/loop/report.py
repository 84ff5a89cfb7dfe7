"""A cycle's report: (θ*, h*) ← the pair with the best D_val so far; its D_test mean@k; the cycle's row.

    close(cycle):   the cycle's phases are done; what its row says of them is fixed now (state.report)
    beside():       its next evaluation, which joins the next pool call made under the weights it ended with
    finish():       whatever it still waits on, alone: before the weights change, before the next cycle's report,
                    at the run's end, and at once when eval.overlap is off
    meanwhile():    the same, in a thread, while the loop waits on a proposer session

Selection reads nothing but the pairs' D_val and D_test scores, and nothing in the next cycle reads selection,
so an evaluation run later under the same weights changes no row: its episodes are seeded by the cycle that
asked for them, not by when they ran. D_test waits for D_val: only a pair that becomes the best is reported.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable, Iterator

from whale_ray import selection
from whale_ray.loop.context import Batch, RunContext
from whale_ray.loop.rollouts import mean_reward, run_batches, split_metrics
from whale_ray.loop.run_dir import evaluation_name
from whale_ray.records import Rollout
from whale_ray.run_state import CycleRow, Evaluation, PendingReport, Selection
from whale_ray.schedules import Phase


class Report:
    def __init__(self, ctx: RunContext):
        self.ctx = ctx
        self.on_row: Callable[[CycleRow], None] | None = None  # sees each row once it is on record
        self._unannounced: list[CycleRow] = []

    def close(self, cycle: int, phases: list[Phase]) -> None:
        """Cycle `cycle` (-1: the start) has ended; its evaluations wait, under the weights it ended with."""
        self.finish()
        run, state = self.ctx.run, self.ctx.run.state
        accepted = state.accepted_harness
        rewards = run.rewards("weight", cycle)
        state.report = PendingReport(
            cycle=cycle, phases=" + ".join(p.label() for p in phases) or "start (θ0, h0)",
            weight_version=state.weight_version, checkpoint=state.checkpoint, harness_id=accepted,
            harness_success=(self.ctx.archive.get(accepted).scores or {}).get("success_rate"),
            train_reward=(sum(rewards) / len(rewards)) if rewards else None,
            start=(state.cycle_start or state.ledger).model_copy(), spent=state.ledger.model_copy(),
            wall_s=round(run.cycle_elapsed() if phases else 0.0, 1))
        state.cycle, state.phase, state.cycle_start, state.cycle_wall_s = cycle + 1, None, None, 0.0
        run.commit()
        if not self.ctx.cfg.eval.overlap:
            self.finish()

    def beside(self) -> list[Batch]:
        """The evaluation to run beside the caller's episodes (none when nothing waits)."""
        batch = self._next()
        return [] if batch is None else [batch]

    def take(self, batches: list[Batch], results: list[list[Rollout]]) -> None:
        for batch, rollouts in zip(batches, results):
            self._record(batch, rollouts)
        self._settle()
        self._announce()

    def finish(self) -> None:
        self._run_alone()
        self._announce()

    @contextmanager
    def meanwhile(self) -> Iterator[None]:
        """Runs what the report waits on in a thread while the caller waits on work that uses neither the pool nor
        the weights; its row is announced (`on_row`: a Tune report, say) in the caller's thread."""
        if self._next() is None:
            yield
            return
        failed: list[BaseException] = []

        def work() -> None:
            try:
                self._run_alone()
            except BaseException as e:  # re-raised in the caller's thread
                failed.append(e)

        thread = threading.Thread(target=work, name="whale-report", daemon=True)
        thread.start()
        try:
            yield
        finally:
            thread.join()
        if failed:
            raise failed[0]
        self._announce()

    def _run_alone(self) -> None:
        while (batch := self._next()) is not None:
            self.ctx.progress.set(phase="report", detail=f"D_{batch.phase} mean@{batch.samples}")
            [rollouts] = run_batches(self.ctx, [batch], timed_as=batch.phase)
            self._record(batch, rollouts)
        self._settle()

    def _announce(self) -> None:
        rows, self._unannounced = self._unannounced, []
        for row in rows:
            if self.on_row is not None:
                self.on_row(row)

    # ------------------------------------------------------------------------------------------------ the record
    def _scores(self, p: PendingReport) -> tuple[Evaluation | None, Selection | None, Evaluation | None]:
        """The cycle's D_val, the best pair it makes, and that pair's D_test, as far as they are on record."""
        run, ev = self.ctx.run, self.ctx.cfg.eval
        val = run.evaluation("val", p.weight_version, p.harness_id, ev.val_samples)
        if val is None:
            return None, None, None
        best = run.state.best
        if selection.improves_on_val(val.mean, None if best is None else best.val):  # ties keep the earlier pair
            best = Selection(weight_version=p.weight_version, checkpoint=p.checkpoint, harness_id=p.harness_id,
                             val=val.mean)
        return val, best, run.evaluation("test", best.weight_version, best.harness_id, ev.test_samples)

    def _next(self) -> Batch | None:
        """D_val of the cycle's pair, then D_test of the best pair if it is not on record; None once both are."""
        run, ev = self.ctx.run, self.ctx.cfg.eval
        p = run.state.report
        if p is None:
            return None
        assert p.weight_version == run.state.weight_version, "a cycle's report runs under the weights it ended with"
        splits, cycle = self.ctx.splits, max(p.cycle, 0)  # the start's evaluations are filed under cycle 0
        val, best, test = self._scores(p)
        if val is None:
            return Batch(p.harness_id, splits.val, ev.val_samples, "val", cycle, 0)
        if test is None:
            assert best.weight_version == p.weight_version, "an earlier best's D_test is on record"
            return Batch(best.harness_id, splits.test, ev.test_samples, "test", cycle, 0)
        return None

    def _record(self, batch: Batch, rollouts: list[Rollout]) -> None:
        run, version = self.ctx.run, self.ctx.run.state.weight_version
        run.write_rollouts(evaluation_name(batch.phase, version, batch.harness_id), batch.phase, batch.cycle, rollouts)
        run.record_evaluation(Evaluation(
            split=batch.phase, weight_version=version, harness_id=batch.harness_id, samples=batch.samples,
            mean=mean_reward(rollouts), metrics=split_metrics(rollouts, {t.id: t for t in batch.tasks})))
        run.commit()

    def _settle(self) -> None:
        """The row, once nothing is left to evaluate: it goes on record with the new best in one commit."""
        run, state, p = self.ctx.run, self.ctx.run.state, self.ctx.run.state.report
        if p is None:
            return
        val, best, test = self._scores(p)
        if test is None:
            return
        row = CycleRow(
            cycle=p.cycle + 1, phases=p.phases, weight_rollouts=p.spent.weight_rollouts - p.start.weight_rollouts,
            harness_rollouts=p.spent.harness_rollouts - p.start.harness_rollouts, train_reward=p.train_reward,
            accepted_harness=p.harness_id, harness_success=p.harness_success, weight_version=p.weight_version,
            val=val.mean, best_val=best.val, best=f"v{best.weight_version}+{best.harness_id}", test_mean8=test.mean,
            test_samples=self.ctx.cfg.eval.test_samples, wall_s=p.wall_s, test_metrics=test.metrics,
            ledger=p.spent.model_copy(update={"eval_rollouts": state.ledger.eval_rollouts}))
        state.best, state.report = best, None
        state.history.append(row)
        run.commit()
        self._unannounced.append(row)
