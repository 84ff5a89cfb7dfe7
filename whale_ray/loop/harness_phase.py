"""The harness phase: a Meta-Harness search under the current weights.

    iteration 1: evaluate the incoming harness under the current weights
    each later iteration:
        the proposer reads the archive (code, scores, traces) and writes M candidates
        validate each (static check, D_test leakage check, a one-example smoke test in the sandbox)
        evaluate the valid ones on D_harness, side by side
        accept the frontier's top (whale_ray.selection)

Each proposer session is logged under <run_dir>/proposer/iter-NNNN/ before its candidates enter the
archive, so a relaunch never runs a finished session again nor counts its usage twice.
"""

from __future__ import annotations

import time

from whale_ray import selection
from whale_ray.archive import ArchiveError, Candidate
from whale_ray.harness import check_harness_source
from whale_ray.loop.context import RunContext
from whale_ray.loop.rollouts import rollout_many
from whale_ray.loop.run_dir import candidate_rollouts_name
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
from whale_ray.run_state import IterationRow, PhaseProgress
from whale_ray.schedules import Phase, harness_phase_should_stop


class HarnessSearch:
    def __init__(self, ctx: RunContext):
        self.ctx = ctx
        s = ctx.splits
        others = [t.question for t in (*s.weight, *s.harness, *s.val)]
        self.leakage_guard = LeakageGuard([t.question for t in s.test], others)

    def run(self, cycle: int, prog: PhaseProgress, phase: Phase) -> None:
        ctx, state = self.ctx, self.ctx.run.state
        while prog.units_done < phase.budget:
            if phase.adaptive and harness_phase_should_stop(prog.units_done, prog.best_success, ctx.cfg.adaptive):
                break
            if prog.units_done > 0 and self.proposer_budget_spent():
                break  # a run-wide proposer cap: harness search ends here, with the state saved
            started = time.perf_counter()
            iteration = state.ledger.harness_iterations + 1  # archive-wide, so a relaunch finds its pending work
            if prog.units_done == 0:
                candidates = [self.incoming_candidate(cycle, iteration)]
            else:
                candidates = self.proposed_candidates(cycle, iteration)
            self.evaluate_candidates(candidates, cycle, iteration)
            best = selection.accept(ctx.archive.candidates("evaluated"), weight_version=state.weight_version,
                                    noise_margin=ctx.cfg.harness_phase.noise_margin, incumbent=self.incumbent())
            state.accepted_harness = best.id
            prog.best_success.append(best.success_rate)
            prog.units_done += 1
            prog.wall_s += time.perf_counter() - started
            state.ledger.harness_iterations += 1
            state.iterations.append(IterationRow(
                iteration=iteration, cycle=cycle, accepted=best.id, accepted_success=best.success_rate,
                candidates={cid: self.success(cid) for cid in candidates},
                proposer_tokens=state.ledger.proposer_tokens, proposer_cost_usd=state.ledger.proposer_cost_usd))
            ctx.run.commit()
            ctx.progress.set(detail=f"iteration {prog.units_done}: accepted {best.id} (success {best.success_rate:.3f})")

    def success(self, cid: str) -> float | None:
        c = self.ctx.archive.get(cid)
        return c.success_rate if c.status == "evaluated" else None

    def incumbent(self) -> Candidate | None:
        """The accepted harness, when its scores were measured under the current weights."""
        state = self.ctx.run.state
        return selection.incumbent(self.ctx.archive.get(state.accepted_harness), state.weight_version)

    def incoming_candidate(self, cycle: int, iteration: int) -> str:
        """Iteration 1 evaluates the incoming harness under the current weights (once per version)."""
        archive, state = self.ctx.archive, self.ctx.run.state
        pending = archive.pending(iteration)
        if pending:
            return pending[0].id
        incoming = archive.get(state.accepted_harness)
        if incoming.status == "proposed" or self.incumbent() is not None:
            return incoming.id  # the seed before its first evaluation, or already scored under these weights
        return archive.add_reevaluation(incoming.id, weight_version=state.weight_version, cycle=cycle,
                                        iteration=iteration)

    # ---------------------------------------------------------------------------- proposing
    def proposed_candidates(self, cycle: int, iteration: int) -> list[str]:
        """The proposer's candidates for this iteration. A session killed mid-way is kept as aborted-<k>.json
        (its spending counted) and runs afresh."""
        ctx, state, hp = self.ctx, self.ctx.run.state, self.ctx.cfg.harness_phase
        sdir = session_dir(ctx.run.root, iteration)
        record = load_session(sdir)
        if record is None:
            pending = ctx.archive.pending(iteration)
            if pending:  # proposed before a restart by a run without session logs: evaluate them
                return [c.id for c in pending]
            retire_partial(sdir)
            self.record_proposer_sessions(sdir)
            limits = remaining_limits(hp, total_usage(state.proposer_sessions))
            ctx.progress.set(detail=f"iteration {iteration}: {hp.proposer} proposer session")
            with ctx.run.timed("harness", "propose"), ctx.report.meanwhile():
                result = ctx.roles.proposer.session(str(ctx.archive.root), hp.candidates_per_iteration, iteration,
                                                    limits.to_dict(), str(sdir / PARTIAL_FILE))
            record = {**result["session"], "proposals": result["proposals"], "cycle": cycle}
            write_session(sdir, record)
        self.record_proposer_sessions(sdir)
        done = {(c.code, c.parent, c.hypothesis) for c in ctx.archive.candidates() if c.iteration == iteration}
        added = 0
        for p in record.get("proposals") or []:
            if (p["code"], p["parent"], p["hypothesis"]) in done:
                continue  # added before a restart
            try:
                ctx.archive.add_candidate(p["code"], parent=p["parent"], hypothesis=p["hypothesis"],
                                          iteration=iteration, cycle=cycle)
            except ArchiveError:
                continue  # a proposal naming no archive parent: the session log keeps it
            done.add((p["code"], p["parent"], p["hypothesis"]))
            added += 1
        state.ledger.candidates_proposed += added
        ctx.run.commit()
        return [c.id for c in ctx.archive.pending(iteration)]

    def record_proposer_sessions(self, directory) -> None:
        """Puts the sessions logged in `directory` on record and rebuilds the proposer ledger from the record."""
        state = self.ctx.run.state
        for name, usage in logged_sessions(directory):
            state.proposer_sessions[name] = usage.to_dict()
        total, led = total_usage(state.proposer_sessions), state.ledger
        led.proposer_sessions, led.proposer_calls, led.proposer_retries = total.sessions, total.calls, total.retries
        led.proposer_prompt_tokens, led.proposer_completion_tokens = total.prompt_tokens, total.completion_tokens
        led.proposer_cached_tokens, led.proposer_cost_usd, led.proposer_wall_s = (
            total.cached_tokens, round(total.cost_usd, 8), round(total.wall_s, 3))

    def proposer_budget_spent(self) -> bool:
        """True once a run-wide proposer cap (harness_phase.max_proposer_*) is reached; the reason is on the ledger."""
        state = self.ctx.run.state
        reason = budget_exhausted(self.ctx.cfg.harness_phase, total_usage(state.proposer_sessions))
        if reason is not None and state.ledger.proposer_stop is None:
            state.ledger.proposer_stop = reason
            self.ctx.run.commit()
        return reason is not None

    # --------------------------------------------------------------------- validate, evaluate
    def leakage(self, cid: str) -> str | None:
        """Why a proposed candidate's code leaks D_test questions, or None. The seed and re-evaluations
        (the parent's code unchanged) are not proposer output and are not checked."""
        archive = self.ctx.archive
        c = archive.get(cid)
        if c.parent is None or c.code == archive.get(c.parent).code:
            return None
        return self.leakage_guard.check(c.code)

    def evaluate_candidates(self, ids: list[str], cycle: int, iteration: int) -> None:
        """Validate and evaluate on D_harness; the candidates of an iteration run side by side in the pool."""
        ctx, archive, state = self.ctx, self.ctx.archive, self.ctx.run.state
        valid = []
        for cid in ids:
            if archive.get(cid).status != "proposed":
                continue
            try:
                check_harness_source(archive.get(cid).code, f"{cid}/harness.py")
            except ValueError as e:
                self.reject(cid, str(e))
                continue
            leak = self.leakage(cid)
            if leak is not None:  # D_test text in the code: never run, never scored
                self.reject(cid, leak)
                state.ledger.candidates_leaked += 1
            else:
                valid.append(cid)
        smoke = rollout_many(ctx, [(cid, ctx.splits.harness[:1], 1) for cid in valid], phase="validate",
                             cycle=cycle, unit=iteration)
        for cid, episodes in zip(valid, smoke):
            ctx.run.write_rollouts(candidate_rollouts_name("validate", cycle, iteration, cid), "validate", cycle,
                                  episodes)
        ctx.run.commit()  # rollouts on record before the archive moves on
        passed = []
        for cid, (ep,) in zip(valid, smoke):
            if ep.status == "ok":
                passed.append(cid)
            else:
                self.reject(cid, f"smoke test: {ep.status}: {ep.reason}")
        per_example = ctx.cfg.harness_phase.rollouts_per_example
        evaluations = rollout_many(ctx, [(cid, ctx.splits.harness, per_example) for cid in passed], phase="harness",
                                   cycle=cycle, unit=iteration)
        for cid, rollouts in zip(passed, evaluations):
            ctx.run.write_rollouts(candidate_rollouts_name("harness", cycle, iteration, cid), "harness", cycle,
                                  rollouts)
            ctx.run.commit()
            rows = [{"task_id": r.task_id, "reward": r.reward, "turns": r.turns, "prompt_tokens": r.prompt_tokens,
                     "status": r.status, "truncated": r.truncated} for r in rollouts]
            archive.record_evaluation(cid, rows, [r.trace for r in rollouts], state.weight_version)
        ctx.run.commit()

    def reject(self, cid: str, reason: str) -> None:
        self.ctx.archive.mark_invalid(cid, reason)
        self.ctx.run.state.ledger.candidates_invalid += 1
