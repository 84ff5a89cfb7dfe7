"""A fourth domain from the tests folder alone (tests/toy_domain/), with no edit in the core: found by its
import path, its own config section validated by its model, and a condition run end to end on it."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from actors.coordinator import Coordinator
from tests.helpers import small_config
from whale_ray.config import ConfigError, WhaleConfig, load_config
from whale_ray.domain import DataError, domain_names, get_domain
from whale_ray.run_state import RunState

NAME = "tests.toy_domain"
ROOT = Path(__file__).resolve().parents[2]


def test_found_by_import_path_with_its_own_section():
    domain = get_domain(NAME)
    from tests.toy_domain import DOMAIN, ToyConfig

    assert domain is DOMAIN and NAME in domain_names()
    cfg = load_config(None, {"domain": NAME, "toy.max_letters": 9})
    assert isinstance(cfg.domain_config, ToyConfig) and cfg.domain_config.toy.max_letters == 9
    assert WhaleConfig.model_validate(cfg.model_dump(mode="json")) == cfg  # what actors receive round-trips
    with pytest.raises(ConfigError, match=r"toy\.colour: Extra inputs are not permitted"):
        load_config(None, {"domain": NAME, "toy.colour": "red"})
    with pytest.raises(ConfigError, match="toy: Extra inputs are not permitted"):
        load_config(None, {"toy.max_letters": 9})  # math has no toy section
    with pytest.raises(ConfigError, match="config key 'retrieval' belongs to domain 'search_qa'"):
        load_config(None, {"domain": NAME, "retrieval.kind": "bm25"})
    with pytest.raises(DataError, match="toy.min_letters"):
        DOMAIN.check_inputs(load_config(None, {"domain": NAME, "toy.min_letters": 8}))


def test_no_core_file_names_the_toy_domain():
    tracked = subprocess.run(["git", "ls-files", "whale_ray", "actors", "domains"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout.split()
    assert tracked and not [p for p in tracked if p.endswith(".py") and "toy" in (ROOT / p).read_text()]


@pytest.mark.slow
def test_a_condition_runs_end_to_end_on_the_toy_domain(tmp_path, ray_cluster, embedded_policy):
    cfg = small_config(tmp_path / "toy", domain=NAME, condition="whale")
    history = Coordinator(cfg, embedded_policy(NAME)).run()
    state = RunState.load(cfg.run_dir)
    assert state.finished and [p.rsplit(":", 1)[0] for p in state.phases_done] == \
        ["1:weight", "1:harness", "2:weight", "2:harness"]
    assert [row.cycle for row in history] == [0, 1, 2]
    # every recorded reward is the toy verifier's verdict on the recorded answer, for the toy's own tasks
    domain = get_domain(NAME)
    splits = domain.load_splits(cfg.data, cfg.seed)
    tasks = {t.id: t for role in ("weight", "harness", "val", "test") for t in getattr(splits, role)}
    rows = [r for p in sorted((cfg.run_dir / "rollouts").glob("*.parquet")) for r in pq.read_table(p).to_pylist()]
    assert {r["task_id"] for r in rows} <= set(tasks) and any(r["task_id"].startswith("toy-test-") for r in rows)
    assert all(r["reward"] == domain.verify(tasks[r["task_id"]], r["answer"]) for r in rows)
