"""`whale compare DIR...`: the runs of a study side by side, one row per condition, mean ± std over seeds.

A DIR is a run directory (it holds state.json) or a folder of them (a study root: every run directory
below it). Per condition: test mean@k of (θ*, h*) after the last cycle, training rollouts spent (weight +
harness; val/test reporting excluded, as in the paper), rollouts to reach weight-only's best val and the
ratio to weight-only's own, proposer tokens and wall time; the paper's number for the same domain and
condition beside it, labelled as the paper's. Written to OUT: compare.md, compare.csv (a row per
condition), runs.csv (a row per run), compare.png, chain.png and index.html (report/study_page.py).
"""

from __future__ import annotations

import csv
import io
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from whale_ray.config import CONDITIONS, ConfigError, WhaleConfig, load_recorded_config
from whale_ray.report import Grid, NotARun, open_run
from whale_ray.run_state import CycleRow, RunState
from whale_ray.selection import EPS
from whale_ray.storage import atomic_write_text

# [paper] mean@8 in percent at (E, I) = (0.6, 6), from the WHALE paper (MISSION.md's headline table; adaptive
# WHALE's Search QA number is stated on its own). Not reproduced here: shown beside our numbers, never mixed in.
PAPER_MEAN8 = {
    "search_qa": {"mh_only": 38.29, "rsft_only": 38.27, "whale": 48.34, "adaptive_whale": 52.82},
    "math_reasoning": {"mh_only": 0.42, "rsft_only": 15.42, "whale": 24.79},
    "chess_puzzles": {"mh_only": 19.82, "rsft_only": 22.17, "whale": 29.83},
}
WEIGHT_ONLY = "rsft_only"


class CompareError(ValueError):
    """Bad input to compare; the message is one line naming the input and what is wrong."""


@dataclass
class Run:
    path: Path
    cfg: WhaleConfig
    state: RunState

    @property
    def condition(self) -> str:
        return self.cfg.condition

    @property
    def rows(self) -> list[CycleRow]:
        return self.state.history

    @property
    def test(self) -> float:
        return self.rows[-1].test_mean8

    def cumulative_rollouts(self) -> list[int]:
        """Training rollouts (weight + harness) spent by the end of each history row."""
        out, total = [], 0
        for r in self.rows:
            total += r.weight_rollouts + r.harness_rollouts
            out.append(total)
        return out

    def rollouts_to_reach(self, target: float) -> Optional[int]:
        """Training rollouts spent when the best-so-far val first reached `target` (None: never)."""
        return next((n for n, r in zip(self.cumulative_rollouts(), self.rows) if r.best_val >= target - EPS), None)

    @property
    def wall_s(self) -> float:
        return sum(r.wall_s for r in self.rows)

    def chain(self) -> list[str]:
        """The accepted harness ids in the order they were first accepted."""
        return list(dict.fromkeys(r.accepted_harness for r in self.rows))


def find_runs(paths: list[Path]) -> list[Path]:
    """Each path as a run directory, or the run directories below it (not inside a run directory)."""
    found: list[Path] = []
    for p in map(Path, paths):
        if not p.is_dir():
            raise CompareError(f"{p}: no such directory")
        if (p / "state.json").is_file():
            found.append(p)
            continue
        below = sorted(s.parent for s in p.rglob("state.json"))
        runs = [d for d in below if not any(o != d and o in d.parents for o in below)]
        if not runs:
            raise CompareError(f"{p}: not a run directory, and no run directory below it (no state.json)")
        found += runs
    return list(dict.fromkeys(d.resolve() for d in found))


def load_run(path: Path) -> Run:
    try:
        state = open_run(path)
        cfg = load_recorded_config(path / "config.yaml")
    except (NotARun, ConfigError) as e:
        raise CompareError(str(e)) from None
    return Run(path, cfg, state)


