"""The run directory's state.json: where the run is, what it has spent, and what it has found.

It is rewritten atomically after every unit of work (a weight step, a harness iteration, an
evaluation), so a killed run resumes from the last finished unit and counts nothing twice.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Union

from pydantic import BaseModel, Field

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
    test_mean8: float
    wall_s: float
    # D_test of (θ*, h*) beyond mean@8: truncation_rate, the domain's metrics, "group:<name>" means
    test_metrics: dict[str, float] = Field(default_factory=dict)


class RunState(BaseModel):
    finished: bool = False
    cycle: int = 0
    phase: Optional[PhaseProgress] = None
    weight_version: int = 0
    checkpoint: Optional[str] = None
    accepted_harness: str = "h0"
    weight_cursor: int = 0  # position in the current pass over D_weight
    weight_pass: int = 0  # how many passes over D_weight have started (seeds the shuffle)
    best: Optional[Selection] = None
    ledger: Ledger = Field(default_factory=Ledger)
    cycle_start: Optional[Ledger] = None  # the ledger when the current cycle began
    history: list[CycleRow] = Field(default_factory=list)
    eval_cache: dict[str, float] = Field(default_factory=dict)
    eval_metrics: dict[str, dict[str, float]] = Field(default_factory=dict)  # same keys as eval_cache
    phase_wall_s: dict[str, float] = Field(default_factory=dict)
    rollout_files: dict[str, int] = Field(default_factory=dict)  # rollouts/<name>.parquet on record: rows
    phases_done: list[str] = Field(default_factory=list)  # "cycle:kind:units", in the order they finished
    # proposer sessions on record ("iter-0007/session", "iter-0007/aborted-1"): their usage, counted once
    proposer_sessions: dict[str, dict[str, Union[int, float]]] = Field(default_factory=dict)

    @classmethod
    def load(cls, run_dir: Path) -> "RunState | None":
        path = Path(run_dir) / "state.json"
        if not path.exists():
            return None
        return cls.model_validate(json.loads(path.read_text()))

    def save(self, run_dir: Path) -> None:
        atomic_write_text(Path(run_dir) / "state.json", self.model_dump_json(indent=2))
