"""`whale sweep FILE` and `whale study` share this flow: check every trial's inputs, build the policy once, start
(or join) Ray, run the Tuner, print the table. The argparse side lives in whale_ray/cli.py, the
steps before a run in whale_ray/launch.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from whale_ray.sweep.output import COLUMNS, TrialRow, pareto, table_rows
from whale_ray.sweep.space import SweepConfig, edge_configs


def check_trials(sweep: SweepConfig, root: Path, naming: str) -> str:
    """Every config the sweep can reach at its edges passes `whale run`'s input checks (data, harness files,
    model, proposer); with fixed names (a study), a run directory holding another config is an error too.
    Returns the base model (the embedded policy is built here, once, before Ray starts)."""
    from whale_ray import launch
    from whale_ray.sweep import check_root

    check_root(sweep, root)
    configs = edge_configs(sweep)
    for cfg in configs:
        cfg.run_dir = Path(root).resolve() / "unsampled"  # a sweep's run directories are named by Tune's trial ids
        launch.check_inputs(cfg)
    if naming == "study":
        from whale_ray.sweep.trial import trial_config
        from whale_ray.sweep.tuner import param_space

        for point in sweep.point_overrides():
            params = {**param_space(sweep, Path(root).resolve(), "", naming), "point": point}
            launch.check_inputs(trial_config(params))
    return launch.base_model(configs[0])


def run_command(sweep: SweepConfig, root: Path, ray_address: str | None, naming: str, title: str) -> int:
    from whale_ray import launch
    from whale_ray.sweep import run_sweep

    model = check_trials(sweep, root, naming)
    launch.start_ray(ray_address)
    import ray

    try:
        rows = run_sweep(sweep, root, model, naming)
    finally:
        ray.shutdown()
    print_rows(launch.console, rows, title)
    launch.console.print(f"sweep root: {Path(root).resolve()}  (sweep.md, sweep.csv, sweep.png, pareto.csv, best.yaml)")
    return 1 if any(r.error for r in rows) else 0


def print_rows(console: Any, rows: list[TrialRow], title: str) -> None:
    from rich.table import Table

    table = Table(title=title)
    for header in COLUMNS:
        table.add_column(header)
    for cells in table_rows(rows):
        table.add_row(*cells)
    console.print(table)
    front = pareto(rows)
    console.print("Pareto set (training rollouts, test mean): " + (", ".join(
        f"{r.name} ({r.training_rollouts}, {r.test_mean:.3f})" for r in front) or "none"), highlight=False)
    for r in rows:
        console.print(f"  {r.name}: {r.run_dir}", highlight=False)
