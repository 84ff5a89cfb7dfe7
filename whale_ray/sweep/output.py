"""What a sweep leaves in its root: the table best first by val (sweep.md, sweep.csv), val against training
rollouts for every trial (sweep.png), the (rollouts, test) Pareto set (pareto.csv) and the best trial's config
as a ready-to-run YAML (best.yaml). Every number is read from the trials' run directories, the truth of a run."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any, Optional

import yaml
from pydantic import BaseModel

from whale_ray.config import load_recorded_config
from whale_ray.run_state import RunState
from whale_ray.storage import atomic_write_text


class TrialRow(BaseModel):
    name: str  # the run directory's name
    run_dir: str
    values: dict[str, Any]  # the settings the trial varies
    cycles_done: int
    cycles: int
    val: Optional[float]  # the last cycle's val
    best_val: Optional[float]
    test_mean: Optional[float]  # mean@k of (θ*, h*) on D_test: reported, never selected on
    test_samples: int
    training_rollouts: int
    finished: bool
    error: Optional[str] = None
    curve: list[tuple[int, float]] = []  # (training rollouts so far, val) per recorded cycle

    @property
    def stopped_early(self) -> bool:
        return not self.finished and self.error is None


def trial_row(run_dir: Path, values: dict[str, Any], error: Optional[str] = None) -> TrialRow:
    state = RunState.load(run_dir)
    cycles = load_recorded_config(run_dir / "config.yaml").cycles if (run_dir / "config.yaml").is_file() else 0
    history = state.history if state else []
    curve, spent = [], 0
    for row in history:
        spent += row.weight_rollouts + row.harness_rollouts
        curve.append((spent, row.val))
    last = history[-1] if history else None
    return TrialRow(name=run_dir.name, run_dir=str(run_dir), values=values, cycles_done=max(0, len(history) - 1),
                    cycles=cycles, val=last.val if last else None, best_val=last.best_val if last else None,
                    test_mean=last.test_mean8 if last else None, test_samples=last.test_samples if last else 8,
                    training_rollouts=state.ledger.training_rollouts if state else 0,
                    finished=bool(state and state.finished), error=error, curve=curve)


def ranked(rows: list[TrialRow], metric: str) -> list[TrialRow]:
    """Best first by the validation metric; at equal val the trial that spent fewer rollouts first."""
    return sorted(rows, key=lambda r: (-(getattr(r, metric) if getattr(r, metric) is not None else -1.0),
                                       r.training_rollouts, r.name))


def pareto(rows: list[TrialRow]) -> list[TrialRow]:
    """Trials no other trial beats on both fewer training rollouts and higher test mean (ties kept)."""
    done = [r for r in rows if r.test_mean is not None]
    return sorted((r for r in done if not any(
        o.training_rollouts <= r.training_rollouts and o.test_mean >= r.test_mean and
        (o.training_rollouts < r.training_rollouts or o.test_mean > r.test_mean) for o in done)),
        key=lambda r: r.training_rollouts)


COLUMNS = ("trial", "settings", "best val", "val", "test mean@k", "training rollouts", "cycles", "ended")


def table_rows(rows: list[TrialRow]) -> list[list[str]]:
    def num(x: Optional[float]) -> str:
        return "-" if x is None else f"{x:.3f}"

    out = []
    for r in rows:
        ended = f"error: {r.error}" if r.error else ("stopped early" if r.stopped_early else "finished")
        settings = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.values.items())
        out.append([r.name, settings, num(r.best_val), num(r.val), f"{num(r.test_mean)} (k={r.test_samples})",
                    str(r.training_rollouts), f"{r.cycles_done}/{r.cycles}", ended])
    return out


def write_outputs(root: Path, rows: list[TrialRow], metric: str) -> dict[str, Path]:
    """Writes sweep.md, sweep.csv, pareto.csv, sweep.png and best.yaml into the root; returns their paths."""
    root = Path(root)
    rows = ranked(rows, metric)
    body = table_rows(rows)
    md = [f"# Sweep, best first by {metric} (test is reported, never selected on)", "",
          "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    md += ["| " + " | ".join(cells) + " |" for cells in body]
    front = pareto(rows)
    md += ["", "Pareto set of (training rollouts, test mean): " + ", ".join(
        f"{r.name} ({r.training_rollouts}, {r.test_mean:.3f})" for r in front)]
    paths = {"table": root / "sweep.md", "csv": root / "sweep.csv", "pareto": root / "pareto.csv",
             "plot": root / "sweep.png", "best": root / "best.yaml"}
    atomic_write_text(paths["table"], "\n".join(md) + "\n")
    with open(paths["csv"], "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(COLUMNS)
        w.writerows(body)
    with open(paths["pareto"], "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(("trial", "training rollouts", "test mean", "best val"))
        w.writerows((r.name, r.training_rollouts, r.test_mean, r.best_val) for r in front)
    plot(rows, paths["plot"], metric)
    if rows and rows[0].best_val is not None:
        best = load_recorded_config(Path(rows[0].run_dir) / "config.yaml")
        best.run_dir = root / f"best-{rows[0].name}"  # a fresh run of the best schedule, not the trial's own
        text = yaml.safe_dump(best.model_dump(mode="json"), sort_keys=False)
        atomic_write_text(paths["best"], f"# the best trial by {metric}: {rows[0].name}; run with "
                                         f"`whale run --config {paths['best']}`\n" + text)
    else:
        paths.pop("best")
    return paths


def plot(rows: list[TrialRow], path: Path, metric: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows:
        if r.curve:
            xs, ys = zip(*r.curve)
            ax.plot(xs, ys, marker="o", linestyle="--" if r.stopped_early else "-",
                    label=f"{r.name}{' (stopped)' if r.stopped_early else ''}")
    ax.set_xlabel("training rollouts (weight + harness)")
    ax.set_ylabel("val (D_val mean)")
    ax.set_title(f"sweep: val against training rollouts ({len(rows)} trials, ranked by {metric})")
    ax.grid(alpha=0.3)
    if rows:
        ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
