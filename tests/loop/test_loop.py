"""The WHALE loop (whale_ray.loop) over in-process roles: no Ray, no sandbox, no model; milliseconds a run.

The roles here are small deterministic stand-ins for the actors: an episode "succeeds" by a rule of the
harness text and the seed, the trainer counts versions, the weight sync records what it is asked, the proposer
appends a marker line. What is under
test is the loop's bookkeeping: budgets, counts, selection, the run directory and resume.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.helpers import small_config
from tests.run_truth import check_ledger, check_selection, check_staleness
from whale_ray.domain import get_domain
from whale_ray.loop import Roles, RunDirectory, WhaleLoop
from whale_ray.loop.weight_phase import AHEAD_THREAD
from whale_ray.loop.whale import trains_again
from whale_ray.records import EpisodeResult, ModelCall
from whale_ray.rsft import accepted_calls, conversations
from whale_ray.run_state import RunState
from whale_ray.schedules import plan


def _unit(*parts) -> float:
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=4).digest(), "little") / 2**32


class Crash(RuntimeError):
    pass


class Pool:
    """Episodes succeed with probability 0.2 + 0.2 per "# better" line of the harness, by the seed; the
    answer is boxed gold on success. Crashes after `crash_after` episodes when asked to."""

    def __init__(self, crash_after: int | None = None):
        self.crash_after, self.episodes, self.calls = crash_after, 0, 0
        self.ahead = 0  # calls of rollouts begun beside a Trainer step (the weight phase's thread for them)

    def run(self, work, on_done):
        self.calls += 1
        self.ahead += threading.current_thread().name.startswith(AHEAD_THREAD)
        self.before_episodes()
        out = []
        for item in work:
            level = 0.2 + 0.2 * item.harness_source.count("# better")
            results = []
            for job in item.jobs:
                if self.crash_after is not None and self.episodes >= self.crash_after:
                    raise Crash(f"killed after {self.episodes} episodes")
                self.episodes += 1
                ok = _unit(job.seed) < level
                text = f"\\boxed{{{job.task.answer if ok else 'wrong'}}}"
                call = ModelCall(messages=[{"role": "user", "content": job.task.question}], text=text,
                                 prompt_ids=[1, 2, job.seed % 997], completion_ids=[4, 5], logprobs=[-0.1, -0.2], weight_version=0,
                                 finish_reason="stop")
                results.append(EpisodeResult(status="ok", reason="", answer=text, calls=[call], events=[], wall_s=0.0))
            on_done(len(results))
            out.append(results)
        return out

    def before_episodes(self):
        pass


class Weights:
    """The weight sync: every call in order, as ("push", version) or the method's name. Between before_step and
    push/resume the servers hold new calls (`open` is clear)."""

    def __init__(self):
        self.calls: list = []
        self.open = threading.Event()
        self.open.set()

    def before_step(self):
        self.calls.append("before_step")
        self.open.clear()

    def push(self, version):
        self.calls.append(("push", version))
        self.open.set()

    def resume(self):
        self.calls.append("resume")
        self.open.set()

    def release(self):
        self.calls.append("release")

    @property
    def pushed(self) -> list[int]:
        return [c[1] for c in self.calls if isinstance(c, tuple)]


class Trainer:
    def __init__(self):
        self.version, self.saved, self.examples = 0, [], []
        self.writing = None  # (path, version) of a checkpoint begun with wait=False

    def train_step(self, examples, version):
        assert version == self.version, f"the loop expects version {version}, the trainer holds {self.version}"
        assert self.writing is None, "a step while a checkpoint of the state is being written"
        self.examples.append(list(examples))
        if not examples:
            return {"trained": False, "version": self.version, "loss": float("nan")}
        self.version += 1
        return {"trained": True, "version": self.version, "loss": 1.0 / self.version}

    def save_checkpoint(self, path, version, *, wait=True):
        """wait=False: written only when `checkpoint_written` is called, as if the write took until then (a crash
        before it leaves no checkpoint there); a step or another save in between is the loop's fault."""
        assert version == self.version and self.writing is None
        self.writing = (path, version)
        return self.checkpoint_written(path) if wait else path

    def checkpoint_written(self, path):
        assert self.writing is not None and self.writing[0] == path, (self.writing, path)
        (path, version), self.writing = self.writing, None
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "version").write_text(str(version))
        self.saved.append(version)
        return path

    def load_checkpoint(self, path):
        self.version = int((Path(path) / "version").read_text())

    def release_workers(self):
        self.released = getattr(self, "released", 0) + 1


