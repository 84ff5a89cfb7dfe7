"""The report's figures (matplotlib, headless), each returned as PNG bytes so a page can inline it."""

from __future__ import annotations

import io
from typing import TYPE_CHECKING, Any

from whale_ray.report.tables import mean_at
from whale_ray.run_state import CycleRow

if TYPE_CHECKING:
    from whale_ray.archive import Candidate


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # no display: reports are written by drivers, jobs and CI
    import matplotlib.pyplot as plt

    return plt


def png(fig: Any) -> bytes:
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=120)
    _pyplot().close(fig)
    return buf.getvalue()


def run_curves(rows: list[CycleRow]) -> bytes:
    """Test of (θ*, h*), val of the current pair, training reward and the accepted harness's D_harness success, per cycle."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    cycles = [r.cycle for r in rows]
    ax.plot(cycles, [r.test_mean8 for r in rows], marker="o", label=f"test {mean_at(rows)} (θ*, h*)")
    ax.plot(cycles, [r.val for r in rows], marker="s", label="val (current θ, h)")
    train = [(r.cycle, r.train_reward) for r in rows if r.train_reward is not None]
    if train:
        ax.plot(*zip(*train), marker="^", label="training reward")
    succ = [(r.cycle, r.harness_success) for r in rows if r.harness_success is not None]
    if succ:
        ax.plot(*zip(*succ), marker="x", label="accepted h on D_harness")
    ax.set_xticks(cycles)
    ax.set(xlabel="cycle (0 = start)", ylabel="success", ylim=(0, 1))
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return png(fig)


def frontier_scatter(evaluated: list["Candidate"], frontier_ids: set[str], accepted_ids: set[str]) -> bytes:
    """Every evaluated candidate as success against mean turns, coloured by the weights it was scored under;
    the archive-wide Pareto frontier circled, accepted harnesses labelled."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.8))
    versions = sorted({c.weight_version or 0 for c in evaluated})
    cmap = plt.get_cmap("viridis", max(len(versions), 2))
    for i, v in enumerate(versions):
        group = [c for c in evaluated if (c.weight_version or 0) == v]
        ax.scatter([c.mean_turns for c in group], [c.success_rate for c in group], color=cmap(i), s=22,
                   label=f"scored under θ v{v}", alpha=0.85)
    front = [c for c in evaluated if c.id in frontier_ids]
    ax.scatter([c.mean_turns for c in front], [c.success_rate for c in front], facecolors="none",
               edgecolors="crimson", s=110, linewidths=1.4, label="archive-wide frontier")
    for c in evaluated:
        if c.id in accepted_ids:
            ax.annotate(c.id, (c.mean_turns, c.success_rate), fontsize=7, xytext=(4, 4), textcoords="offset points")
    ax.set(xlabel="mean turns (fewer is better)", ylabel="success rate on D_harness", ylim=(-0.03, 1.03))
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return png(fig)


def _band(ax: Any, xs: list[float], means: list[float], stds: list[float | None], label: str, color: Any) -> None:
    ax.plot(xs, means, marker="o", label=label, color=color)
    if all(s is not None for s in stds):
        ax.fill_between(xs, [m - s for m, s in zip(means, stds)], [m + s for m, s in zip(means, stds)],
                        color=color, alpha=0.2, linewidth=0)


def compare_curves(curves: dict[str, dict[str, list]], k_label: str) -> bytes:
    """Val and test of (θ*, h*) against training rollouts, a line per condition with a ± one standard
    deviation band over seeds. `curves[condition]` holds rollouts, val, val_std, test, test_std, n per cycle."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    colors = plt.get_cmap("tab10")
    for ax, (key, title) in zip(axes, (("val", "val of (θ*, h*)"), ("test", f"test {k_label} of (θ*, h*)"))):
        for i, (condition, c) in enumerate(curves.items()):
            _band(ax, c["rollouts"], c[key], c[f"{key}_std"], f"{condition} (n={c['n']})", colors(i))
        ax.set(title=title, xlabel="training rollouts (weight + harness), mean over seeds", ylim=(0, 1))
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("success (band: ± 1 std over seeds)")
    axes[1].legend(fontsize=8)
    return png(fig)


def chain_plot(chains: dict[str, list[tuple[str, list[CycleRow]]]]) -> bytes:
    """Per condition, each seed's accepted harness over the cycles: its D_harness success (under the weights it
    was scored with), labelled with the harness id where the accepted harness changes."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(chains), figsize=(3.6 * len(chains), 3.2), sharey=True, squeeze=False)
    cycles = sorted({r.cycle for runs in chains.values() for _, rows in runs for r in rows}) or [0]
    for ax, (condition, runs) in zip(axes[0], chains.items()):
        ax.set(title=condition, xlabel="cycle", ylim=(-0.05, 1.1), xlim=(cycles[0] - 0.5, cycles[-1] + 0.5))
        ax.set_xticks(cycles)
        ax.grid(alpha=0.3)
        drawn = False
        for label, rows in runs:
            pts = [(r.cycle, r.harness_success, r.accepted_harness) for r in rows if r.harness_success is not None]
            if not pts:
                continue
            drawn = True
            line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", drawstyle="steps-post", label=label)
            previous = None
            for cycle, success, hid in pts:
                if hid != previous:
                    ax.annotate(hid, (cycle, success), fontsize=7, xytext=(2, 5), textcoords="offset points",
                                color=line.get_color())
                previous = hid
        if drawn:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "h0 throughout\n(no harness phase)", ha="center", va="center", transform=ax.transAxes)
    axes[0][0].set_ylabel("accepted h: D_harness success")
    return png(fig)
