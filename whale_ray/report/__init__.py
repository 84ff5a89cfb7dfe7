"""A run's report, written into <run_dir>/report/ at the end of every `whale run` and by `whale report`:

    summary.md    the cycle table, the D_test metrics and the ledgers as markdown
    curves.png    the curves per cycle
    index.html    one self-contained page: all of the above, the accepted harness chain with its diffs and
                  hypotheses, the frontier scatter and the resolved config (run_page.py)
"""

from __future__ import annotations

from pathlib import Path

from whale_ray.report.tables import (
    Grid,
    cycle_line,
    cycle_table,
    ledger_lines,
    markdown_table,
    mean_at,
    metrics_table,
    proposer_ledger_lines,
)
from whale_ray.run_state import NotARun, RunState, open_run
from whale_ray.storage import atomic_write_text

__all__ = ["Grid", "NotARun", "cycle_line", "cycle_table", "ledger_lines", "markdown_table", "mean_at",
           "metrics_table", "open_run", "proposer_ledger_lines", "write_report"]




def write_report(run_dir: Path, state: RunState | None = None) -> Path:
    """report/summary.md, report/curves.png and report/index.html; returns the report folder."""
    from whale_ray.report import plots
    from whale_ray.report.run_page import render_run_page

    state = state if state is not None else open_run(run_dir)
    out = Path(run_dir) / "report"
    out.mkdir(parents=True, exist_ok=True)
    metrics = metrics_table(state.history)
    text = "\n".join(["# WHALE run summary", "", markdown_table(state.history), "",
                      *([f"D_test beyond {mean_at(state.history)} (θ*, h*):", "", metrics, ""] if metrics else []),
                      *(f"- {line}" for line in ledger_lines(state)), ""])
    atomic_write_text(out / "summary.md", text)
    if state.history:
        (out / "curves.png").write_bytes(plots.run_curves(state.history))
    atomic_write_text(out / "index.html", render_run_page(Path(run_dir), state))
    return out