class Proposer:
    """Each session: M children of the accepted harness, each with one more "# better" line."""

    def session(self, archive_root, n, iteration, limits, log_path):
        state = RunState.load(Path(archive_root).parent)
        parent = state.accepted_harness
        code = (Path(archive_root) / parent / "harness.py").read_text()
        proposals = [{"code": code + f"\n# better {iteration}.{k}\n", "parent": parent, "hypothesis": f"better {k}"}
                     for k in range(n)]
        usage = {"sessions": 1, "calls": 0, "prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0,
                 "cost_usd": 0.0, "wall_s": 0.0, "retries": 0}
        return {"proposals": proposals, "session": {"kind": "test", "iteration": iteration, "usage": usage}}


def make_loop(cfg, pool=None, trainer=None):
    domain = get_domain(cfg.domain)
    splits = domain.load_splits(cfg.data, cfg.seed)
    roles = Roles(pool=pool or Pool(), proposer=Proposer(), trainer=trainer or Trainer(), weights=Weights())
    return WhaleLoop(cfg, roles, RunDirectory(cfg.run_dir), domain, splits), roles


def planned_rollouts(cfg) -> tuple[int, int]:
    """Training rollouts by the config's budgets alone (fixed-budget conditions, every weight step trains):
    weight = the prompts of E epochs x k samples per cycle; harness = M candidates per iteration after the
    first, each a one-example smoke test plus |D_harness| episodes, and iteration 1's incoming harness the
    same whenever it has no scores under the current weights (the first harness phase, and after weights moved)."""
    weight = harness = 0
    scored_under_current_weights = False
    per_candidate = 1 + cfg.data.n_harness
    for phases in plan(cfg):
        for phase in phases:
            if phase.kind == "weight":
                weight += max(1, round(phase.budget * cfg.data.n_weight)) * cfg.weight.samples_per_prompt
                scored_under_current_weights = False
            else:
                harness += 0 if scored_under_current_weights else per_candidate
                harness += (phase.budget - 1) * cfg.harness_phase.candidates_per_iteration * per_candidate
                scored_under_current_weights = True
    return weight, harness


def mean_reward(path: Path) -> float:
    rewards = pq.read_table(path, columns=["reward"]).column("reward").to_pylist()
    return sum(rewards) / len(rewards)


def comparable(state: RunState) -> dict:
    d = state.model_dump()
    for row in d["history"]:
        row.pop("wall_s")
    d.pop("phase_wall_s"), d.pop("cycle_wall_s")
    d["rollout_files"] = sorted((f["name"], f["rows"]) for f in d["rollout_files"])
    d["proposer_sessions"] = sorted(d["proposer_sessions"])
    return d


@pytest.mark.parametrize("condition", ["rsft_only", "mh_only", "whale", "stagewise"])
def test_ledger_equals_the_budgets(condition, tmp_path):
    cfg = small_config(tmp_path / "run", condition=condition)
    loop, roles = make_loop(cfg)
    loop.run()
    state = RunState.load(cfg.run_dir)
    weight, harness = planned_rollouts(cfg)
    assert (state.ledger.weight_rollouts, state.ledger.harness_rollouts) == (weight, harness)
    assert state.weight_version == state.ledger.weight_steps == roles.trainer.version
    assert roles.weights.pushed == list(range(1, state.weight_version + 1))
    assert state.finished


def test_best_pair_is_the_highest_val_and_its_test_file_is_reported(tmp_path):
    cfg = small_config(tmp_path / "run", condition="whale", cycles=3)
    loop, _ = make_loop(cfg)
    history = loop.run()
    rollouts = cfg.run_dir / "rollouts"
    best_val, best = None, None
    for row in history:  # the pair of each row, in order; the earlier pair wins a tie
        val = mean_reward(rollouts / f"val-v{row.weight_version:05d}-{row.accepted_harness}.parquet")
        assert val == row.val
        if best_val is None or val > best_val:
            best_val, best = val, (row.weight_version, row.accepted_harness)
        assert row.best == f"v{best[0]}+{best[1]}"
        assert row.test_mean8 == mean_reward(rollouts / f"test-v{best[0]:05d}-{best[1]}.parquet")


