"""compare.png, chain.png and index.html of a `whale compare`: the study's page, beside its markdown and CSV.

It renders what whale_ray/compare.py computed (tables as Grids, curves and chains as plain data), so the
comparison's numbers are made in one place."""

from __future__ import annotations

import os
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from whale_ray.report import plots
from whale_ray.report.html import render
from whale_ray.report.tables import Grid
from whale_ray.run_state import CycleRow
from whale_ray.storage import atomic_write_text


def write_study_page(out: Path, *, domain: str, k: str, table: Grid, caption: list[str], metrics: Grid | None,
                     runs: Grid, curves: dict[str, dict[str, Any]], chains: dict[str, list[tuple[str, list[CycleRow]]]],
                     run_dirs: list[tuple[str, int, Path]]) -> None:
    """`curves`: per condition, plots.compare_curves' data; `chains`: per condition, (label, rows) per seed;
    `run_dirs`: (condition, seed, run directory) of every run, linked to its own report page where it has one."""
    compare_png = plots.compare_curves(curves, k)
    chain_png = plots.chain_plot(chains)
    (out / "compare.png").write_bytes(compare_png)
    (out / "chain.png").write_bytes(chain_png)
    links = []
    for condition, seed, run_dir in run_dirs:
        page = run_dir / "report" / "index.html"
        links.append((condition, seed, run_dir.name, os.path.relpath(page, out) if page.is_file() else None))
    atomic_write_text(out / "index.html", render(
        "study.html", title=f"whale compare: {domain}", table=table, caption=caption, runs=runs, metrics=metrics,
        k=k, compare_png=compare_png, chain_png=chain_png, links=links,
        generated=datetime.now(timezone.utc).isoformat(timespec="seconds")))