def load_runs(paths: list[Path]) -> tuple[list[Run], list[str]]:
    """The runs, and notes on those left out (no cycle reported yet); one domain only."""
    runs, notes = [], []
    for path in find_runs(paths):
        run = load_run(path)
        if run.rows:
            runs.append(run)
        else:
            notes.append(f"{path}: left out, no cycle reported yet")
    if not runs:
        raise CompareError(f"{', '.join(map(str, paths))}: no run has reported a cycle yet")
    domains: dict[str, list[str]] = {}
    for r in runs:
        domains.setdefault(r.cfg.domain, []).append(r.path.name)
    if len(domains) > 1:
        mixed = "; ".join(f"{d} ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"
                          for d, names in domains.items())
        raise CompareError(f"runs of different domains in one compare: {mixed}")
    return runs, notes


def mean_std(xs: list[float]) -> tuple[float, Optional[float]]:
    """Mean and sample standard deviation (n - 1); no deviation for a single seed."""
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else None)


@dataclass
class ConditionRow:
    condition: str
    runs: list[Run]
    test_mean: float
    test_std: Optional[float]
    rollouts: float
    reach: list[Optional[int]]  # per run
    reach_mean: Optional[float]
    reach_ratio: Optional[float]  # reach_mean over weight-only's own
    proposer_tokens: float
    wall_s: float
    finished: int
    paper: Optional[float]

    @property
    def n(self) -> int:
        return len(self.runs)


@dataclass
class Comparison:
    domain: str
    k: int  # test samples per problem (mean@k)
    rows: list[ConditionRow]
    target: Optional[float]  # weight-only's best val, mean over its seeds (None: no weight-only run)
    notes: list[str] = field(default_factory=list)

    @property
    def runs(self) -> list[Run]:
        return [r for row in self.rows for r in row.runs]


def compare(runs: list[Run], notes: list[str] | None = None) -> Comparison:
    notes = list(notes or [])
    by: dict[str, list[Run]] = {}
    for r in sorted(runs, key=lambda r: (CONDITIONS.index(r.condition), r.cfg.seed, str(r.path))):
        by.setdefault(r.condition, []).append(r)
    domain = runs[0].cfg.domain
    ks = {r.rows[-1].test_samples for r in runs}
    if len(ks) > 1:
        notes.append(f"runs report different k in mean@k: {sorted(ks)}")
    for condition, group in by.items():
        budgets = {(r.cfg.E, r.cfg.I, r.cfg.cycles) for r in group}
        if len(budgets) > 1:
            notes.append(f"{condition}: its runs have different budgets (E, I, cycles) {sorted(budgets)}")
        seeds = [r.cfg.seed for r in group]
        if len(set(seeds)) < len(seeds):
            notes.append(f"{condition}: several runs share a seed ({seeds})")
    # Weight-only's best val, per seed: a seed fixes the splits, so a run is held to the val that the weight-only
    # run of its own seed reached on the same D_val (the mean over weight-only's seeds for a seed it lacks).
    peaks = {r.cfg.seed: r.rows[-1].best_val for r in by.get(WEIGHT_ONLY, [])}
    target = statistics.fmean(peaks.values()) if peaks else None
    if target is None:
        notes.append("no weight-only (rsft_only) run: rollouts to reach weight-only's best val are not computed")
    elif unmatched := sorted({r.cfg.seed for r in runs} - set(peaks)):
        notes.append(f"seeds {unmatched} have no weight-only run: held to the mean of weight-only's best val, {target:.4f}")
    if flat := sorted(r.cfg.seed for r in by.get(WEIGHT_ONLY, []) if r.rows[-1].best_val <= r.rows[0].best_val + EPS):
        notes.append(f"seeds {flat}: weight-only never beat (θ0, h0) on val, so there every run reaches weight-only's "
                     "best val at 0 rollouts (θ0 already had it)")
    rows = []
    for condition, group in by.items():
        test_mean, test_std = mean_std([r.test for r in group])
        reach = ([r.rollouts_to_reach(peaks.get(r.cfg.seed, target)) for r in group] if target is not None
                 else [None] * len(group))
        reached = [n for n in reach if n is not None]
        rows.append(ConditionRow(
            condition=condition, runs=group, test_mean=test_mean, test_std=test_std,
            rollouts=statistics.fmean(r.state.ledger.training_rollouts for r in group), reach=reach,
            reach_mean=statistics.fmean(reached) if reached else None, reach_ratio=None,
            proposer_tokens=statistics.fmean(r.state.ledger.proposer_tokens for r in group),
            wall_s=statistics.fmean(r.wall_s for r in group), finished=sum(r.state.finished for r in group),
            paper=PAPER_MEAN8.get(domain, {}).get(condition)))
    own = next((row.reach_mean for row in rows if row.condition == WEIGHT_ONLY), None)
    for row in rows:
        if row.reach_mean is not None and own:  # own is None or 0: no ratio to take
            row.reach_ratio = row.reach_mean / own
    return Comparison(domain=domain, k=ks.pop() if len(ks) == 1 else 0, rows=rows, target=target, notes=notes)