@pytest.mark.parametrize("crash_at", [0.05, 0.3, 0.6, 0.9, 0.97])
@pytest.mark.parametrize("checkpoint_every", [1, 2])
def test_relaunch_after_a_crash_ends_where_an_uninterrupted_run_ends(crash_at, checkpoint_every, tmp_path):
    over = {"condition": "whale", "weight__checkpoint_every": checkpoint_every, "weight__prompts_per_step": 1}
    clean_cfg = small_config(tmp_path / "clean", **over)
    clean_loop, clean_roles = make_loop(clean_cfg)
    clean_loop.run()
    cfg = small_config(tmp_path / "run", **over)
    loop, _ = make_loop(cfg, pool=Pool(crash_after=int(crash_at * clean_roles.pool.episodes)))
    with pytest.raises(Crash):
        loop.run()
    before = RunState.load(cfg.run_dir)
    trainer = Trainer()
    if before.checkpoint:
        trainer.load_checkpoint(cfg.run_dir / before.checkpoint)
    loop, _ = make_loop(cfg, trainer=trainer)
    ahead = trains_again(loop.plan, loop.state)  # whether the Coordinator starts the Trainer's workers for the relaunch
    loop.run()
    assert ahead == bool(trainer.examples) and not trains_again(loop.plan, loop.state)
    after, clean = RunState.load(cfg.run_dir), RunState.load(clean_cfg.run_dir)
    assert comparable(after) == comparable(clean)
    on_record = {f.name for f in after.rollout_files}
    assert {p.stem for p in (cfg.run_dir / "rollouts").glob("*")} == on_record
    assert {p.stem for p in (cfg.run_dir / "train").glob("*")} == set(after.train_steps)


class CrashWhileWriting(Pool):
    """The process dies in the first rollouts that run while the trainer writes a checkpoint. Rollouts begun beside
    a step run on while its checkpoint is begun after it (their calls wait for the step's weights): a call that finds
    no write under way looks again for a second before its episodes, which here take no time."""

    def __init__(self, trainer):
        super().__init__()
        self.trainer = trainer

    def run(self, work, on_done):
        deadline = time.monotonic() + 1.0
        while self.trainer.writing is None and time.monotonic() < deadline:
            time.sleep(0.005)
        if self.trainer.writing is not None:
            raise Crash(f"killed while {self.trainer.writing[0]} was being written")
        return super().run(work, on_done)


def test_a_crash_while_a_checkpoint_is_written_resumes_from_the_one_before(tmp_path):
    """A step's checkpoint is written while the next step's rollouts run: a crash then leaves neither that
    checkpoint nor the step it holds on record, and the relaunch redoes the step and ends as a clean run does."""
    over = {"condition": "rsft_only", "weight__prompts_per_step": 1}
    clean_cfg = small_config(tmp_path / "clean", **over)
    make_loop(clean_cfg)[0].run()
    cfg = small_config(tmp_path / "run", **over)
    trainer = Trainer()
    loop, _ = make_loop(cfg, pool=CrashWhileWriting(trainer), trainer=trainer)
    with pytest.raises(Crash):
        loop.run()
    path, version = trainer.writing
    before = RunState.load(cfg.run_dir)
    assert before.weight_version < version and not Path(path).exists()
    assert before.checkpoint != str(Path(path).relative_to(cfg.run_dir.resolve()))
    assert len(before.train_steps) < len(trainer.examples)  # the step the checkpoint holds is not on record
    resumed = Trainer()
    if before.checkpoint:
        resumed.load_checkpoint(cfg.run_dir / before.checkpoint)
    make_loop(cfg, trainer=resumed)[0].run()
    assert comparable(RunState.load(cfg.run_dir)) == comparable(RunState.load(clean_cfg.run_dir))


class CrashBesideTheLastWrite(CrashWhileWriting):
    """Dies in the first pool call made while the trainer writes its n-th checkpoint (a weight phase's last, with
    checkpoint_every above the phase's steps: the harness phase runs beside it)."""

    def __init__(self, trainer, n):
        super().__init__(trainer)
        self.n, self.seen = n, []

    def run(self, work, on_done):
        if self.trainer.writing is not None and self.trainer.writing not in self.seen:
            self.seen.append(self.trainer.writing)
        if len(self.seen) < self.n:
            return Pool.run(self, work, on_done)
        return super().run(work, on_done)


@pytest.mark.parametrize("n", [1, 2])
def test_a_crash_beside_a_phases_last_checkpoint_trains_its_steps_again_and_runs_no_rollout_twice(n, tmp_path):
    """A weight phase's last checkpoint is written while the harness phase runs, the record already at its version:
    a crash before it is written leaves the record ahead of the checkpoint on record. The relaunch trains the steps
    after that checkpoint again on their recorded examples (the same examples in the same order), pushes the
    weights, runs no episode twice, and ends where a clean run ends."""
    over = {"condition": "whale", "weight__checkpoint_every": 100, "weight__prompts_per_step": 2}
    clean_cfg = small_config(tmp_path / "clean", **over)
    clean_loop, clean = make_loop(clean_cfg)
    clean_loop.run()
    cfg = small_config(tmp_path / "run", **over)
    trainer = Trainer()
    loop, first = make_loop(cfg, pool=CrashBesideTheLastWrite(trainer, n), trainer=trainer)
    with pytest.raises(Crash):
        loop.run()
    before = RunState.load(cfg.run_dir)
    assert before.phase.kind == "harness" and before.phase.cycle == n - 1
    assert before.checkpoint_pending == f"checkpoints/v{before.weight_version:05d}"
    assert before.checkpoint_version < before.weight_version == trainer.version
    assert not (cfg.run_dir / before.checkpoint_pending).exists()
    resumed = Trainer()
    if before.checkpoint:
        resumed.load_checkpoint(cfg.run_dir / before.checkpoint)
    assert resumed.version == before.checkpoint_version
    loop, again = make_loop(cfg, trainer=resumed)
    # in the last cycle's harness phase too: the unsaved steps are trained again
    assert trains_again(loop.plan, loop.state)
    loop.run()
    unsaved = before.weight_version - before.checkpoint_version
    assert resumed.examples[:unsaved] == trainer.examples[-unsaved:]
    assert again.weights.calls[:2] == ["before_step", ("push", before.weight_version)]
    assert first.pool.episodes + again.pool.episodes == clean.pool.episodes
    after = RunState.load(cfg.run_dir)
    assert comparable(after) == comparable(RunState.load(clean_cfg.run_dir))
    assert after.checkpoint_pending is None and after.checkpoint_version == after.weight_version
    assert after.checkpoint == f"checkpoints/v{after.weight_version:05d}"


