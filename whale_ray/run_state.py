"""The run directory's state.json: where the run is, what it has spent, and what it has found.

It is rewritten atomically after every unit of work (a weight step, a harness iteration, an
evaluation), so a killed run resumes from the last finished unit and counts nothing twice.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, Field, ValidationError, model_validator

from whale_ray.storage import atomic_write_text


class Ledger(BaseModel):
    """Rollouts by what they were spent on. Budget comparisons use weight + harness; eval is reporting."""

    weight_rollouts: int = 0
    harness_rollouts: int = 0
    eval_rollouts: int = 0
    weight_steps: int = 0
    harness_iterations: int = 0
    candidates_proposed: int = 0
    candidates_invalid: int = 0  # leakage rejections included
    candidates_leaked: int = 0  # rejected because their code held D_test text
    # The proposer's own ledger, apart from rollouts: the sum over RunState.proposer_sessions.
    proposer_sessions: int = 0
    proposer_calls: int = 0
    proposer_prompt_tokens: int = 0  # cached ones included
    proposer_completion_tokens: int = 0
    proposer_cached_tokens: int = 0
    proposer_cost_usd: float = 0.0
    proposer_wall_s: float = 0.0
    proposer_retries: int = 0
    proposer_stop: Optional[str] = None  # the proposer budget cap that ended harness search, if one did

    @property
    def training_rollouts(self) -> int:
        return self.weight_rollouts + self.harness_rollouts

    @property
    def proposer_tokens(self) -> int:
        return self.proposer_prompt_tokens + self.proposer_completion_tokens


class PhaseProgress(BaseModel):
    cycle: int
    index: int  # position of the phase within its cycle
    kind: str
    units_done: int = 0  # weight steps or harness iterations finished
    prompts_done: int = 0
    step_rewards: list[float] = Field(default_factory=list)
    best_success: list[float] = Field(default_factory=list)
    wall_s: float = 0.0
    done: bool = False


class Selection(BaseModel):
    weight_version: int
    checkpoint: Optional[str]  # relative to the run dir; None means the base model
    harness_id: str
    val: float


class CycleRow(BaseModel):
    cycle: int
    phases: str
    weight_rollouts: int
    harness_rollouts: int
    train_reward: Optional[float]
    accepted_harness: str
    harness_success: Optional[float]
    weight_version: int
    val: float
    best_val: float
    best: str
    test_mean8: float  # mean@k of (θ*, h*) on D_test; the name keeps the paper's k = 8 for old run directories
    test_samples: int = 8  # k (eval.test_samples)
    wall_s: float
    # D_test of (θ*, h*) beyond mean@8: truncation_rate, the domain's metrics, "group:<name>" means
    test_metrics: dict[str, float] = Field(default_factory=dict)
    ledger: Optional[Ledger] = None  # the run's ledgers when the row was recorded (None: rows of older runs)


class PendingReport(BaseModel):
    """A cycle whose phases are done and whose row waits on its D_val (and D_test) evaluations: what the row says of
    the cycle, fixed when it ended (whale_ray/loop/report.py)."""

    cycle: int  # the loop's cycle index; -1: the start, (θ0, h0)
    phases: str
    weight_version: int
    checkpoint: Optional[str]
    harness_id: str
    harness_success: Optional[float]
    train_reward: Optional[float]
    start: Ledger  # the ledger when the cycle began and when its phases ended
    spent: Ledger
    wall_s: float


class IterationRow(BaseModel):
    """One harness iteration as it ended: what its candidates scored and which harness it left accepted."""

    iteration: int  # archive-wide, as the archive and proposer/iter-NNNN number it
    cycle: int
    candidates: dict[str, Optional[float]]  # candidate id -> D_harness success (None: rejected before evaluation)
    accepted: str
    accepted_success: float
    proposer_tokens: int  # the proposer ledger so far
    proposer_cost_usd: float


RolloutPhase = Literal["weight", "validate", "harness", "val", "test"]
STATE_VERSION = 2  # 1: rollout files and evaluations keyed by strings ("test|v3|c004|8"); 2: typed records


class RolloutFile(BaseModel):
    """A rollouts/<name>.parquet on record: only files on record count, and each counts once."""

    name: str
    phase: RolloutPhase
    cycle: int  # the cycle whose work it was (for val/test: the cycle that asked for the evaluation)
    rows: int


class Evaluation(BaseModel):
    """The mean reward (and split_metrics) of `samples` episodes per task of a split, for one (θ, h) pair."""

    split: Literal["val", "test"]
    weight_version: int
    harness_id: str
    samples: int
    mean: float
    metrics: dict[str, float] = Field(default_factory=dict)

    def same_pair(self, split: str, weight_version: int, harness_id: str, samples: int) -> bool:
        return (self.split, self.weight_version, self.harness_id, self.samples) == (
            split, weight_version, harness_id, samples)


class RunState(BaseModel):
    version: int = STATE_VERSION
    finished: bool = False
    cycle: int = 0
    phase: Optional[PhaseProgress] = None
    weight_version: int = 0
    checkpoint: Optional[str] = None  # the latest checkpoint on record, relative to the run dir; None: the base model
    checkpoint_version: int = 0  # its weight version: weight_version's, but while `checkpoint_pending` is written
    # weight_version's checkpoint while the Trainer writes it in the background (a weight phase's last, written
    # beside the harness phase): until it is on record, a relaunch starts from `checkpoint` and trains the steps on
    # record after it again, on their recorded examples
    checkpoint_pending: Optional[str] = None
    accepted_harness: str = "h0"
    weight_cursor: int = 0  # position in the current pass over D_weight
    weight_pass: int = 0  # how many passes over D_weight have started (seeds the shuffle)
    best: Optional[Selection] = None
    report: Optional[PendingReport] = None  # the last cycle's row, while its evaluations run beside the next one
    ledger: Ledger = Field(default_factory=Ledger)
    cycle_start: Optional[Ledger] = None  # the ledger when the current cycle began
    history: list[CycleRow] = Field(default_factory=list)
    iterations: list[IterationRow] = Field(default_factory=list)  # every harness iteration on record
    evaluations: list[Evaluation] = Field(default_factory=list)
    phase_wall_s: dict[str, float] = Field(default_factory=dict)
    cycle_wall_s: float = 0.0  # the current cycle's work so far, over every launch
    rollout_files: list[RolloutFile] = Field(default_factory=list)
    train_steps: list[str] = Field(default_factory=list)  # train/<name>.json on record
    phases_done: list[str] = Field(default_factory=list)  # "cycle:kind:units", in the order they finished
    # proposer sessions on record ("iter-0007/session", "iter-0007/aborted-1"): their usage, counted once
    proposer_sessions: dict[str, dict[str, Union[int, float]]] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _upgrade(cls, data: Any) -> Any:
        """A state.json written by an older whale-ray (version 1) is read into today's typed records."""
        if not isinstance(data, dict) or data.get("version", 1) >= STATE_VERSION:
            return data
        data = dict(data, version=STATE_VERSION)
        files = data.get("rollout_files") or {}
        if isinstance(files, dict):  # the phase was the file name's prefix
            data["rollout_files"] = [{"name": n, "phase": n.split("-", 1)[0], "rows": rows,
                                      "cycle": int(n.split("-")[1][1:]) if n.split("-")[1][:1] == "c" else -1}
                                     for n, rows in files.items()]
        cache, metrics = data.pop("eval_cache", {}) or {}, data.pop("eval_metrics", {}) or {}
        evaluations = []
        for key, mean in cache.items():  # "test|v3|c004|8"
            split, version, harness_id, samples = key.split("|")
            evaluations.append({"split": split, "weight_version": int(version[1:]), "harness_id": harness_id,
                                "samples": int(samples), "mean": mean, "metrics": metrics.get(key, {})})
        data.setdefault("evaluations", evaluations)
        return data

    @model_validator(mode="after")
    def _checkpoint_version(self) -> "RunState":
        if "checkpoint_version" not in self.model_fields_set:  # a state.json from before it was recorded
            self.checkpoint_version = self.weight_version
        return self

    @classmethod
    def load(cls, run_dir: Path) -> "RunState | None":
        path = Path(run_dir) / "state.json"
        if not path.exists():
            return None
        return cls.model_validate(json.loads(path.read_text()))

    def save(self, run_dir: Path) -> None:
        atomic_write_text(Path(run_dir) / "state.json", self.model_dump_json(indent=2))


class NotARun(ValueError):
    """A path given as a run directory is not one (or its state does not read); one line naming it."""


def open_run(run_dir: Path) -> RunState:
    """The run's state, or NotARun naming the directory and what is wrong with it (`whale status`, `whale report`,
    `whale compare`)."""
    root = Path(run_dir)
    if not root.is_dir():
        raise NotARun(f"{root}: no such directory")
    if not (root / "state.json").is_file():
        raise NotARun(f"{root}: not a run directory (no state.json)")
    try:
        state = RunState.load(root)
    except (ValueError, ValidationError) as e:  # json.JSONDecodeError is a ValueError
        raise NotARun(f"{root}/state.json: not a run state ({str(e).splitlines()[0]})") from None
    assert state is not None
    return state
