"""A sweep file: which run settings a Ray Tune sweep varies, how they are sampled, and how trials are stopped.

    base: {domain: math_reasoning, condition: whale, cycles: 3}   # a run config every trial starts from
    points: [[0.2, 2], [0.6, 6]]          # a plain list of points: [E, I] pairs, or mappings of settings
    space:                                # settings sampled by Tune (dotted keys, as `whale run` overrides)
      E: {grid: [0.2, 0.6]}
      weight.learning_rate: {loguniform: [1.0e-4, 1.0e-3]}
      harness_phase.candidates_per_iteration: {choice: [2, 3]}
      cycles: {randint: [1, 4]}           # Tune's randint: the upper bound is excluded
    num_samples: 1                        # samples of the space (each grid point num_samples times)
    search: {kind: random, seed: 0}       # or a Tune searcher whose package is installed (optuna, hyperopt, ...)
    scheduler: {kind: asha, max_rollouts: 20000, grace_rollouts: 2000, reduction_factor: 3}   # or {kind: none}
    metric: best_val                      # a validation score: selection reads val, test is only reported
    max_concurrent_trials: auto           # as many trials as the cluster holds side by side, or a number

Every value the space can take at its edges (each grid and choice value, each range's bounds) is checked as a
run config before any trial starts, so a bad setting is one line naming its key, not a failed trial.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from whale_ray.config import ConfigError, WhaleConfig, dotted_keys, load_config, read_yaml_mapping

# What selection may read (CycleRow's validation fields); test_mean8 and the rest are only reported.
VAL_METRICS = ("best_val", "val")
# Tune searcher kind -> the package it needs (ray.tune.search.create_searcher's names)
SEARCHERS = {"random": None, "optuna": "optuna", "hyperopt": "hyperopt", "bayesopt": "bayes_opt", "ax": "ax",
             "nevergrad": "nevergrad", "zoopt": "zoopt", "hebo": "hebo", "bohb": "hpbandster"}
DISTRIBUTIONS = ("grid", "choice", "uniform", "loguniform", "randint")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Dist(_Strict):
    """One setting's values: exactly one of a grid (every value), a choice, or a range."""

    grid: Optional[list[Any]] = None
    choice: Optional[list[Any]] = None
    uniform: Optional[tuple[float, float]] = None
    loguniform: Optional[tuple[float, float]] = None
    randint: Optional[tuple[int, int]] = None

    @model_validator(mode="after")
    def _one_kind(self) -> "Dist":
        given = [k for k in DISTRIBUTIONS if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of {', '.join(DISTRIBUTIONS)} (got {', '.join(given) or 'none'})")
        kind = given[0]
        if kind in ("grid", "choice") and not getattr(self, kind):
            raise ValueError(f"{kind} is empty")
        if kind in ("uniform", "loguniform", "randint"):
            lo, hi = getattr(self, kind)
            if not lo < hi:
                raise ValueError(f"{kind} bounds [{lo:g}, {hi:g}]: the lower bound must be below the upper")
            if kind == "loguniform" and lo <= 0:
                raise ValueError(f"loguniform bounds [{lo:g}, {hi:g}]: both must be positive")
        return self

    @property
    def kind(self) -> str:
        return next(k for k in DISTRIBUTIONS if getattr(self, k) is not None)

    def edges(self) -> list[Any]:
        """The values to check as run settings: every listed value, or a range's bounds (randint's upper bound
        is excluded, so its largest value is hi - 1) and, for a continuous range, a value inside it (a range
        over an integer setting fails there, not in a trial)."""
        value = getattr(self, self.kind)
        if self.kind in ("grid", "choice"):
            return list(value)
        lo, hi = value
        if self.kind == "randint":
            return [lo, hi - 1]
        inside = math.sqrt(lo * hi) if self.kind == "loguniform" else lo + (hi - lo) * 9 / 14  # not a whole number
        return [lo, hi, inside]  # for whole-number bounds (lo + 9/14 of the way), so an int setting fails here

    def to_tune(self) -> Any:
        from ray import tune

        value = getattr(self, self.kind)
        if self.kind == "grid":
            return tune.grid_search(list(value))
        return tune.choice(list(value)) if self.kind == "choice" else getattr(tune, self.kind)(*value)


class SearchConfig(_Strict):
    kind: str = "random"
    seed: Optional[int] = 0  # the random generator's and the searcher's seed: a relaunch samples the same trials

    @field_validator("kind")
    @classmethod
    def _known(cls, v: str) -> str:
        if v not in SEARCHERS:
            raise ValueError(f"unknown search kind {v!r}; choose one of {', '.join(SEARCHERS)}")
        package = SEARCHERS[v]
        if package is not None and importlib.util.find_spec(package) is None:
            raise ValueError(f"search kind {v!r} needs the Python package {package!r}, which is not installed "
                             f"(pip install {package}), or use kind: random")
        return v


class SchedulerConfig(_Strict):
    """ASHA on the training rollouts spent (weight + harness), not cycles: schedules spend rollouts at very
    different rates, so a rung is a budget, not a count of cycles."""

    kind: Literal["none", "asha"] = "none"
    max_rollouts: Optional[int] = Field(None, gt=0)  # ASHA's max_t: a trial reaching it is stopped there
    grace_rollouts: Optional[int] = Field(None, gt=0)  # no trial is stopped before it has spent this many
    reduction_factor: float = Field(3.0, gt=1)

    @model_validator(mode="after")
    def _budgets(self) -> "SchedulerConfig":
        if self.kind == "asha":
            if self.max_rollouts is None or self.grace_rollouts is None:
                raise ValueError("kind asha needs max_rollouts and grace_rollouts (training rollouts)")
            if self.grace_rollouts > self.max_rollouts:
                raise ValueError(f"grace_rollouts {self.grace_rollouts} exceeds max_rollouts {self.max_rollouts}")
        return self


class SweepConfig(_Strict):
    base: dict[str, Any] = Field(default_factory=dict)  # a run config (nested, as a YAML config file)
    points: list[Union[tuple[float, int], dict[str, Any]]] = Field(default_factory=list)
    space: dict[str, Dist] = Field(default_factory=dict)
    num_samples: int = Field(1, gt=0)
    search: SearchConfig = Field(default_factory=SearchConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    metric: str = "best_val"
    max_concurrent_trials: Union[Literal["auto"], int] = "auto"

    @field_validator("metric")
    @classmethod
    def _val_only(cls, v: str) -> str:
        if v not in VAL_METRICS:
            raise ValueError(f"{v!r} is not a validation score (selection reads val only; test is only reported): "
                             f"use {' or '.join(VAL_METRICS)}")
        return v

    @field_validator("max_concurrent_trials")
    @classmethod
    def _positive(cls, v: Union[str, int]) -> Union[str, int]:
        if isinstance(v, int) and v <= 0:
            raise ValueError(f"must be 'auto' or a positive number, got {v}")
        return v

    @model_validator(mode="after")
    def _not_empty(self) -> "SweepConfig":
        if not self.points and not self.space:
            raise ValueError("space: empty: name the settings to sweep (space:) or a list of points (points:)")
        if self.search.kind != "random" and (self.points or any(d.kind == "grid" for d in self.space.values())):
            raise ValueError(f"search kind {self.search.kind!r} samples the space itself: grids and points need "
                             "search kind random")
        return self

    def point_overrides(self) -> list[dict[str, Any]]:
        """The points as dotted-key overrides ([E, I] pairs become {"E": .., "I": ..})."""
        return [dotted_keys(p) if isinstance(p, dict) else {"E": p[0], "I": p[1]} for p in self.points]


def load_sweep(path: Path) -> SweepConfig:
    """Reads and checks a sweep file; every error is one line naming the file and the key."""
    return parse_sweep(read_yaml_mapping(path, "sweep file"), origin=f"sweep file {path}")


def parse_sweep(tree: dict[str, Any], origin: str = "sweep") -> SweepConfig:
    try:
        sweep = SweepConfig.model_validate(tree)
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(p) for p in first["loc"] if not str(p).startswith(("function-", "tuple[")))
        msg = first["msg"].removeprefix("Value error, ")
        if first["type"] == "extra_forbidden":
            msg = f"not a sweep setting (got {first['input']!r})"
        raise ConfigError(f"{origin}: {loc + ': ' if loc else ''}{msg}") from None
    check_values(sweep, origin)
    return sweep


def check_values(sweep: SweepConfig, origin: str) -> None:
    """Each point and each edge value of the space, on top of the base, must be a valid run config."""
    base = dotted_keys(sweep.base)
    try:
        load_config(None, base)
    except ConfigError as e:
        raise ConfigError(f"{origin}: base: {str(e).removeprefix('config: ')}") from None
    for i, point in enumerate(sweep.point_overrides()):
        _check(base, point, f"{origin}: points[{i}]")
    for key, dist in sweep.space.items():
        for value in dist.edges():
            _check(base, {key: value}, f"{origin}: space.{key}: {dist.kind} value {value!r}")


def _check(base: dict[str, Any], overrides: dict[str, Any], where: str) -> None:
    try:
        load_config(None, {**base, **overrides})
    except ConfigError as e:
        msg = str(e).removeprefix("config: ")
        if "Extra inputs are not permitted" in msg:
            msg = f"{msg.split(':')[0]} is not a run setting"
        raise ConfigError(f"{where}: {msg}") from None


def edge_configs(sweep: SweepConfig) -> list[WhaleConfig]:
    """Run configs at the space's edges (every point, every grid/choice value, each range's bounds): what the CLI
    checks before any trial starts, and what sizes a trial's resources for max_concurrent_trials: auto."""
    base = dotted_keys(sweep.base)
    overrides = [*sweep.point_overrides(), *({k: v} for k, d in sweep.space.items() for v in d.edges())] or [{}]
    return [as_trial(load_config(None, {**base, **o})) for o in overrides]


def as_trial(cfg: WhaleConfig) -> WhaleConfig:
    """`cfg` as a trial runs it: trials side by side share the cores, so a pool sized to them (`sandbox.evaluators:
    cores`, the default) is one evaluator each."""
    if cfg.sandbox.evaluators == "cores":
        cfg.sandbox.evaluators = 1
    return cfg


def label(values: dict[str, Any]) -> str:
    """A run directory name from the settings a trial varies: E0.2-I6, condition=whale-seed=1."""
    parts = []
    for key, value in values.items():
        leaf = key.rsplit(".", 1)[-1]
        text = f"{value:.4g}" if isinstance(value, float) and math.isfinite(value) else str(value)
        text = Path(text).stem if "/" in text else text  # a file setting (harness:) by its name
        parts.append(f"{leaf}{text}" if leaf in ("E", "I") else f"{leaf}={text}")
    return "-".join(parts) or "base"