@pytest.mark.parametrize("condition", ["rsft_only", "mh_only", "whale", "stagewise"])
def test_a_cycles_report_beside_the_next_cycle_gives_the_rows_it_gives_alone(condition, tmp_path):
    """eval.overlap (the default) runs a cycle's D_val and D_test evaluations beside the next cycle's first pool
    call under the same weights, or beside a proposer session: the same rows, evaluations and ledger as running
    them alone at the cycle's end, recomputed from the files (tests/run_truth.py); fewer pool calls."""
    alone_cfg = small_config(tmp_path / "alone", condition=condition, eval__overlap=False)
    alone_loop, alone = make_loop(alone_cfg)
    alone_loop.run()
    cfg = small_config(tmp_path / "beside", condition=condition)
    loop, beside = make_loop(cfg)
    loop.run()
    state = RunState.load(cfg.run_dir)
    assert comparable(state) == comparable(RunState.load(alone_cfg.run_dir))
    check_selection(cfg.run_dir, state.model_dump())
    check_ledger(cfg, cfg.run_dir, state.model_dump())
    assert beside.pool.episodes == alone.pool.episodes == sum(f.rows for f in state.rollout_files)
    assert beside.pool.calls < alone.pool.calls
    lines = [json.loads(line) for line in (cfg.run_dir / "timings.jsonl").read_text().splitlines()]
    assert any(line.get("report_episodes") for line in lines)
    lines = [json.loads(line) for line in (alone_cfg.run_dir / "timings.jsonl").read_text().splitlines()]
    assert not any(line.get("report_episodes") for line in lines)


class CrashBeside(Pool):
    """Dies in the n-th pool call that holds D_val episodes beside other work, or in the call after it."""

    def __init__(self, val_ids, n, after):
        super().__init__()
        self.val_ids, self.n, self.after, self.seen, self.crash_next = val_ids, n, after, 0, False

    def run(self, work, on_done):
        if self.crash_next:
            raise Crash("killed in the call after a report ran beside a phase")
        if len(work) > 1 and any(job.task.id in self.val_ids for item in work for job in item.jobs):
            self.seen += 1
            if self.seen == self.n:
                if not self.after:
                    raise Crash("killed while a report ran beside a phase")
                self.crash_next = True
        return super().run(work, on_done)


@pytest.mark.parametrize("after", [False, True])
def test_a_kill_while_a_report_runs_beside_a_phase_redoes_nothing_on_record(after, tmp_path):
    """Killed in the pool call that carries the start's D_val beside cycle 1's first weight step (or in the next
    call: its D_test, alone once D_val is on record, before the step trains), the relaunch ends where a clean run
    ends and runs only the episodes that were not on record."""
    over = {"condition": "rsft_only", "weight__prompts_per_step": 1}
    clean_cfg = small_config(tmp_path / "clean", **over)
    clean_loop, clean = make_loop(clean_cfg)
    clean_loop.run()
    cfg = small_config(tmp_path / "run", **over)
    loop, _ = make_loop(cfg, pool=CrashBeside({t.id for t in clean_loop.ctx.splits.val}, n=1, after=after))
    with pytest.raises(Crash):
        loop.run()
    before = RunState.load(cfg.run_dir)
    assert before.report.cycle == -1 and not before.history and not before.train_steps  # row 0 waits
    assert [e.split for e in before.evaluations if e.weight_version == before.report.weight_version] == (
        ["val"] if after else [])
    trainer = Trainer()
    if before.checkpoint:
        trainer.load_checkpoint(cfg.run_dir / before.checkpoint)
    loop, roles = make_loop(cfg, trainer=trainer)
    loop.run()
    after_state = RunState.load(cfg.run_dir)
    assert comparable(after_state) == comparable(RunState.load(clean_cfg.run_dir))
    assert roles.pool.episodes == clean.pool.episodes - sum(f.rows for f in before.rollout_files)