# ------------------------------------------------------------------------------------------ tables
def _pm(mean: float, std: Optional[float], scale: float = 100.0, digits: int = 2) -> str:
    m = f"{mean * scale:.{digits}f}"
    return f"{m} ± {std * scale:.{digits}f}" if std is not None else f"{m} (one seed)"


def _opt(x: Optional[float], fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def mean_k(c: Comparison) -> str:
    return f"mean@{c.k}" if c.k else "mean@k"


def table(c: Comparison) -> Grid:
    """The comparison table: our numbers in percent over seeds, the paper's beside them in their own column."""
    headers = ["condition", "seeds", f"test {mean_k(c)} % (mean ± std)", "training rollouts",
               "rollouts to reach w-o best val", "ratio to weight-only", "proposer tokens", "wall s",
               "[paper] mean@8 %, (0.6, 6)"]
    rows = []
    for row in c.rows:
        reached = sum(n is not None for n in row.reach)
        reach = "-" if c.target is None else (f"{row.reach_mean:,.0f} ({reached}/{row.n} seeds)" if reached
                                             else f"not reached (0/{row.n})")
        rows.append([row.condition, f"{row.n}" + ("" if row.finished == row.n else f" ({row.n - row.finished} unfinished)"),
                     _pm(row.test_mean, row.test_std), f"{row.rollouts:,.0f}", reach, _opt(row.reach_ratio, ".2f"),
                     f"{row.proposer_tokens:,.0f}", f"{row.wall_s:,.1f}", _opt(row.paper, ".2f")])
    return Grid(headers, rows, left={0})


def metrics_table(c: Comparison) -> Grid | None:
    """D_test of (θ*, h*) beyond mean@k after the last cycle (truncation rate, the domain's metrics, per-group
    means), mean ± std over each condition's seeds."""
    keys = sorted({k for r in c.runs for k in r.rows[-1].test_metrics}, key=lambda k: (k.startswith("group:"), k))
    if not keys:
        return None
    rows = []
    for row in c.rows:
        cells = []
        for k in keys:
            xs = [r.rows[-1].test_metrics[k] for r in row.runs if k in r.rows[-1].test_metrics]
            cells.append(_pm(*mean_std(xs), scale=1.0, digits=3) if xs else "-")
        rows.append([row.condition, *cells])
    return Grid(["condition", *(k.replace("_", " ") for k in keys)], rows, left={0})


def runs_table(c: Comparison) -> Grid:
    headers = ["condition", "seed", "run", "cycles", f"test {mean_k(c)}", "best val", "best (θ*,h*)",
               "training rollouts", "rollouts to reach", "proposer tokens", "wall s", "accepted harness chain"]
    rows = []
    for row in c.rows:
        for r, reach in zip(row.runs, row.reach):
            rows.append([row.condition, str(r.cfg.seed), r.path.name, str(r.rows[-1].cycle), f"{r.test:.4f}",
                         f"{r.rows[-1].best_val:.4f}", r.rows[-1].best, str(r.state.ledger.training_rollouts),
                         _opt(reach, "d"), str(r.state.ledger.proposer_tokens), f"{r.wall_s:.1f}",
                         " → ".join(r.chain())])
    return Grid(headers, rows, left={0, 2, 6, 11})


def caption(c: Comparison) -> list[str]:
    lines = [f"domain {c.domain}; test {mean_k(c)} of (θ*, h*) after each run's last cycle, in percent, mean ± sample "
             "standard deviation over seeds; training rollouts = weight + harness (val/test reporting excluded)."]
    if c.target is not None:
        lines.append("rollouts to reach: training rollouts spent when the best-so-far val first reached the best val of "
                     "the weight-only run of the same seed (same D_val), mean over the seeds that reached it; "
                     f"weight-only's best val is {c.target:.4f} on average over its seeds.")
    if c.domain in PAPER_MEAN8:
        lines.append("[paper]: the WHALE paper's mean@8 at (E, I) = (0.6, 6) on its own data and models (Qwen3.5), "
                     "as reported there; not reproduced here, and not comparable in scale to a tiny embedded policy.")
    return lines + c.notes


def markdown(c: Comparison) -> str:
    metrics = metrics_table(c)
    return "\n".join([f"# whale compare: {c.domain}", "", table(c).markdown(), "", *(f"- {x}" for x in caption(c)), "",
                      *([f"## D_test beyond {mean_k(c)} of (θ*, h*), mean ± std over seeds", "", metrics.markdown(), ""]
                        if metrics else []),
                      "## Runs", "", runs_table(c).markdown(), ""])


def condition_csv(c: Comparison) -> str:
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["domain", "condition", "seeds", "finished", "test_mean", "test_std", "training_rollouts",
                "reach_target_val", "rollouts_to_reach_mean", "seeds_reached", "reach_ratio_to_weight_only",
                "proposer_tokens", "wall_s", "paper_mean8_percent"])
    for row in c.rows:
        w.writerow([c.domain, row.condition, row.n, row.finished, row.test_mean, "" if row.test_std is None else row.test_std,
                    row.rollouts, "" if c.target is None else c.target,
                    "" if row.reach_mean is None else row.reach_mean, sum(n is not None for n in row.reach),
                    "" if row.reach_ratio is None else row.reach_ratio, row.proposer_tokens, row.wall_s,
                    "" if row.paper is None else row.paper])
    return buf.getvalue()


