"""Where a run's time went, from its run directory alone: timings.jsonl (each timed act of a phase), the rollout
files (each episode's own split: sandbox start, model calls, tools, teardown) and state.json (phase and cycle wall
times). `whale status RUN_DIR --time` prints it; benchmarks/gpu_whale_run.py adds the GPU's and the cores' busy
shares, sampled beside the run, to the same acts.

Acts (whale_ray/loop): `rollouts` (the pool's wall time for a batch of episodes; a cycle's D_val or D_test episodes
that ran beside a phase's batch are in its count, and in its `report_episodes`) and `verify` in every phase
(weight, harness, validate, val, test); `sleep`, `train`, `sync`, `checkpoint` and `release` in the weight phase;
`propose` in the harness phase. A `train` act is split in two: the step itself, as the Trainer timed it (`step_s`)
less the Ray Train run's start inside it (`workers_start_s`), and the rest, shown as w-start: the workers' start,
in the step or waited on behind the start a Coordinator asks for early (actors/trainer.py), and the call. A cycle's
fixed cost is its wall time less the time its rollouts, verification, training steps and proposer sessions cover
(the union of their spans): what a cycle pays whatever its size (worker starts, sleep and wake, weight syncs,
checkpoints, commits), and does not hide behind work. A weight step's next `rollouts` begin beside its `train` (their
episodes' model calls wait for the step's weights, or, under `weight.max_staleness: 1`, run on the weights before
it), so a weight phase's acts may add up to more than its wall time.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from whale_ray.loop.run_dir import TIMINGS_FILE
from whale_ray.run_state import open_run

GROUPS = {"weight": "weight", "harness": "harness", "validate": "harness", "val": "eval", "test": "eval"}
EPISODE_PARTS = ("start", "model", "tools", "teardown")  # EpisodeResult.timings; the rest is the harness's own
WORK_ACTS = ("rollouts", "verify", "propose")  # with a step's training proper: not a cycle's fixed cost


@dataclass
class PhaseTime:
    wall_s: float = 0.0
    acts: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    episodes: int = 0  # in the phase's pool calls, a cycle's report that ran beside them included
    report_episodes: int = 0  # of those, the report's
    episode_s: float = 0.0  # the episodes' own wall time, summed (several run at once)
    episode_parts: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    def other_s(self) -> float:
        """The phase's wall time that no timed act covers."""
        return max(0.0, self.wall_s - sum(self.acts.values()))


@dataclass
class TimeBreakdown:
    phases: dict[str, PhaseTime]
    cycles: list[dict[str, float]]  # per report row >= 1: wall_s, work_s, fixed_s and the fixed cost's timed acts
    spans: list[dict[str, Any]]  # timings.jsonl, as written


def training_proper(span: dict[str, Any]) -> float:
    """Of a `train` act, the seconds the step itself took (the rest waited on the Trainer's workers)."""
    own = span.get("step_s")
    proper = (span["s"] if own is None else own) - span.get("workers_start_s", 0.0)
    return min(span["s"], max(0.0, proper))


def work_covered(spans: list[dict[str, Any]]) -> float:
    """The seconds in which some work act ran (rollouts, verification, proposer sessions, a step's training proper,
    which ends its `train` act): overlapping acts count once."""
    intervals = []
    for s in spans:
        if s["act"] in WORK_ACTS:
            intervals.append((s["start"], s["start"] + s["s"]))
        elif s["act"] == "train":
            end = s["start"] + s["s"]
            intervals.append((end - training_proper(s), end))
    covered, reach = 0.0, float("-inf")
    for lo, hi in sorted(intervals):
        if hi > reach:
            covered += hi - max(lo, reach)
            reach = hi
    return covered