class GatedPool(Pool):
    """A call of D_val episodes alone (a report run apart from any phase's call) waits (up to 10 s) for a proposer
    session to open before it runs, and says so when it has run."""

    def __init__(self, val_ids):
        super().__init__()
        self.val_ids, self.session_open, self.ran, self.gates = val_ids, threading.Event(), threading.Event(), []

    def run(self, work, on_done):
        alone = all(job.task.id in self.val_ids for item in work for job in item.jobs)
        if alone:
            self.gates.append(self.session_open.wait(10))
        out = super().run(work, on_done)
        if alone:
            self.ran.set()
        return out


class WaitingProposer(Proposer):
    """The session of one iteration opens the pool's gate and waits (up to 10 s) for a report's call to run: a
    proposer thinking for minutes while the pool works."""

    def __init__(self, pool, iteration):
        self.pool, self.iteration, self.overlapped = pool, iteration, None

    def session(self, archive_root, n, iteration, limits, log_path):
        if iteration == self.iteration:
            self.pool.session_open.set()
            self.overlapped = self.pool.ran.wait(10)
        return super().session(archive_root, n, iteration, limits, log_path)


def test_a_cycles_report_runs_while_a_proposer_session_runs(tmp_path):
    """mh_only's cycle 2 starts with the incoming harness already scored, so its first pool call waits on a
    proposer session: cycle 1's report runs in the pool meanwhile, its row announced in the loop's thread."""
    cfg = small_config(tmp_path / "run", condition="mh_only")
    domain = get_domain(cfg.domain)
    pool = GatedPool({t.id for t in domain.load_splits(cfg.data, cfg.seed).val})
    loop, roles = make_loop(cfg, pool=pool)
    # archive-wide iterations: cycle 2's are I + 1 (the incoming harness, scored under these weights: no pool
    # call) and I + 2, its first session
    roles.proposer = loop.ctx.roles.proposer = WaitingProposer(pool, iteration=cfg.I + 2)
    announced = []  # each row once, in the loop's thread (a Tune trial reports from it)
    loop.run(on_cycle=lambda row: announced.append((row.cycle, threading.current_thread() is threading.main_thread())))
    state = RunState.load(cfg.run_dir)
    assert pool.gates[0] is True and roles.proposer.overlapped is True  # both ends waited on the other
    assert announced == [(row.cycle, True) for row in state.history] and len(state.history) == cfg.cycles + 1


class ServedPool(Pool):
    """Stamps each model call with the weight version last pushed to the servers, as a PolicyServer does; the
    episodes' calls wait while the servers hold them."""

    def __init__(self, weights):
        super().__init__()
        self.weights = weights

    def before_episodes(self):
        assert self.weights.open.wait(timeout=30), "the servers held the calls for 30 s: no push or resume came"

    def run(self, work, on_done):
        out = super().run(work, on_done)
        served = (self.weights.pushed or [0])[-1]
        for episodes in out:
            for ep in episodes:
                ep.calls[0].weight_version = served
        return out


class OverlapTrainer(Trainer):
    """A step waits (up to 3 s) for the pool to begin the next step's rollouts ahead (since the step before ended),
    and says whether it saw them."""

    def __init__(self, pool):
        super().__init__()
        self.pool, self.overlapped, self.seen = pool, [], 0

    def train_step(self, examples, version):
        self.in_step = True
        deadline = time.monotonic() + 3
        while self.pool.ahead == self.seen and time.monotonic() < deadline:
            time.sleep(0.005)
        self.overlapped.append(self.pool.ahead > self.seen)
        self.seen, self.in_step = self.pool.ahead, False
        return super().train_step(examples, version)


class CrashAhead(Pool):
    """Dies in the n-th pool call of rollouts begun beside a Trainer step."""

    def __init__(self, n):
        super().__init__()
        self.n, self.trainer = n, None

    def run(self, work, on_done):
        if threading.current_thread().name.startswith(AHEAD_THREAD):
            self.n -= 1
            if self.n == 0:
                self.calls += 1
                self.ahead += 1  # seen by the trainer: the step goes on, as a remote one would
                raise Crash("killed while a step's rollouts ran ahead")
        return super().run(work, on_done)