def runs_csv(c: Comparison) -> str:
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["condition", "seed", "run_dir", "cycles", "finished", "test_mean", "best_val", "best",
                "training_rollouts", "rollouts_to_reach", "proposer_tokens", "wall_s", "chain"])
    for row in c.rows:
        for r, reach in zip(row.runs, row.reach):
            w.writerow([row.condition, r.cfg.seed, str(r.path), r.rows[-1].cycle, r.state.finished, r.test,
                        r.rows[-1].best_val, r.rows[-1].best, r.state.ledger.training_rollouts,
                        "" if reach is None else reach, r.state.ledger.proposer_tokens, r.wall_s, " ".join(r.chain())])
    return buf.getvalue()


def default_out(paths: list[Path]) -> Path:
    """<DIR>/compare for one DIR (a study root, or a run), else ./compare."""
    return Path(paths[0]) / "compare" if len(paths) == 1 else Path("compare")


def curves(c: Comparison) -> dict[str, dict[str, list]]:
    """Per condition and cycle: mean training rollouts spent, and val and test of (θ*, h*) as mean and std over
    seeds. Seeds are aligned by cycle (they share the budget); a condition's curve stops at its shortest run."""
    out = {}
    for row in c.rows:
        n = min(len(r.rows) for r in row.runs)
        cum = [r.cumulative_rollouts() for r in row.runs]
        val = [mean_std([r.rows[i].best_val for r in row.runs]) for i in range(n)]
        test = [mean_std([r.rows[i].test_mean8 for r in row.runs]) for i in range(n)]
        out[row.condition] = {"rollouts": [statistics.fmean(x[i] for x in cum) for i in range(n)],
                              "val": [m for m, _ in val], "val_std": [s for _, s in val],
                              "test": [m for m, _ in test], "test_std": [s for _, s in test], "n": row.n}
    return out


def write_comparison(c: Comparison, out: Path) -> Path:
    from whale_ray.report.study_page import write_study_page

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "compare.md", markdown(c))
    atomic_write_text(out / "compare.csv", condition_csv(c))
    atomic_write_text(out / "runs.csv", runs_csv(c))
    write_study_page(out, domain=c.domain, k=mean_k(c), table=table(c), caption=caption(c), metrics=metrics_table(c),
                     runs=runs_table(c), curves=curves(c),
                     chains={row.condition: [(f"seed {r.cfg.seed}", r.rows) for r in row.runs] for row in c.rows},
                     run_dirs=[(r.condition, r.cfg.seed, r.path) for r in c.runs])
    return out
