"""The five conditions as data: which phases run in which cycle, and when an adaptive phase stops."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from whale_ray.config import AdaptiveConfig, WhaleConfig


@dataclass(frozen=True)
class Phase:
    kind: Literal["weight", "harness"]
    budget: float  # weight: epochs of D_weight (the adaptive maximum when adaptive); harness: iterations
    adaptive: bool = False

    def label(self) -> str:
        unit = "ep" if self.kind == "weight" else "it"
        return f"{self.kind}({'adaptive ' if self.adaptive else ''}{self.budget:g}{unit})"


def plan(cfg: WhaleConfig) -> list[list[Phase]]:
    """The run's cycles, each a list of phases. Every condition gets the same per-cycle budget (E, I)."""
    weight, harness = Phase("weight", cfg.E), Phase("harness", cfg.I)
    n = cfg.cycles
    if cfg.condition == "rsft_only":
        return [[weight] for _ in range(n)]
    if cfg.condition == "mh_only":
        return [[harness] for _ in range(n)]
    if cfg.condition == "whale":
        return [[weight, harness] for _ in range(n)]
    if cfg.condition == "adaptive_whale":
        a = cfg.adaptive
        return [[Phase("weight", a.weight_max_epochs, True), Phase("harness", a.harness_max_iterations, True)]
                for _ in range(n)]
    if cfg.condition == "stagewise":
        # All weight training first, then all harness search, on the same total budget as whale.
        return [[weight] for _ in range(n)] + [[harness] for _ in range(n)]
    raise ValueError(f"unknown condition {cfg.condition!r}")


def has_phase(cfg: WhaleConfig, kind: str) -> bool:
    """Whether the run's schedule holds a phase of `kind` ("weight": the run needs a Trainer)."""
    return any(phase.kind == kind for phases in plan(cfg) for phase in phases)


def weight_phase_should_stop(epochs_done: float, step_rewards: list[float], rules: AdaptiveConfig) -> bool:
    """Adaptive weight phase: after the minimum, stop once the sliding-window mean training reward
    has not improved on the best earlier window for a whole window of steps. Training signal only."""
    if epochs_done < rules.weight_min_epochs:
        return False
    w = rules.weight_window
    if len(step_rewards) < 2 * w:
        return False
    windows = [sum(step_rewards[i - w:i]) / w for i in range(w, len(step_rewards) + 1)]
    best_before = max(windows[:-w]) if len(windows) > w else windows[0]
    return max(windows[-w:]) <= best_before


def harness_phase_should_stop(iterations_done: int, best_success: list[float], rules: AdaptiveConfig) -> bool:
    """Adaptive harness phase: at least the minimum, at most the maximum; in between stop when the
    accepted harness' D_harness success rate has not improved for `patience` iterations."""
    if iterations_done >= rules.harness_max_iterations:
        return True
    if iterations_done < rules.harness_min_iterations:
        return False
    p = rules.harness_patience
    if len(best_success) <= p:
        return False
    return max(best_success[-p:]) <= max(best_success[:-p])