@pytest.mark.parametrize("staleness", [0, 1])
def test_the_next_steps_rollouts_begin_while_the_trainer_takes_a_step(staleness, tmp_path):
    """While the Trainer takes step s, step s + 1's rollouts begin (every step but each phase's last). 0: their calls
    wait for step s's weights, so every sample is from its step's own weights. max_staleness 1: they run on the
    weights the servers hold, so every trained sample is at most one version behind the step (its train/ record
    says how far), each phase's first step on-policy; the engine sleeps only for each phase's last step."""
    cfg = small_config(tmp_path / "run", condition="whale", weight__prompts_per_step=1,
                       weight__max_staleness=staleness)
    loop, roles = make_loop(cfg)
    pool = roles.pool = loop.ctx.roles.pool = ServedPool(roles.weights)
    trainer = roles.trainer = loop.ctx.roles.trainer = OverlapTrainer(pool)
    loop.run()
    state = RunState.load(cfg.run_dir)
    records = check_staleness(cfg.run_dir, staleness)
    assert len(records) == len(state.train_steps) >= state.ledger.weight_steps > 2
    last = {(r["cycle"], max(q["step"] for q in records if q["cycle"] == r["cycle"])) for r in records}
    assert trainer.overlapped == [(r["cycle"], r["step"]) not in last for r in records]
    assert roles.weights.calls.count("before_step") == (len(last) if staleness else len(records))
    assert roles.weights.pushed == list(range(1, state.weight_version + 1))
    check_selection(cfg.run_dir, state.model_dump())
    check_ledger(cfg, cfg.run_dir, state.model_dump())


@pytest.mark.parametrize("n", [1, 4])
def test_a_relaunch_with_max_staleness_1_takes_every_step_once(n, tmp_path):
    """Killed while a step's rollouts ran ahead of the Trainer, the relaunch starts from the checkpoint on record
    and runs them again (then on-policy): every step is trained once, with the ledger its budgets make."""
    over = {"condition": "whale", "weight__prompts_per_step": 1, "weight__max_staleness": 1}
    clean_cfg = small_config(tmp_path / "clean", **over)
    make_loop(clean_cfg)[0].run()
    cfg = small_config(tmp_path / "run", **over)
    pool = CrashAhead(n)
    pool.trainer = OverlapTrainer(pool)
    loop, _ = make_loop(cfg, pool=pool, trainer=pool.trainer)
    with pytest.raises(Crash):
        loop.run()
    before = RunState.load(cfg.run_dir)
    assert len(before.train_steps) < len(pool.trainer.examples)  # the step taken beside the crash is not on record
    trainer = Trainer()
    if before.checkpoint:
        trainer.load_checkpoint(cfg.run_dir / before.checkpoint)
    make_loop(cfg, trainer=trainer)[0].run()
    state = RunState.load(cfg.run_dir)
    assert state.finished and state.weight_version == state.ledger.weight_steps == trainer.version
    assert sorted(state.train_steps) == sorted(RunState.load(clean_cfg.run_dir).train_steps)
    check_selection(cfg.run_dir, state.model_dump())
    check_ledger(cfg, cfg.run_dir, state.model_dump())


def test_train_step_records_name_the_accepted_calls(tmp_path):
    cfg = small_config(tmp_path / "run", condition="rsft_only")
    loop, roles = make_loop(cfg)
    loop.run()
    state = RunState.load(cfg.run_dir)
    assert len(state.train_steps) == len(roles.trainer.examples)
    for name, examples in zip(sorted(state.train_steps), roles.trainer.examples):
        record = json.loads((cfg.run_dir / "train" / f"{name}.json").read_text())
        rows = pq.read_table(cfg.run_dir / "rollouts" / f"{record['rollout_file']}.parquet").to_pylist()
        accepted = [{"task_id": r["task_id"], "sample": r["sample"], "call": 0, "weight_version": 0}
                    for r in rows if r["reward"] == 1]
        assert record["examples"] == accepted
        assert len(examples) == len(accepted)


def _call(messages, completion):
    return ModelCall(messages=messages, text=completion, prompt_ids=[1], completion_ids=[2], logprobs=[0.0],
                     weight_version=0, finish_reason="stop")


def test_conversations_split_votes_and_follow_turns():
    q = [{"role": "user", "content": "q"}]
    calls = [
        _call(q, "code a"),  # vote 1, turn 1
        _call(q + [{"role": "assistant", "content": "code a"}, {"role": "user", "content": "out a"}], "\\boxed{7}"),
        _call(q, "code b"),  # vote 2, turn 1
        _call(q + [{"role": "assistant", "content": "code b"}, {"role": "user", "content": "out b"}], "\\boxed{5}"),
    ]
    boxed = lambda text: "\\boxed{" in text  # noqa: E731
    assert conversations(calls) == [[0, 1], [2, 3]]
    assert accepted_calls(calls, lambda text: "7" in text, boxed) == [0, 1]
    assert accepted_calls(calls, lambda text: False, boxed) == []
    # One conversation: the episode's reward decides, whatever its last completion says.
    assert accepted_calls(calls[:2], lambda text: False, boxed) == [0, 1]
    # Several chats but at most one states an answer (a chat per chess move, a harness that extracts the answer
    # itself): one attempt, every call trains.
    assert accepted_calls(calls, lambda text: False, lambda text: False) == [0, 1, 2, 3]
    assert accepted_calls(calls[:3], lambda text: False, boxed) == [0, 1, 2]


