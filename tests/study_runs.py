"""A small real study shared by the compare and report tests: two conditions × two seeds of math runs on a real
local Ray cluster, the embedded test policy and real sandboxes, laid out as `whale study` does (a root folder of
run directories). One cycle each at the smallest budgets; the seed harness guesses (run_truth.guessing_math_harness)
so rewards vary between seeds and pairs, and means and standard deviations have something to get wrong."""

from __future__ import annotations

from pathlib import Path

from actors.coordinator import Coordinator
from tests.conftest import small_config
from tests.run_truth import guessing_math_harness
from whale_ray.domain import get_domain

CONDITIONS = ("rsft_only", "mh_only")  # weight-only is there: rollouts to reach its best val are computed
SEEDS = (0, 1)


def make_study(root: Path, policy: str) -> Path:
    seed_harness = root / "guess.py"
    seed_harness.write_text(guessing_math_harness(get_domain("math_reasoning").h0_path.read_text()))
    for condition in CONDITIONS:
        for seed in SEEDS:
            cfg = small_config(root / "runs" / f"{condition}-s{seed}", condition=condition, seed=seed, cycles=1,
                               harness=str(seed_harness), data__n_val=8, data__n_test=8, eval__val_samples=2)
            Coordinator(cfg, policy).run()
    return root / "runs"
