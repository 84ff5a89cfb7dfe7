"""The run directory, the one truth of a run: its state, rollout files, weight-step records and checkpoints.

    config.yaml           the resolved config
    state.json            RunState: where the run is, what it has spent, what it has found
    rollouts/<name>.parquet   every episode; a file counts only once state.json has it on record
    train/c<cc>-s<ssss>.json  what each weight step trained on (the accepted calls) and its metrics
    checkpoints/v<NNNNN>/     Hugging Face format; the latest and the best are kept
    timings.jsonl         where the time went: one line per timed act (a log, appended by every launch)

Work is written first and put on record with the next `commit()` (an atomic rewrite of state.json), so a
unit of work cut short by a crash leaves only files that the relaunch drops and redoes under the same
name and seeds: nothing is counted twice and nothing is lost.
"""

from __future__ import annotations

import json
import shutil
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import pyarrow.parquet as pq

from whale_ray.config import ConfigError, WhaleConfig, dotted_keys, dump_config, load_recorded_config
from whale_ray.records import Rollout, rollouts_to_table
from whale_ray.rsft_defaults import RESOLVED_KEYS, unset
from whale_ray.run_state import Evaluation, RolloutFile, RolloutPhase, RunState
from whale_ray.storage import atomic_write_text


def weight_step_name(cycle: int, step: int) -> str:
    return f"weight-c{cycle:02d}-s{step:04d}"


def candidate_rollouts_name(phase: RolloutPhase, cycle: int, iteration: int, harness_id: str) -> str:
    return f"{phase}-c{cycle:02d}-i{iteration:03d}-{harness_id}"


def evaluation_name(split: str, weight_version: int, harness_id: str) -> str:
    return f"{split}-v{weight_version:05d}-{harness_id}"


TIMINGS_FILE = "timings.jsonl"


