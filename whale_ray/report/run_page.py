"""report/index.html of one run: everything in its run directory worth looking at, on one page."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from whale_ray import selection
from whale_ray.archive import Archive, ArchiveError, Candidate
from whale_ray.report import plots
from whale_ray.report.html import highlight_diff, render
from whale_ray.report.tables import Grid, cycle_grid, ledger_lines, mean_at, metrics_grid
from whale_ray.run_state import RunState


@dataclass
class ChainLink:
    """One harness the run accepted: when, what it changed (against its parent) and why."""

    cand: Candidate
    first_cycle: int
    change_of: str  # the candidate whose diff is shown (a re-evaluation shows the change it re-scores)
    diff_html: str


def accepted_ids(state: RunState) -> list[tuple[str, int]]:
    """The accepted harnesses in the order they were first accepted, with that cycle."""
    seen: dict[str, int] = {}
    for row in state.history:
        seen.setdefault(row.accepted_harness, row.cycle)
    return list(seen.items())


def _origin(archive: Archive, cand: Candidate) -> Candidate:
    """A re-evaluation copies its parent's code: the candidate that made the change is up its parent chain."""
    while cand.parent and not cand.path.joinpath("diff.patch").read_text().strip() and cand.parent in archive:
        parent = archive.get(cand.parent)
        if parent.code != cand.code:
            break
        cand = parent
    return cand


def harness_chain(archive: Archive | None, state: RunState) -> list[ChainLink]:
    links = []
    for hid, cycle in accepted_ids(state):
        if archive is None or hid not in archive:
            continue
        cand = archive.get(hid)
        origin = _origin(archive, cand)
        patch = (origin.path / "diff.patch").read_text() if origin.path else ""
        links.append(ChainLink(cand, cycle, origin.id, highlight_diff(patch)))
    return links


def ledger_grid(state: RunState) -> Grid:
    led = state.ledger
    fields = {**led.model_dump(), "training_rollouts": led.training_rollouts, "proposer_tokens": led.proposer_tokens}
    return Grid(["entry", "value"], [[k.replace("_", " "), str(v)] for k, v in fields.items()], left={0})


def render_run_page(run_dir: Path, state: RunState) -> str:
    run_dir = Path(run_dir)
    try:
        archive = Archive(run_dir / "archive", read_only=True) if (run_dir / "archive").is_dir() else None
        evaluated = archive.candidates(status="evaluated") if archive else []
    except ArchiveError as e:
        archive, evaluated, archive_error = None, [], str(e)
    else:
        archive_error = None
    chain = harness_chain(archive, state)
    config = run_dir / "config.yaml"
    rows = state.history
    return render(
        "run.html", title=f"WHALE run {run_dir.name}", run_dir=str(run_dir.resolve()), state=state, k=mean_at(rows),
        cycles=cycle_grid(rows), metrics=metrics_grid(rows), chain=chain, archive_error=archive_error,
        curves=plots.run_curves(rows) if rows else None,
        frontier=plots.frontier_scatter(evaluated, {c.id for c in selection.frontier(evaluated)},
                                        {link.cand.id for link in chain}) if evaluated else None,
        n_evaluated=len(evaluated), ledger=ledger_lines(state), ledger_grid=ledger_grid(state),
        config_text=config.read_text() if config.is_file() else None,
        generated=datetime.now(timezone.utc).isoformat(timespec="seconds"))
