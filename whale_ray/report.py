"""The run's summary: a table per cycle, the two ledgers, and a plot of the curves."""

from __future__ import annotations

from pathlib import Path

from rich.table import Table

from whale_ray.run_state import CycleRow, RunState
from whale_ray.storage import atomic_write_text

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


def metrics_table(rows: list[CycleRow]) -> str:
    """D_test of (θ*, h*) beyond mean@k, one row per cycle: truncation rate, domain metrics, per-group means."""
    keys = sorted({k for r in rows for k in r.test_metrics}, key=lambda k: (k.startswith("group:"), k))
    if not keys:
        return ""
    lines = [f"| cycle | test {mean_at(rows)} | " + " | ".join(k.replace("_", " ") for k in keys) + " |",
             "|" + "---|" * (len(keys) + 2)]
    lines += [f"| {r.cycle} | {_cell(r.test_mean8)} | " + " | ".join(_cell(r.test_metrics.get(k)) for k in keys) + " |"
              for r in rows]
    return "\n".join(lines)


def cycle_table(rows: list[CycleRow], title: str = "WHALE run") -> Table:
    table = Table(title=title)
    for header in _headers(rows):
        table.add_column(header, justify="right" if header not in ("phases", "accepted h", "best (θ*,h*)") else "left")
    for row in rows:
        table.add_row(*(_cell(getattr(row, key), key) for key, _ in COLUMNS))
    return table


def markdown_table(rows: list[CycleRow]) -> str:
    lines = ["| " + " | ".join(_headers(rows)) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_cell(getattr(r, k), k) for k, _ in COLUMNS) + " |" for r in rows]
    return "\n".join(lines)


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


def write_report(run_dir: Path, state: RunState) -> Path:
    """report/summary.md and report/curves.png; returns the report folder."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(run_dir) / "report"
    out.mkdir(parents=True, exist_ok=True)
    metrics = metrics_table(state.history)
    text = "\n".join(["# WHALE run summary", "", markdown_table(state.history), "",
                      *([f"D_test beyond {mean_at(state.history)} (θ*, h*):", "", metrics, ""] if metrics else []),
                      *(f"- {line}" for line in ledger_lines(state)), ""])
    atomic_write_text(out / "summary.md", text)

    if state.history:
        cycles = [r.cycle for r in state.history]
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(cycles, [r.test_mean8 for r in state.history], marker="o", label=f"test {mean_at(state.history)} (θ*, h*)")
        ax.plot(cycles, [r.val for r in state.history], marker="s", label="val (current θ, h)")
        train = [(r.cycle, r.train_reward) for r in state.history if r.train_reward is not None]
        if train:
            ax.plot(*zip(*train), marker="^", label="training reward")
        succ = [(r.cycle, r.harness_success) for r in state.history if r.harness_success is not None]
        if succ:
            ax.plot(*zip(*succ), marker="x", label="accepted h on D_harness")
        ax.set_xticks(cycles)
        ax.set_xlabel("cycle (0 = start)")
        ax.set_ylabel("success")
        ax.set_ylim(0, 1)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / "curves.png", dpi=120)
        plt.close(fig)
    return out
