"""The run's summary as text: a table per cycle, the D_test metrics, the two ledgers (terminal and markdown)."""

from __future__ import annotations

from dataclasses import dataclass, field

from rich.table import Table

from whale_ray.run_state import CycleRow, RunState

COLUMNS = (
    ("cycle", "cycle"), ("phases", "phases"), ("weight_rollouts", "weight rollouts"),
    ("harness_rollouts", "harness rollouts"), ("train_reward", "train reward"),
    ("accepted_harness", "accepted h"), ("harness_success", "h success"), ("weight_version", "θ ver"),
    ("val", "val"), ("best", "best (θ*,h*)"), ("test_mean8", "test mean@k"), ("wall_s", "wall s"),
)


def mean_at(rows: list[CycleRow]) -> str:
    """"mean@k" with the run's k (eval.test_samples), as recorded in its rows."""
    return f"mean@{rows[-1].test_samples if rows else 8}"


def _headers(rows: list[CycleRow]) -> list[str]:
    return [h.replace("mean@k", mean_at(rows)) for _, h in COLUMNS]


def _cell(value: object, key: str = "") -> str:
    if value is None:
        return "-"
    if key == "wall_s":
        return f"{value:.1f}"
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


def cycle_line(row: CycleRow) -> str:
    """One cycle as one line, printed as soon as the cycle ends."""
    return (f"cycle {row.cycle} | {row.phases} | rollouts weight {row.weight_rollouts}, harness {row.harness_rollouts} "
            f"| train reward {_cell(row.train_reward)} | accepted {row.accepted_harness} "
            f"(D_harness {_cell(row.harness_success)}) | θ v{row.weight_version} | val {_cell(row.val)} "
            f"| best {row.best} | test {mean_at([row])} {_cell(row.test_mean8)}{_metrics_text(row)} | {row.wall_s:.0f} s")


def _metrics_text(row: CycleRow) -> str:
    shown = {k: v for k, v in row.test_metrics.items() if not k.startswith("group:")}
    return "".join(f", {k.replace('_', ' ')} {v:.3f}" for k, v in shown.items())


@dataclass
class Grid:
    """A table as text cells, for markdown and the HTML pages; columns in `left` are left-aligned."""

    headers: list[str]
    rows: list[list[str]]
    left: set[int] = field(default_factory=set)

    def markdown(self) -> str:
        lines = ["| " + " | ".join(self.headers) + " |", "|" + "---|" * len(self.headers)]
        return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in self.rows])

    def rich(self, title: str) -> Table:
        from rich.markup import escape  # "[paper]" is a header, not markup

        table = Table(title=escape(title))
        for i, header in enumerate(self.headers):
            table.add_column(escape(header), justify="left" if i in self.left else "right")
        for row in self.rows:
            table.add_row(*map(escape, row))
        return table


def metrics_grid(rows: list[CycleRow]) -> Grid | None:
    """D_test of (θ*, h*) beyond mean@k, one row per cycle: truncation rate, domain metrics, per-group means."""
    keys = sorted({k for r in rows for k in r.test_metrics}, key=lambda k: (k.startswith("group:"), k))
    if not keys:
        return None
    return Grid(["cycle", f"test {mean_at(rows)}", *(k.replace("_", " ") for k in keys)],
                [[str(r.cycle), _cell(r.test_mean8), *(_cell(r.test_metrics.get(k)) for k in keys)] for r in rows])


def metrics_table(rows: list[CycleRow]) -> str:
    grid = metrics_grid(rows)
    return grid.markdown() if grid else ""


def cycle_table(rows: list[CycleRow], title: str = "WHALE run") -> Table:
    table = Table(title=title)
    for header in _headers(rows):
        table.add_column(header, justify="right" if header not in ("phases", "accepted h", "best (θ*,h*)") else "left")
    for row in rows:
        table.add_row(*(_cell(getattr(row, key), key) for key, _ in COLUMNS))
    return table


def cycle_grid(rows: list[CycleRow]) -> Grid:
    return Grid(_headers(rows), [[_cell(getattr(r, k), k) for k, _ in COLUMNS] for r in rows],
                left={i for i, (k, _) in enumerate(COLUMNS) if k in ("phases", "accepted_harness", "best")})


def markdown_table(rows: list[CycleRow]) -> str:
    return cycle_grid(rows).markdown()


def ledger_lines(state: RunState) -> list[str]:
    """What the run spent, by ledger, and how fast each phase turned rollouts over."""
    led, walls = state.ledger, state.phase_wall_s
    spent = {"weight": led.weight_rollouts, "harness": led.harness_rollouts}
    speed = ", ".join(f"{kind} {walls[kind]:.1f} s ({spent[kind] / walls[kind]:.1f} rollouts/s)"
                      for kind in sorted(walls) if walls[kind] > 0) or "-"
    return [
        f"rollouts: weight phase {led.weight_rollouts}, harness evaluation {led.harness_rollouts} "
        f"(training total {led.training_rollouts}); val/test reporting {led.eval_rollouts}",
        f"weight steps {led.weight_steps}; harness iterations {led.harness_iterations}; "
        f"candidates proposed {led.candidates_proposed}, invalid {led.candidates_invalid}"
        + (f" ({led.candidates_leaked} as D_test leakage)" if led.candidates_leaked else ""),
        *proposer_ledger_lines(state),
        f"wall time by phase: {speed}",
        f"best (θ*, h*): {state.best.model_dump() if state.best else '-'}",
    ]


def proposer_ledger_lines(state: RunState) -> list[str]:
    """The proposer's own ledger (tokens, cost, wall time), kept apart from the rollout ledger."""
    led = state.ledger
    usage = (f"{led.proposer_calls} model calls, tokens prompt {led.proposer_prompt_tokens} (cached "
             f"{led.proposer_cached_tokens}) + completion {led.proposer_completion_tokens} = {led.proposer_tokens}, "
             f"cost ${led.proposer_cost_usd:.4f}, retries {led.proposer_retries}"
             if led.proposer_calls else "no model calls")  # the offline proposer spends no tokens
    lines = [f"proposer (separate ledger, not in rollouts): {led.proposer_sessions} sessions, {usage}, "
             f"wall {led.proposer_wall_s:.1f} s"]
    if led.proposer_stop:
        lines.append(f"harness search stopped by the proposer budget: {led.proposer_stop}")
    return lines
