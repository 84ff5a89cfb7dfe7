"""compare.png, chain.png and index.html of a `whale compare`: the study's page, beside its markdown and CSV."""

from __future__ import annotations

import os
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from whale_ray.report import plots
from whale_ray.report.html import render
from whale_ray.storage import atomic_write_text

if TYPE_CHECKING:
    from whale_ray.compare import Comparison


def curves(c: "Comparison") -> dict[str, dict[str, Any]]:
    """Per condition and cycle: mean training rollouts spent, and val and test of (θ*, h*) as mean and std over
    seeds. Seeds are aligned by cycle (they share the budget); a condition's curve stops at its shortest run."""
    from whale_ray.compare import mean_std

    out = {}
    for row in c.rows:
        n = min(len(r.rows) for r in row.runs)
        cum = [r.cumulative_rollouts() for r in row.runs]
        val = [mean_std([r.rows[i].best_val for r in row.runs]) for i in range(n)]
        test = [mean_std([r.rows[i].test_mean8 for r in row.runs]) for i in range(n)]
        out[row.condition] = {"rollouts": [sum(x[i] for x in cum) / len(cum) for i in range(n)],
                              "val": [m for m, _ in val], "val_std": [s for _, s in val],
                              "test": [m for m, _ in test], "test_std": [s for _, s in test], "n": row.n}
    return out


def write_study_page(c: "Comparison", out: Path) -> None:
    from whale_ray.compare import caption, mean_k, metrics_table, runs_table, table

    compare_png = plots.compare_curves(curves(c), mean_k(c))
    chain_png = plots.chain_plot({row.condition: [(f"seed {r.cfg.seed}", r.rows) for r in row.runs] for row in c.rows})
    (out / "compare.png").write_bytes(compare_png)
    (out / "chain.png").write_bytes(chain_png)
    links = []  # each run's own page, where its report has been written
    for r in c.runs:
        page = r.path / "report" / "index.html"
        links.append((r.condition, r.cfg.seed, r.path.name,
                      os.path.relpath(page, out) if page.is_file() else None))
    atomic_write_text(out / "index.html", render(
        "study.html", title=f"whale compare: {c.domain}", table=table(c), caption=caption(c), runs=runs_table(c),
        metrics=metrics_table(c), k=mean_k(c),
        compare_png=compare_png, chain_png=chain_png, links=links,
        generated=datetime.now(timezone.utc).isoformat(timespec="seconds")))
