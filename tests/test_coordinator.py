"""Each condition of each domain end to end on a real local Ray cluster, the embedded policy and real sandboxes;
selection, report, ledger and D_test isolation checked against the rollout files and the budgets (run_truth.py)."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from actors.coordinator import Coordinator
from tests.conftest import small_config
from tests.run_truth import (
    check_ledger,
    check_selection,
    check_test_isolation,
    guessing_math_harness,
    mean_reward,
    rollout_names,
)
from whale_ray.archive import Archive
from whale_ray.domain import builtin_domain_names, get_domain
from whale_ray.run_state import RunState

EXPECTED_PHASES = {
    "rsft_only": ["1:weight", "2:weight"],
    "mh_only": ["1:harness", "2:harness"],
    "whale": ["1:weight", "1:harness", "2:weight", "2:harness"],
    "adaptive_whale": ["1:weight", "1:harness", "2:weight", "2:harness"],
    "stagewise": ["1:weight", "2:weight", "3:harness", "4:harness"],
}


def rollout_rows(run_dir, prefix):
    return [pq.read_table(p) for p in sorted((run_dir / "rollouts").glob(f"{prefix}*.parquet"))]


# Every condition on math, where the checks below have choices to get wrong; on the other domains the one
# condition with both kinds of phase. The conditions are data (whale_ray/schedules.py) run by a loop that never
# branches on the domain, and the domains' plug-ins are all reached by a WHALE run.
CASES = [(c, "math_reasoning") for c in EXPECTED_PHASES] + [
    ("whale", d) for d in builtin_domain_names() if d != "math_reasoning"]


@pytest.mark.slow
@pytest.mark.parametrize(("condition", "domain"), CASES)
def test_condition_runs_its_phases(domain, condition, tmp_path, ray_cluster, embedded_policy):
    overrides = {}
    if domain == "math_reasoning":  # rewards that vary, so that selection and training have choices to get wrong
        seed_harness = tmp_path / "guess.py"
        seed_harness.write_text(guessing_math_harness(get_domain(domain).h0_path.read_text()))
        overrides = {"harness": str(seed_harness), "data__n_val": 8, "data__n_test": 8, "eval__val_samples": 2}
    cfg = small_config(tmp_path / condition, condition=condition, domain=domain, **overrides)
    history = Coordinator(cfg, embedded_policy(domain)).run()
    state = RunState.load(cfg.run_dir)
    assert state.finished
    assert [p.rsplit(":", 1)[0] for p in state.phases_done] == EXPECTED_PHASES[condition]
    cycles = 4 if condition == "stagewise" else 2
    assert [row.cycle for row in history] == list(range(cycles + 1))  # row 0 is (theta0, h0)

    weight_tables = rollout_rows(cfg.run_dir, "weight-")
    n_weight = sum(t.num_rows for t in weight_tables)
    assert n_weight == state.ledger.weight_rollouts
    archive = Archive(cfg.run_dir / "archive")
    evaluated = archive.candidates(status="evaluated")
    if "weight" in " ".join(EXPECTED_PHASES[condition]):
        assert n_weight > 0
        # every rollout row keeps the exact token ids of every model call
        calls = weight_tables[0].column("calls").to_pylist()
        assert calls[0] and calls[0][0]["prompt_ids"] and calls[0][0]["completion_ids"]
    else:
        assert n_weight == 0 and state.weight_version == 0
    if "harness" in " ".join(EXPECTED_PHASES[condition]):
        assert len(evaluated) >= 2  # the seed and at least one proposal
        assert state.ledger.harness_rollouts > 0
    else:
        assert [c.id for c in archive.candidates()] == ["h0"]
        assert state.ledger.harness_rollouts == 0
    # the test split is reported every cycle, for the pair chosen on val
    for row in history:
        assert 0.0 <= row.test_mean8 <= 1.0
        assert 0.0 <= row.test_metrics["truncation_rate"] <= 1.0
    if domain == "search_qa":  # retrieval accuracy comes from the trusted record of the retriever's outputs
        assert all(0.0 <= row.test_metrics["retrieval_hit"] <= 1.0 for row in history)
    report = json.loads((cfg.run_dir / "state.json").read_text())
    check_selection(cfg.run_dir, report)
    check_ledger(cfg, cfg.run_dir, report)
    check_test_isolation(cfg, cfg.run_dir)
    if domain == "math_reasoning" and condition == "whale":  # the checks above had choices to get wrong
        assert report["weight_version"] > 0
        vals = {mean_reward(cfg.run_dir / "rollouts" / f"{n}.parquet") for n in rollout_names(cfg.run_dir, "val")}
        assert len(vals) > 1, vals

