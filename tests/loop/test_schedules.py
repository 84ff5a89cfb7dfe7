from whale_ray.config import AdaptiveConfig, load_config
from whale_ray.schedules import harness_phase_should_stop, plan, weight_phase_should_stop


def kinds(condition: str, cycles: int = 2) -> list[list[str]]:
    cfg = load_config(overrides={"condition": condition, "cycles": cycles, "E": 0.2, "I": 4})
    return [[p.kind for p in cycle] for cycle in plan(cfg)]


def test_each_condition_phase_sequence():
    assert kinds("rsft_only") == [["weight"], ["weight"]]
    assert kinds("mh_only") == [["harness"], ["harness"]]
    assert kinds("whale") == [["weight", "harness"], ["weight", "harness"]]
    assert kinds("adaptive_whale") == [["weight", "harness"], ["weight", "harness"]]
    assert kinds("stagewise") == [["weight"], ["weight"], ["harness"], ["harness"]]


def test_budgets_follow_E_and_I():
    cfg = load_config(overrides={"condition": "whale", "E": 0.2, "I": 4})
    weight, harness = plan(cfg)[0]
    assert (weight.budget, harness.budget) == (0.2, 4)
    adaptive = plan(load_config(overrides={"condition": "adaptive_whale"}))[0]
    assert all(p.adaptive for p in adaptive)
    assert adaptive[1].budget == AdaptiveConfig().harness_max_iterations


def test_adaptive_weight_phase_waits_for_minimum_then_stops_on_plateau():
    rules = AdaptiveConfig(weight_min_epochs=0.2, weight_window=2)
    rising = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]
    flat = [0.1, 0.5, 0.5, 0.4, 0.4, 0.3]
    assert not weight_phase_should_stop(0.1, flat, rules)  # below the minimum
    assert not weight_phase_should_stop(0.5, rising, rules)
    assert weight_phase_should_stop(0.5, flat, rules)
    assert not weight_phase_should_stop(0.5, flat[:3], rules)  # too few steps to judge


def test_adaptive_harness_phase_min_patience_max():
    rules = AdaptiveConfig(harness_min_iterations=5, harness_patience=2, harness_max_iterations=15)
    stuck = [0.3, 0.3, 0.3, 0.3, 0.3, 0.3]
    improving = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]
    assert not harness_phase_should_stop(3, stuck[:3], rules)
    assert harness_phase_should_stop(6, stuck, rules)
    assert not harness_phase_should_stop(6, improving, rules)
    assert harness_phase_should_stop(15, improving * 3, rules)