def read_spans(run_dir: Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / TIMINGS_FILE
    if not path.is_file():
        return []
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            raise ValueError(f"{path}:{n}: not a JSON line") from None
    return out


def time_breakdown(run_dir: Path) -> TimeBreakdown:
    import pyarrow.parquet as pq

    root = Path(run_dir)
    state = open_run(root)
    spans = read_spans(root)
    phases = {g: PhaseTime() for g in ("weight", "harness", "eval")}
    for span in spans:
        group = GROUPS.get(span["phase"])
        if group is None:
            continue
        p = phases[group]
        if span["act"] == "train":
            p.acts["train"] += training_proper(span)
            p.acts["workers_start"] += span["s"] - training_proper(span)
        else:
            p.acts[span["act"]] += span["s"]
        if span["act"] == "rollouts":
            p.episodes += span.get("episodes", 0)
            p.report_episodes += span.get("report_episodes", 0)
    for kind in ("weight", "harness"):
        phases[kind].wall_s = state.phase_wall_s.get(kind, 0.0)
    phases["eval"].wall_s = phases["eval"].acts["rollouts"] + phases["eval"].acts["verify"]
    for f in state.rollout_files:
        path = root / "rollouts" / f"{f.name}.parquet"
        table = pq.read_table(path, columns=[c for c in ("wall_s", "timings") if c in pq.read_schema(path).names])
        p = phases[GROUPS[f.phase]]
        p.episode_s += sum(table.column("wall_s").to_pylist())
        if "timings" in table.column_names:
            for parts in table.column("timings").to_pylist():
                for k, v in parts or []:
                    p.episode_parts[k] += v
    cycles = []
    for row in state.history[1:]:
        mine = [s for s in spans if s.get("cycle") == row.cycle]
        work = work_covered(mine)
        fixed = {"workers_start": sum(s["s"] - training_proper(s) for s in mine if s["act"] == "train")}
        for s in mine:
            if s["act"] not in (*WORK_ACTS, "train"):
                fixed[s["act"]] = fixed.get(s["act"], 0.0) + s["s"]
        cycles.append({"cycle": row.cycle, "wall_s": row.wall_s, "work_s": work,
                       "fixed_s": max(0.0, row.wall_s - work), **{f"{k}_s": v for k, v in fixed.items()}})
    return TimeBreakdown(phases=phases, cycles=cycles, spans=spans)


def format_breakdown(b: TimeBreakdown) -> str:
    acts = ("rollouts", "verify", "workers_start", "train", "sleep", "sync", "checkpoint", "release", "propose")
    labels = {"workers_start": "w-start", "checkpoint": "ckpt"}
    width = {a: max(7, len(labels.get(a, a))) for a in acts}
    lines = ["seconds per act (w-start: waiting on the Trainer's workers to start, train: the steps themselves):",
             f"{'phase':<8} {'wall s':>8} {'episodes':>8} {'ep/s':>7}  "
             + " ".join(f"{labels.get(a, a):>{width[a]}}" for a in acts) + f" {'other':>7}"]
    for name, p in b.phases.items():
        if not p.wall_s:
            continue
        rate = p.episodes / p.wall_s
        cells = []
        for a in acts:
            v = p.acts.get(a, 0.0)
            cells.append(f"{v:>{width[a]}.2f}" if a in p.acts else f"{'-':>{width[a]}}")
        lines.append(f"{name:<8} {p.wall_s:>8.1f} {p.episodes:>8} {rate:>7.2f}  " + " ".join(cells)
                     + f" {p.other_s():>7.2f}")
    lines.append("")
    lines.append("episode time, share of the episodes' summed wall time (several run at once):")
    lines.append(f"{'phase':<8} {'episode s':>9}  " + " ".join(f"{k:>8}" for k in (*EPISODE_PARTS, "harness")))
    for name, p in b.phases.items():
        if not p.episode_s:
            continue
        parts = [p.episode_parts.get(k, 0.0) for k in EPISODE_PARTS]
        rest = max(0.0, p.episode_s - sum(parts))
        lines.append(f"{name:<8} {p.episode_s:>9.1f}  " + " ".join(f"{v / p.episode_s:>8.1%}" for v in (*parts, rest)))
    if b.cycles:
        lines.append("")
        lines.append("a cycle's fixed cost (wall less the time rollouts, verification, training steps and proposer "
                     "sessions cover):")
        for c in b.cycles:
            timed = ", ".join(f"{k[:-2]} {v:.2f}" for k, v in c.items()
                              if k.endswith("_s") and k not in ("wall_s", "work_s", "fixed_s") and v)
            lines.append(f"  cycle {c['cycle']}: wall {c['wall_s']:.1f} s, fixed {c['fixed_s']:.2f} s"
                         + (f" (timed: {timed})" if timed else ""))
    return "\n".join(lines)
