"""`whale study`: every (condition, seed) pair on one budget, side by side on the cluster, each in its own run
directory under the study's root (<condition>-s<seed>), resumable like `whale run`.

    whale study --domain math_reasoning --conditions all --seeds 3 --E 0.6 --I 6 --cycles 3 --root runs/study

It is a sweep whose points are the pairs (the same Tune trial, placement groups and resume as `whale sweep`),
with no scheduler: a comparison at equal budgets stops nothing early.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import yaml

from whale_ray.config import CONDITIONS, ConfigError, TrackingConfig, with_trackers
from whale_ray.sweep.space import SweepConfig, parse_sweep


def parse_conditions(text: str) -> list[str]:
    names = list(CONDITIONS) if text.strip() == "all" else [c.strip() for c in text.split(",") if c.strip()]
    if not names:
        raise ConfigError("--conditions: empty; give 'all' or a comma-separated list of " + ", ".join(CONDITIONS))
    for name in names:
        if name not in CONDITIONS:
            raise ConfigError(f"--conditions: unknown condition {name!r}; choose from {', '.join(CONDITIONS)} or all")
    if len(set(names)) != len(names):
        raise ConfigError(f"--conditions {text}: a condition is named twice")
    return names


def study_sweep(conditions: list[str], seeds: list[int], base: dict[str, Any],
                max_concurrent: Optional[int] = None) -> SweepConfig:
    """The study as a sweep: one point per (condition, seed), every other setting from `base` (nested)."""
    if not seeds:
        raise ConfigError("--seeds: must be at least 1")
    for key in ("condition", "seed"):
        if key in base:
            raise ConfigError(f"study base config: {key!r} is what the study varies; leave it out of --config")
    # seed-major: the trials start in this order, so a study stopped part way holds whole seeds to compare
    tree = {"base": base, "points": [{"condition": c, "seed": s} for s in seeds for c in conditions],
            "metric": "best_val", "max_concurrent_trials": max_concurrent or "auto"}
    return parse_sweep(tree, origin="study")


def base_tree(config: Optional[Path], overrides: dict[str, Any]) -> dict[str, Any]:
    """The study's shared settings: a config file's values, then the flags (dotted keys) on top."""
    tree: dict[str, Any] = {}
    if config is not None:
        if not Path(config).is_file():
            raise ConfigError(f"config file {config}: not found")
        loaded = yaml.safe_load(Path(config).read_text()) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {config}: the top level must be a mapping")
        tree = loaded
    for key, value in overrides.items():
        if value is None:
            continue
        node = tree
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    tree.pop("run_dir", None)  # each pair has its own, under the root
    return tree


def model_override(model: Optional[Path]) -> Optional[str]:
    """`--model` for every pair: a local directory as an absolute path (Tune runs each trial in a folder of its own);
    anything else as given, for PolicyConfig to find in the hub cache or check_inputs to refuse."""
    if model is None:
        return None
    return str(model.resolve() if model.exists() else model)


def run_study(args: Any) -> int:
    """The `whale study` command (argparse in whale_ray/cli.py)."""
    from whale_ray import launch
    from whale_ray.sweep.command import run_command
    from whale_ray.tracking.session import log_comparison, sweep_experiment

    conditions = parse_conditions(args.conditions)
    overrides = {"domain": args.domain, "E": args.E, "I": args.I, "cycles": args.cycles,
                 "policy.model": model_override(args.model)}
    base = with_trackers(base_tree(args.config, overrides), args.track, args.mlflow_uri)
    sweep = study_sweep(conditions, list(range(args.first_seed, args.first_seed + args.seeds)), base,
                        args.max_concurrent)
    code = run_command(sweep, args.root, args.ray_address, "study",
                       f"study: {len(conditions)} condition(s) x {args.seeds} seed(s), best first by best val")
    try:  # `whale compare` (whale_ray/compare.py), where it is installed
        from whale_ray import compare
    except ImportError:
        launch.console.print(f"compare the conditions with: whale compare {args.root}")
        return code
    try:
        runs, notes = compare.load_runs([Path(args.root)])
        out = compare.write_comparison(compare.compare(runs, notes), Path(args.root) / "compare")
        launch.console.print(f"comparison: {out} (compare.md, compare.csv, index.html)")
        log_comparison(TrackingConfig.model_validate(base.get("tracking") or {}), Path(args.root), out,
                       sweep_experiment(args.root, "study"))
    except compare.CompareError as e:  # no pair reported a cycle, say: the study's own table stands
        launch.console.print(f"compare: {e}", highlight=False)
    return code