def test_cycle_wall_time_spans_launches(tmp_path):
    """Killed late in a cycle, relaunched and killed again soon after: the cycle's wall time on record keeps
    the first launch's share (a reset at relaunch would leave only the short second share)."""
    cfg = small_config(tmp_path / "run", condition="whale")

    def crash(pool):
        loop, _ = make_loop(cfg, pool=pool, trainer=resumed_trainer(cfg))
        with pytest.raises(Crash):
            loop.run()
        return RunState.load(cfg.run_dir)

    first = crash(Pool(crash_after=44))  # past row 0 and cycle 1: in cycle 2 (asserted below)
    second = crash(Pool(crash_after=9))
    assert (first.cycle, second.cycle) == (1, 1)
    assert second.cycle_wall_s > first.cycle_wall_s > 0
    history = make_loop(cfg, trainer=resumed_trainer(cfg))[0].run()
    assert history[2].wall_s >= round(second.cycle_wall_s, 1)


def resumed_trainer(cfg) -> Trainer:
    trainer, state = Trainer(), RunState.load(cfg.run_dir)
    if state is not None and state.checkpoint:
        trainer.load_checkpoint(cfg.run_dir / state.checkpoint)
    return trainer


@pytest.mark.parametrize("release, expected", [(None, 0), (True, 2), (False, 0)])
def test_trainer_workers_are_released_after_each_weight_phase_when_asked(release, expected, tmp_path):
    cfg = small_config(tmp_path / "run", condition="whale", weight__release_workers=release)  # None: the default
    loop, roles = make_loop(cfg)
    order = []  # the servers let go of the workers' GPU memory before they end (cuda_ipc.py's docstring)
    roles.weights.release = lambda: order.append("sync lets go")
    release = roles.trainer.release_workers
    roles.trainer.release_workers = lambda: (order.append("workers end"), release())
    loop.run()
    assert getattr(roles.trainer, "released", 0) == expected
    assert order == ["sync lets go", "workers end"] * expected


def test_the_report_names_the_runs_k(tmp_path):
    from whale_ray.report import markdown_table, write_report

    cfg = small_config(tmp_path / "run", condition="mh_only", eval__test_samples=3)
    history = make_loop(cfg)[0].run()
    assert "test mean@3" in markdown_table(history) and "mean@8" not in markdown_table(history)
    summary = (write_report(cfg.run_dir, RunState.load(cfg.run_dir)) / "summary.md").read_text()
    assert "mean@3" in summary and "mean@8" not in summary


class EveryOtherStepTrains(Trainer):
    def train_step(self, examples, version):
        self.steps = getattr(self, "steps", 0) + 1
        return super().train_step(examples if self.steps % 2 else [], version)


def test_each_trainer_step_is_framed_by_the_weight_sync(tmp_path):
    """Before every train_step the sync may take the servers' memory (vLLM's sleep mode); after it, new weights
    are pushed, or, when the step trained nothing, the servers resume on the weights they had."""
    cfg = small_config(tmp_path / "run", condition="rsft_only")
    trainer = EveryOtherStepTrains()
    loop, roles = make_loop(cfg, trainer=trainer)
    loop.run()
    calls, expected, version = roles.weights.calls, [], 0
    for examples in trainer.examples:  # what each step was given: it trained where there were some
        version += bool(examples)
        expected += ["before_step", ("push", version) if examples else "resume"]
    assert calls == expected and "resume" in calls and version >= 1


class SlowFirstStart(Trainer):
    """Reports, as the Ray Train Trainer does, the seconds its first step spent starting the workers."""

    def train_step(self, examples, version):
        started = 0.0 if getattr(self, "stepped", False) else 0.2
        self.stepped = True
        time.sleep(started)
        return {**super().train_step(examples, version), "workers_start_s": started}


