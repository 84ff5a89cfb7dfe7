"""The kill table: one small WHALE run per (role, phase, how), each losing that one role mid-phase, against an
undisturbed run of the same study (same seed) — recovered in the same launch?, seconds from the kill to the
recovery event, rollouts redone, and whether the final ledger and history equal the undisturbed run's.

    .venv/bin/python benchmarks/fault_recovery.py [--only policy_server,evaluator] [--out runs/faults]

Runs on a local Ray cluster (a few minutes per row on 2 cores). The Retriever rows use the search_qa domain.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from actors.coordinator import Coordinator  # noqa: E402
from tests.fault_injection import Fault, Injector  # noqa: E402
from tests.helpers import small_config  # noqa: E402
from tests.run_truth import guessing_math_harness  # noqa: E402
from whale_ray.domain import get_domain  # noqa: E402
from whale_ray.events import read_events  # noqa: E402
from whale_ray.policy.tiny import build_embedded_policy  # noqa: E402
from whale_ray.storage import default_cache_dir  # noqa: E402

RECOVERY = {"policy_server": "actor_restarted", "trainer": "actor_restarted", "train_worker": "trainer_workers_restarted",
            "evaluator": "evaluators_added", "retriever": None}
ROWS = [(t, ph, how) for t in ("policy_server", "evaluator", "trainer", "train_worker", "retriever")
        for ph in ("weight", "harness") for how in ("sigkill", "ray_kill")
        if not (t == "train_worker" and (ph == "harness" or how == "ray_kill"))]  # workers exist in weight phases only


def config(root: Path, domain: str):
    extra = {}
    if domain == "math_reasoning":
        harness = root / "guess.py"
        harness.write_text(guessing_math_harness(get_domain(domain).h0_path.read_text()))
        extra["harness"] = str(harness)
    return lambda name: small_config(root / name, condition="whale", domain=domain, sandbox__evaluators=2,
                                     faults__poll_s=0.3, cycles=1, **extra)


def one_run(cfg, model: str, faults: list[Fault]) -> tuple[dict, list[Fault], float]:
    coordinator = Coordinator(cfg, model)
    fired: list[Fault] = []
    t0 = time.perf_counter()
    with Injector(coordinator, cfg.run_dir, faults, on_fire=fired.append) as injector:
        coordinator.run()
    if injector.errors:
        raise injector.errors[0]
    return json.loads((cfg.run_dir / "state.json").read_text()), fired, time.perf_counter() - t0


def strip(state: dict) -> tuple:
    ledger = {k: v for k, v in state["ledger"].items() if k != "proposer_wall_s"}
    return ledger, [{k: v for k, v in r.items() if k != "wall_s"} for r in state["history"]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="comma-separated roles")
    ap.add_argument("--out", type=Path, default=Path("runs/faults"))
    args = ap.parse_args()
    only = set(args.only.split(",")) if args.only else None
    rows = [r for r in ROWS if only is None or r[0] in only]
    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    console, results = Console(width=150), []
    references: dict[str, tuple] = {}
    for target, phase, how in rows:
        domain = "search_qa" if target == "retriever" else "math_reasoning"
        model = str(build_embedded_policy(get_domain(domain), cache_dir=default_cache_dir(), progress=False,
                                          warmstart_steps=60, seed=0))  # the tests' small policy: minutes, not tens
        make = config(args.out, domain)
        if domain not in references:
            state, _, wall = one_run(make(f"reference-{domain}"), model, [])
            references[domain] = strip(state)
            console.print(f"reference run ({domain}): {wall:.0f} s")
        cfg = make(f"{target}-{phase}-{how}")
        try:
            state, fired, wall = one_run(cfg, model, [Fault(target, how, phase, cycle=0, after_units=1)])
            recovered = state["finished"] and len(fired) == 1
        except Exception as e:  # the table says so; the next row goes on
            console.print(f"[red]{target} {phase} {how}: {type(e).__name__}: {e}")
            results.append((target, phase, how, "no", "-", "-", "-", "-"))
            continue
        events = read_events(cfg.run_dir)
        kill_t = fired[0].fired_at if fired else None
        want = RECOVERY[target]
        back = [e for e in events if want is None or e["kind"] in (want, "recovered")]
        seconds = "-"
        if kill_t is not None and back:
            seconds = f"{back[0]['ts'] - kill_t:.1f}"
        redone = sum(e.get("episodes", 0) for e in events if e["kind"] == "episodes_redone")
        rolled = sum(e["kind"] == "rolled_back" for e in events)
        ledger, history = strip(state)
        ref_ledger, ref_history = references[domain]
        results.append((target, phase, how, "yes" if recovered else "no", seconds, str(redone) + (" + roll-back" * rolled),
                        "yes" if ledger == ref_ledger else "no", "yes" if history == ref_history else "no"))
        console.print(results[-1], f"{wall:.0f} s")
    table = Table(title="actor kills mid-phase (one small WHALE cycle each, same seed as the undisturbed run)")
    for h in ("role", "phase", "kill", "recovered", "s to recovery", "rollouts redone", "ledger equal", "history equal"):
        table.add_column(h)
    for r in results:
        table.add_row(*r)
    console.print(table)
    (args.out / "table.json").write_text(json.dumps(results, indent=1))
    ray.shutdown()


if __name__ == "__main__":
    main()
