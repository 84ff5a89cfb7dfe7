"""The schedule sweep as a full grid and with ASHA, side by side in one run: the paper's five (E, I) points plus
three more, on the embedded default math world with small budgets (a 2-core machine finishes in ~20 minutes).

    .venv/bin/python -m benchmarks.sweep_asha --root runs/bench-sweep [--model DIR] [--cycles 2] [--seed-harness h0]

The seed harness is the coin-flip math harness of tests/run_truth.py by default (about half its episodes
succeed, which ones depends on the weights): under the domain's h0 the small embedded policy scores 0 on D_val
at every point of this grid (measured), and a sweep of ties gives ASHA nothing to rank. --seed-harness h0 runs
it on h0 all the same.

Prints, for each of the two sweeps: the training rollouts spent in all (weight + harness; val/test reporting
excluded), the wall time, the best point by val (selection reads val only) and its test mean@k (reported), and
whether both pick the same point; then both sweep tables. Rollouts ASHA saved = grid's - ASHA's.
"""

from __future__ import annotations

import argparse
import copy
import time
from pathlib import Path

from whale_ray.sweep.space import parse_sweep

PAPER_POINTS = [(0.2, 2), (0.2, 6), (0.6, 2), (0.6, 6), (1.0, 10)]  # the paper's schedule ablation
MORE_POINTS = [(0.4, 4), (1.0, 2), (0.2, 10)]
# Small budgets: every phase does real work, each run is a minute or two on a loaded 2-core machine.
BASE = {"domain": "math_reasoning", "condition": "whale",
        "data": {"n_weight": 16, "n_harness": 4, "n_val": 8, "n_test": 8},
        "weight": {"samples_per_prompt": 2, "prompts_per_step": 4},
        "harness_phase": {"candidates_per_iteration": 2},
        "eval": {"test_samples": 4, "val_samples": 2}, "sandbox": {"slots": 8, "wall_s": 20}}


def sweeps(cycles: int, model: str | None, grace: int, reduction: float, harness: Path | None) -> tuple[dict, dict]:
    base = copy.deepcopy(BASE)
    base["cycles"] = cycles
    if harness is not None:
        base["harness"] = str(harness)
    if model:
        base["policy"] = {"model": model}
    grid = {"base": base, "points": [list(p) for p in PAPER_POINTS + MORE_POINTS], "metric": "best_val"}
    asha = {**copy.deepcopy(grid), "scheduler": {"kind": "asha", "max_rollouts": 100_000, "grace_rollouts": grace,
                                                 "reduction_factor": reduction}}
    return grid, asha


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path("runs/bench-sweep"))
    parser.add_argument("--model", help="a Hugging Face checkpoint directory (default: the embedded tiny policy)")
    parser.add_argument("--cycles", type=int, default=2)
    parser.add_argument("--grace", type=int, default=60, help="ASHA's grace period, in training rollouts")
    parser.add_argument("--reduction", type=float, default=2.0)
    parser.add_argument("--seed-harness", choices=["coin", "h0"], default="coin")
    args = parser.parse_args()

    from whale_ray import cli
    from whale_ray.sweep import run_sweep
    from whale_ray.sweep.command import check_trials, print_rows

    harness = None
    if args.seed_harness == "coin":
        from tests.run_truth import guessing_math_harness
        from whale_ray.domain import get_domain

        harness = args.root.resolve() / "coin_h0.py"
        harness.parent.mkdir(parents=True, exist_ok=True)
        harness.write_text(guessing_math_harness(get_domain("math_reasoning").h0_path.read_text()))
    grid_tree, asha_tree = sweeps(args.cycles, args.model, args.grace, args.reduction, harness)
    grid, asha = parse_sweep(grid_tree, "grid"), parse_sweep(asha_tree, "asha")
    model = check_trials(grid, args.root / "grid", "index")
    cli.start_ray(None)
    results = {}
    for name, sweep in (("grid", grid), ("asha", asha)):
        started = time.perf_counter()
        rows = run_sweep(sweep, args.root / name, model)
        results[name] = (rows, time.perf_counter() - started)

    print("\n| sweep | trials | stopped early | training rollouts | wall s | best by val | its best val | "
          "its test mean |")
    print("|---|---|---|---|---|---|---|---|")
    best = {}
    for name, (rows, wall) in results.items():
        top = rows[0]
        best[name] = (top.values.get("E"), top.values.get("I"))
        print(f"| {name} | {len(rows)} | {sum(r.stopped_early for r in rows)} | "
              f"{sum(r.training_rollouts for r in rows)} | {wall:.0f} | E {best[name][0]:g}, I {best[name][1]} | "
              f"{top.best_val:.3f} | {top.test_mean:.3f} (k={top.test_samples}) |")
    g, a = (sum(r.training_rollouts for r in results[n][0]) for n in ("grid", "asha"))
    print(f"\nrollouts ASHA saved: {g - a} of {g} ({(g - a) / g:.0%}); ASHA/grid wall time "
          f"{results['asha'][1] / results['grid'][1]:.2f}; same best point by val: {best['grid'] == best['asha']}")
    for name, (rows, _) in results.items():
        print_rows(cli.console, rows, f"{name} sweep, best first by best val")


if __name__ == "__main__":
    main()