def test_every_act_of_every_phase_is_timed_once_and_the_episodes_add_up(tmp_path):
    cfg = small_config(tmp_path / "run", condition="whale")
    loop, roles = make_loop(cfg, trainer=SlowFirstStart())
    loop.run()
    state = RunState.load(cfg.run_dir)
    lines = [json.loads(line) for line in (cfg.run_dir / "timings.jsonl").read_text().splitlines()]
    assert all(line["s"] >= 0 and line["start"] > 0 for line in lines)

    def acts(phase, act):
        return [line for line in lines if line["phase"] == phase and line["act"] == act]

    def episodes(*phases, key="episodes"):
        return sum(line.get(key, 0) for p in phases for line in acts(p, "rollouts"))

    # a cycle's evaluations ran beside the next cycle's first pool call: counted there, and as the report's
    beside = episodes("weight", "harness", "validate", key="report_episodes")
    assert episodes("weight") - episodes("weight", key="report_episodes") == state.ledger.weight_rollouts
    assert (episodes("harness", "validate") - episodes("harness", "validate", key="report_episodes")
            == state.ledger.harness_rollouts)
    assert episodes("val", "test") + beside == state.ledger.eval_rollouts and beside > 0
    steps = len(state.train_steps)
    assert len(acts("weight", "train")) == len(acts("weight", "sleep")) == len(acts("weight", "sync")) == steps
    assert [line["workers_start_s"] for line in acts("weight", "train")] == [0.2] + [0.0] * (steps - 1)
    begun = [line for line in acts("weight", "checkpoint") if "version" in line]  # and one wait for each background one
    assert [line["version"] for line in begun] == roles.trainer.saved
    waits = len(acts("weight", "checkpoint")) - len(begun)
    assert waits == sum(line["background"] for line in begun) == len(begun)  # each step's, the last one's too
    assert len(acts("harness", "propose")) == len(state.proposer_sessions)
    for phase in ("weight", "harness", "validate", "val", "test"):  # every pool call is verified once
        assert len(acts(phase, "verify")) == len(acts(phase, "rollouts")) > 0


def test_the_time_breakdown_adds_up_from_the_run_directory_alone(tmp_path):
    """`whale status --time`'s numbers: the time a phase's acts cover fits in its wall time, the episodes are the
    ledger's, and a cycle's fixed cost is its wall time less the work in it (the first weight step's worker start
    counted there)."""
    from whale_ray.report.timings import GROUPS, format_breakdown, time_breakdown, work_covered

    cfg = small_config(tmp_path / "run", condition="whale")
    make_loop(cfg, trainer=SlowFirstStart())[0].run()
    state = RunState.load(cfg.run_dir)
    b = time_breakdown(cfg.run_dir)
    own = {k: p.episodes - p.report_episodes for k, p in b.phases.items()}
    assert own["weight"] == state.ledger.weight_rollouts and own["harness"] == state.ledger.harness_rollouts
    assert own["eval"] + sum(p.report_episodes for p in b.phases.values()) == state.ledger.eval_rollouts
    for name, p in b.phases.items():
        assert work_covered([s for s in b.spans if GROUPS.get(s["phase"]) == name]) <= p.wall_s + 1e-3
    assert b.phases["weight"].acts["workers_start"] == pytest.approx(0.2)  # reported by the step
    assert [c["cycle"] for c in b.cycles] == [row.cycle for row in state.history[1:]]
    for c, row in zip(b.cycles, state.history[1:]):
        assert c["wall_s"] == row.wall_s and 0 <= c["fixed_s"] <= c["wall_s"]
    first, second = b.cycles
    assert first["workers_start_s"] == pytest.approx(0.2) and first["fixed_s"] >= 0.2 - 0.05  # walls: 0.1 s
    assert second["workers_start_s"] == pytest.approx(0.0, abs=0.01)
    text = format_breakdown(b)
    assert "weight" in text and "fixed" in text


def test_work_that_overlaps_counts_once_in_the_time_work_covers():
    """A step's next rollouts begin beside its training: the time they cover together is their union; a `train` act's
    workers' start (its first part) is not work."""
    from whale_ray.report.timings import work_covered

    spans = [{"act": "rollouts", "start": 0.0, "s": 2.0}, {"act": "verify", "start": 2.0, "s": 0.5},
             {"act": "train", "start": 3.0, "s": 4.0, "step_s": 4.0, "workers_start_s": 1.0},  # proper: 4.0 to 7.0
             {"act": "rollouts", "start": 3.5, "s": 5.0},  # begun beside the step, on to 8.5
             {"act": "sync", "start": 7.0, "s": 0.3}, {"act": "checkpoint", "start": 9.0, "s": 1.0}]
    assert work_covered(spans) == pytest.approx(2.5 + 5.0)


def test_a_timings_line_that_is_not_json_is_named_by_file_and_line(tmp_path):
    from whale_ray.report.timings import time_breakdown

    cfg = small_config(tmp_path / "run", condition="whale")
    make_loop(cfg)[0].run()
    path = cfg.run_dir / "timings.jsonl"
    n = len(path.read_text().splitlines())
    with path.open("a") as f:
        f.write("{cut short\n")
    with pytest.raises(ValueError, match=rf"timings.jsonl:{n + 1}: not a JSON line"):
        time_breakdown(cfg.run_dir)
