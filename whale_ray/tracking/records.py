"""A run directory as tracker records: the config as params, a point per weight step, harness iteration and cycle,
and the files worth keeping. Only what the run has on record (state.json) is read; nothing here writes."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow.parquet as pq
import yaml

from whale_ray.config import dotted_keys
from whale_ray.run_state import RunState

AXES = ("weight", "harness", "cycle")  # a point's step counts weight steps, harness iterations or cycles (0: start)
REPORT_FILES = ("index.html", "summary.md", "curves.png")


@dataclass
class Point:
    axis: str
    step: int
    metrics: dict[str, float]
    tags: dict[str, str] = field(default_factory=dict)  # the latest value stands (the accepted harness, the best pair)
    texts: dict[str, str] = field(default_factory=dict)  # file name -> text, one per step


def key(name: str) -> str:
    """A metric or tag name every tracker takes (MLflow's: letters, digits, _ - . / and spaces)."""
    return re.sub(r"[^\w\-./ ]", "_", name)


def _numbers(prefix: str, values: dict) -> dict[str, float]:
    return {key(f"{prefix}{k}"): float(v) for k, v in values.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def params(run_dir: Path) -> dict[str, str]:
    """The resolved config (config.yaml) as dotted keys."""
    tree = yaml.safe_load((Path(run_dir) / "config.yaml").read_text()) or {}
    return {k: v if isinstance(v, str) else json.dumps(v) for k, v in dotted_keys(tree).items()}


def run_tags(run_dir: Path) -> dict[str, str]:
    tree = yaml.safe_load((Path(run_dir) / "config.yaml").read_text()) or {}
    return {"condition": str(tree.get("condition")), "seed": str(tree.get("seed")), "domain": str(tree.get("domain")),
            "run_dir": str(Path(run_dir).resolve())}


def points(run_dir: Path, state: RunState, axis: str, start: int) -> list[Point]:
    """The axis' points on record from the `start`-th on (each axis is a list that only grows)."""
    if axis == "weight":
        return [weight_point(run_dir, name, i + 1) for i, name in enumerate(state.train_steps) if i >= start]
    if axis == "harness":
        return [harness_point(row) for row in state.iterations[start:]]
    return [cycle_point(row) for row in state.history[start:]]


def weight_point(run_dir: Path, name: str, step: int) -> Point:
    record = json.loads((Path(run_dir) / "train" / f"{name}.json").read_text())
    table = pq.read_table(Path(run_dir) / "rollouts" / f"{record['rollout_file']}.parquet", columns=["reward", "status"])
    rewards, status = table.column("reward").to_pylist(), table.column("status").to_pylist()
    m = record["metrics"]
    metrics = {"reward": sum(rewards) / len(rewards) if rewards else None,
               "accepted_fraction": sum(r == 1 and s == "ok" for r, s in zip(rewards, status)) / len(rewards)
               if rewards else None,
               "loss": m.get("loss"), "grad_norm": m.get("grad_norm"), "tokens": m.get("n_tokens"),
               "examples": m.get("n_examples"), "lr": m.get("lr"), "weight_version": record.get("version_after")}
    return Point("weight", step, _numbers("weight/", metrics))


def harness_point(row) -> Point:
    scored = [s for s in row.candidates.values() if s is not None]
    metrics = {"accepted_success": row.accepted_success, "candidates": len(row.candidates),
               "candidates_rejected": len(row.candidates) - len(scored),
               "best_candidate_success": max(scored) if scored else None,
               "mean_candidate_success": sum(scored) / len(scored) if scored else None,
               "proposer_tokens": row.proposer_tokens, "proposer_cost_usd": row.proposer_cost_usd}
    return Point("harness", row.iteration, _numbers("harness/", metrics), tags={"accepted_harness": row.accepted},
                 texts={f"harness/iteration-{row.iteration:04d}.json": json.dumps(
                     {"cycle": row.cycle, "accepted": row.accepted, "candidates": row.candidates}, indent=1)})


def cycle_point(row) -> Point:
    metrics = {**_numbers("cycle/", {"val": row.val, "best_val": row.best_val, "test_mean_at_k": row.test_mean8,
                                     "k": row.test_samples, "train_reward": row.train_reward,
                                     "harness_success": row.harness_success, "weight_version": row.weight_version,
                                     "weight_rollouts": row.weight_rollouts, "harness_rollouts": row.harness_rollouts,
                                     "wall_s": row.wall_s}),
               **_numbers("cycle/test/", row.test_metrics)}
    if row.ledger is not None:
        ledger = row.ledger.model_dump()
        metrics.update(_numbers("ledger/", {**ledger, "training_rollouts": row.ledger.training_rollouts,
                                            "proposer_tokens": row.ledger.proposer_tokens}))
    return Point("cycle", row.cycle, metrics, tags={"best_pair": row.best, "accepted_harness": row.accepted_harness})


def files(run_dir: Path, state: RunState) -> dict[str, Path]:
    """Artifacts: the report page (and its summary and curves), the accepted harness and the best pair's harness."""
    root = Path(run_dir)
    out = {f"report/{n}": root / "report" / n for n in REPORT_FILES}
    out[f"harness/accepted/{state.accepted_harness}.py"] = root / "archive" / state.accepted_harness / "harness.py"
    if state.best is not None:
        out[f"harness/best/{state.best.harness_id}.py"] = root / "archive" / state.best.harness_id / "harness.py"
    return {name: path for name, path in out.items() if path.is_file()}