class RunDirectory:
    def __init__(self, root: str | Path):
        self.root = Path(root).resolve()
        self.state: RunState = RunState.load(self.root) or RunState()
        self._mark = time.perf_counter()
        self._timings = self.root / TIMINGS_FILE

    @property
    def exists(self) -> bool:
        return (self.root / "state.json").is_file()

    def create(self, cfg: WhaleConfig) -> None:
        """A new run: config.yaml and the first state.json."""
        self.root.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.root / "config.yaml", dump_config(cfg))
        self.commit()

    def recorded_config(self) -> WhaleConfig | None:
        """The run's config.yaml (None: no run here yet)."""
        path = self.root / "config.yaml"
        return load_recorded_config(path) if path.is_file() else None

    def config_conflicts(self, cfg: WhaleConfig) -> list[str]:
        """The settings in which `cfg` differs from the run's config.yaml ("key: recorded -> given"). The
        recorded file is read through today's model, so a key that whale-ray gained since the run began
        takes its default there and conflicts only if `cfg` sets it otherwise. A setting the run resolves when
        `cfg` leaves it unset (rsft_defaults.RESOLVED_KEYS) takes the recorded value then: no conflict; nor does
        a pool sized to the cluster (`sandbox.evaluators: cores`, the default) against a recorded count."""
        path = self.root / "config.yaml"
        if not path.is_file():
            return []
        try:
            recorded = dotted_keys(load_recorded_config(path).model_dump(mode="json"))
        except ConfigError as e:
            return [f"config.yaml no longer loads ({e})"]
        given = dotted_keys(cfg.model_dump(mode="json"))
        return [f"{k}: {recorded.get(k)!r} -> {given.get(k)!r}" for k in sorted(set(recorded) | set(given))
                if recorded.get(k) != given.get(k) and not (k in RESOLVED_KEYS and unset(given.get(k)))
                and not (k == "sandbox.evaluators" and given.get(k) == "cores")]

    def commit(self) -> None:
        """Puts everything written so far on record: one atomic rewrite of state.json. The time since the last
        commit goes to the current cycle's wall time, so a cycle's wall time spans every launch it took."""
        self.cycle_elapsed()
        self.state.save(self.root)

    def cycle_elapsed(self) -> float:
        """The current cycle's wall time so far, over every launch."""
        now = time.perf_counter()
        self.state.cycle_wall_s += now - self._mark
        self._mark = now
        return self.state.cycle_wall_s

    def start_launch(self) -> None:
        """A relaunch: files of work that never reached the record are dropped (that work is redone), and
        the time the process was down is not the cycle's."""
        on_record = {f.name for f in self.state.rollout_files}
        for path in (self.root / "rollouts").glob("*.parquet*"):
            if path.suffix != ".parquet" or path.stem not in on_record:
                path.unlink()
        for path in (self.root / "train").glob("*.json"):
            if path.stem not in self.state.train_steps:
                path.unlink()
        self._mark = time.perf_counter()

    # -------------------------------------------------------------------------------- timings
    @contextmanager
    def timed(self, phase: str, act: str) -> Iterator[dict[str, Any]]:
        """Times one act of a phase into timings.jsonl: {"phase", "act", "cycle" (the report row whose wall time it
        is in: c + 1 for what runs while cycle c does, its phases and the evaluations of the cycle before it or of
        the start), "start" (Unix time, to match samples taken beside the run, such as the GPU's), "s"}. The act may add facts to the dict it is handed.
        A log, not state: time spent on work that a relaunch redoes stays in it, as it was spent."""
        facts: dict[str, Any] = {}
        start, t0 = time.time(), time.perf_counter()
        try:
            yield facts
        finally:
            entry = {"phase": phase, "act": act, "cycle": self.state.cycle + 1, "start": round(start, 3),
                     "s": round(time.perf_counter() - t0, 4), **facts}
            self.root.mkdir(parents=True, exist_ok=True)
            with open(self._timings, "a") as f:
                f.write(json.dumps(entry) + "\n")

    # ------------------------------------------------------------------------------- rollouts
    def write_rollouts(self, name: str, phase: RolloutPhase, cycle: int, rollouts: list[Rollout]) -> None:
        """rollouts/<name>.parquet, on record with the next commit. Work redone after a crash writes the same
        name, so it replaces the earlier file and its entry."""
        path = self.root / "rollouts" / f"{name}.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".parquet.tmp")
        pq.write_table(rollouts_to_table(rollouts), tmp)
        tmp.replace(path)
        files = [f for f in self.state.rollout_files if f.name != name]
        self.state.rollout_files = [*files, RolloutFile(name=name, phase=phase, cycle=cycle, rows=len(rollouts))]
        self._recount()

    def _recount(self) -> None:
        rows = {phase: 0 for phase in ("weight", "validate", "harness", "val", "test")}
        for f in self.state.rollout_files:
            rows[f.phase] += f.rows
        ledger = self.state.ledger
        ledger.weight_rollouts = rows["weight"]
        ledger.harness_rollouts = rows["harness"] + rows["validate"]
        ledger.eval_rollouts = rows["val"] + rows["test"]

    def rewards(self, phase: RolloutPhase, cycle: int) -> list[float]:
        """The rewards of every episode on record of one phase kind in one cycle."""
        out: list[float] = []
        for f in self.state.rollout_files:
            if f.phase == phase and f.cycle == cycle:
                out += pq.read_table(self.root / "rollouts" / f"{f.name}.parquet", columns=["reward"]).column(
                    "reward").to_pylist()
        return out

    # ---------------------------------------------------------------------------- evaluations
    def evaluation(self, split: str, weight_version: int, harness_id: str, samples: int) -> Evaluation | None:
        return next((e for e in self.state.evaluations if e.same_pair(split, weight_version, harness_id, samples)),
                    None)

    def record_evaluation(self, evaluation: Evaluation) -> None:
        self.state.evaluations.append(evaluation)

    # --------------------------------------------------------------------------- weight steps
    def write_train_step(self, name: str, record: dict[str, Any]) -> None:
        """train/<name>.json: the step's accepted calls and metrics (on record with the next commit)."""
        path = self.root / "train" / f"{name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(record, indent=1))
        if name not in self.state.train_steps:
            self.state.train_steps.append(name)

    def train_record(self, name: str) -> dict[str, Any]:
        return json.loads((self.root / "train" / f"{name}.json").read_text())

    def rollout_calls(self, name: str) -> dict[tuple[str, int], list[dict[str, Any]]]:
        """The model calls of each episode of rollouts/<name>.parquet (token ids, as stored), by (task, sample)."""
        rows = pq.read_table(self.root / "rollouts" / f"{name}.parquet", columns=["task_id", "sample", "calls"])
        return {(r["task_id"], r["sample"]): r["calls"] for r in rows.to_pylist()}

    def checkpoint_path(self, version: int) -> Path:
        return self.root / "checkpoints" / f"v{version:05d}"

    def relative(self, path: Path) -> str:
        return str(path.relative_to(self.root))

    def prune_checkpoints(self) -> None:
        """Keeps the latest checkpoint and the best-so-far pair's."""
        best = self.state.best
        keep = {self.state.checkpoint, best.checkpoint if best else None}
        for path in (self.root / "checkpoints").glob("v*"):
            if self.relative(path) not in keep:
                shutil.rmtree(path, ignore_errors=True)
