"""A Ray Tune sweep over two (E, I) points, each a real (small) WHALE run."""

from __future__ import annotations

import pytest

from tests.conftest import SMALL
from whale_ray.config import ConfigError
from whale_ray.run_state import RunState
from whale_ray.sweep import SweepConfig, load_sweep, run_sweep


def nested(flat: dict) -> dict:
    tree: dict = {}
    for key, value in flat.items():
        section, _, leaf = key.rpartition(".")
        (tree.setdefault(section, {}) if section else tree)[leaf] = value
    return tree


@pytest.mark.slow
def test_sweep_runs_each_point_and_ranks_them(tmp_path, ray_cluster, tiny_policy):
    base = nested({**SMALL, "cycles": 1})
    sweep = SweepConfig(base=base, points=[(0.25, 1), (0.5, 2)])
    rows = run_sweep(sweep, tmp_path, tiny_policy)
    assert sorted((r["E"], r["I"]) for r in rows) == [(0.25, 1), (0.5, 2)]
    assert rows[0]["test_mean8"] >= rows[1]["test_mean8"]
    for E, I in [(0.25, 1), (0.5, 2)]:
        state = RunState.load(tmp_path / f"E{E:g}-I{I}")
        assert state.finished and state.ledger.harness_iterations == I


def test_bad_sweep_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_sweep(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("points: [[0.2]]\n")
    with pytest.raises(ConfigError, match="bad.yaml"):
        load_sweep(bad)
