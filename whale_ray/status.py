"""`whale status RUN_DIR`: where a run stands, read from its run directory alone (no Ray, no actors).

A submitted job's progress bar is in its driver's log; this reads the files a run keeps (state.json,
config.yaml, archive/, events.jsonl), so a user can follow the run from anywhere its run directory is
visible: the head, another pod that mounts the volume, a laptop with the NFS share.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from whale_ray.config import ConfigError, load_config
from whale_ray.run_state import open_run

LAST_EVENTS = 5


def read_status(run_dir: Path) -> dict[str, Any]:
    root = Path(run_dir)
    state = open_run(root)
    cycles, config_note, test_samples = None, None, None
    try:
        from whale_ray.schedules import plan

        cfg = load_config(root / "config.yaml")
        cycles, test_samples = len(plan(cfg)), cfg.eval.test_samples
        config_note = f"{cfg.domain}, {cfg.condition}, E={cfg.E:g}, I={cfg.I}"
    except (ConfigError, OSError) as e:  # the state alone still says where the run is
        config_note = f"config.yaml unreadable ({e})"
    rows = Counter()
    for f in state.rollout_files:
        rows[f.phase] += f.rows
    best, best_test = state.best, None
    if best is not None:
        tests = [e for e in state.evaluations if e.split == "test" and e.weight_version == best.weight_version
                 and e.harness_id == best.harness_id and (test_samples is None or e.samples == test_samples)]
        best_test = tests[-1] if tests else None
    archive = root / "archive"
    candidates = [d for d in archive.iterdir() if d.is_dir() and not d.name.startswith(".")] if archive.is_dir() else []
    evaluated = sum((d / "scores.json").is_file() for d in candidates)
    return {"run_dir": str(root.resolve()), "config": config_note, "finished": state.finished, "cycle": state.cycle,
            "cycles": cycles, "phase": state.phase.model_dump() if state.phase else None,
            "weight_version": state.weight_version, "checkpoint": state.checkpoint,
            "checkpoint_pending": state.checkpoint_pending,
            "accepted_harness": state.accepted_harness, "rollouts": dict(rows), "ledger": state.ledger.model_dump(),
            "best": best.model_dump() if best else None,
            "best_test": best_test.model_dump() if best_test else None,
            "candidates": len(candidates), "evaluated": evaluated, "events": last_events(root / "events.jsonl")}


def last_events(path: Path, n: int = LAST_EVENTS) -> list[str]:
    """The last `n` lines of events.jsonl as short text (a line that is not JSON is shown as it is)."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines()[-n:]:
        try:
            event = json.loads(line)
        except ValueError:
            out.append(line.strip())
            continue
        if isinstance(event, dict):
            event.pop("ts", None)  # the same moment as "time", for programs
            head = [str(event.pop(k)) for k in ("time", "kind", "event") if k in event]
            out.append(" ".join(head + [f"{k}={v}" for k, v in event.items()]))
        else:
            out.append(str(event))
    return out


def format_status(s: dict[str, Any]) -> str:
    cycles = "?" if s["cycles"] is None else s["cycles"]
    if s["finished"]:
        where = f"finished ({s['cycle']}/{cycles} cycles)"
    else:
        p = s["phase"]
        phase = "between phases" if p is None else (
            f"{p['kind']} phase {'done' if p['done'] else 'running'} ({p['units_done']} "
            f"{'steps' if p['kind'] == 'weight' else 'iterations'} done)")
        where = f"cycle {s['cycle'] + 1}/{cycles}, {phase}"
    led = s["ledger"]
    order = ["weight", "harness", "validate", "val", "test"]
    rollouts = ", ".join(f"{k} {v}" for k, v in sorted(s["rollouts"].items(), key=lambda kv: order.index(kv[0]))) or "none yet"
    lines = [f"run {s['run_dir']}  ({s['config']})", f"where:     {where}",
             f"weights:   version {s['weight_version']} ({s['checkpoint'] or 'base model'}"
             f"{'; ' + s['checkpoint_pending'] + ' being written' if s.get('checkpoint_pending') else ''}); "
             f"accepted harness {s['accepted_harness']}",
             f"rollouts:  {rollouts}  (training {led['weight_rollouts'] + led['harness_rollouts']}, "
             f"eval {led['eval_rollouts']}; {led['weight_steps']} weight steps, {led['harness_iterations']} "
             f"harness iterations)",
             f"archive:   {s['candidates']} candidates, {s['evaluated']} evaluated"]
    b, t = s["best"], s["best_test"]
    if b is None:
        lines.append("best:      none yet (row 0 not reported)")
    else:
        test = "not yet" if t is None else f"{t['mean']:.3f} (mean@{t['samples']})"
        lines.append(f"best:      v{b['weight_version']}+{b['harness_id']}  val {b['val']:.3f}  test {test}")
    if s["events"]:
        lines.append("last events:")
        lines += [f"  {e}" for e in s["events"]]
    return "\n".join(lines)
