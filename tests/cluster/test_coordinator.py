"""Each condition of each domain end to end on a real local Ray cluster, the embedded policy and real sandboxes;
selection, report, ledger and D_test isolation checked against the rollout files and the budgets (run_truth.py)."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from actors.coordinator import Coordinator
from tests.helpers import EXPECTED_PHASES, check_condition_run, study_config
from tests.run_truth import (
    check_ledger,
    check_staleness,
    rollout_names,
)
from whale_ray.config import load_recorded_config
from whale_ray.domain import builtin_domain_names

# Every condition on math, where the checks below have choices to get wrong; on the other domains the one
# condition with both kinds of phase. The conditions are data (whale_ray/schedules.py) run by a loop that never
# branches on the domain, and the domains' plug-ins are all reached by a WHALE run.
# (WHALE on math is the replicas test's below, which runs it twice.)
CASES = [(c, "math_reasoning") for c in EXPECTED_PHASES if c != "whale"] + [
    ("whale", d) for d in builtin_domain_names() if d != "math_reasoning"]


@pytest.mark.slow
@pytest.mark.parametrize(("condition", "domain"), CASES)
def test_condition_runs_its_phases(domain, condition, tmp_path, ray_cluster, embedded_policy):
    cfg = study_config(tmp_path, condition, domain)
    check_condition_run(cfg, Coordinator(cfg, embedded_policy(domain)).run())
    # the optimiser's settings the config left unset, on record as the embedded policy's (rsft_defaults.py)
    weight = load_recorded_config(cfg.run_dir / "config.yaml").weight
    assert (weight.learning_rate, weight.warmup_steps, weight.max_grad_norm, weight.precision) == (
        3e-4, 0, 1.0, "float32")


@pytest.mark.slow
def test_two_policy_replicas_share_the_episodes_and_change_nothing_else(tmp_path, ray_cluster, tiny_policy):
    """WHALE on math, with one PolicyServer and with two (policy.replicas): both replicas serve episodes, both
    hold every weight version the run reaches, and the two-replica run equals the one-replica run of the same
    config and seed (each request is seeded, and a reply does not depend on the batch it was generated in):
    history, selection, ledger and every weight-phase answer."""
    runs, seen = {}, []
    for replicas in (1, 2):
        cfg = study_config(tmp_path / f"r{replicas}", "whale", "math_reasoning", policy__replicas=replicas)
        coordinator = Coordinator(cfg, tiny_policy)

        def on_cycle(row, c=coordinator) -> None:
            seen.append([ray_cluster.get(h.stats.remote())["requests"] for h in c.policies]
                        + [ray_cluster.get(h.version.remote()) for h in c.policies])
        runs[replicas] = (cfg, coordinator.run(on_cycle), json.loads((cfg.run_dir / "state.json").read_text()))
    (cfg1, history1, one), (cfg2, history2, two) = runs[1], runs[2]
    check_condition_run(cfg1, history1)
    (*served, v_a, v_b) = seen[-1]
    assert len(served) == 2 and min(served) > 0, served  # the episodes' calls went to both
    assert v_a == v_b == two["weight_version"] > 0  # and both hold the run's weights
    clocks = {"wall_s": True, "ledger": {"proposer_wall_s"}}
    assert [r.model_dump(exclude=clocks) for r in history2] == [r.model_dump(exclude=clocks) for r in history1]
    assert two["best"] == one["best"] and two["phases_done"] == one["phases_done"]
    assert {k: v for k, v in two["ledger"].items() if "wall" not in k} == \
        {k: v for k, v in one["ledger"].items() if "wall" not in k}
    for name in rollout_names(cfg1.run_dir, "weight"):  # the same answers, episode by episode
        a = pq.read_table(cfg1.run_dir / "rollouts" / f"{name}.parquet", columns=["answer", "reward"]).to_pylist()
        b = pq.read_table(cfg2.run_dir / "rollouts" / f"{name}.parquet", columns=["answer", "reward"]).to_pylist()
        assert a == b, name
    check_ledger(cfg2, cfg2.run_dir, two)


@pytest.mark.slow
def test_with_max_staleness_1_a_step_trains_on_the_samples_of_the_weights_before_it(tmp_path, ray_cluster, tiny_policy):
    """weight.max_staleness 1 on the real stack: the Trainer actor takes a step (from a thread of the Coordinator)
    while the pool runs the next step's rollouts on the PolicyServer. The run passes run_truth's checks, and every
    trained call's version, as the PolicyServer stamped it, is one behind its step after a step that trained and the
    step's own otherwise."""
    cfg = study_config(tmp_path, "whale", "math_reasoning", weight__max_staleness=1)
    check_condition_run(cfg, Coordinator(cfg, tiny_policy).run())
    records = check_staleness(cfg.run_dir, max_staleness=1)
    assert sum(r["staleness"].get("1", 0) for r in records) > 0  # some step trained on rollouts run beside the last
