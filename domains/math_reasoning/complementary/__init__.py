"""The complementary math world: the embedded math problems without the python tool, and an h0 whose token
budget is too short for the reasoning of longer problems. Select it with `domain:
domains.math_reasoning.complementary` (`whale run --domain domains.math_reasoning.complementary`).

It is built so that the two parts of the agent fix different failures, as in the paper's math domain
(docs/worlds.md has the calibration and what it does not guarantee):
  * only training: with no tool, the arithmetic is the model's own (inline reasoning, "12 + 7 = 19 . 19 - 5
    = 14 . \\boxed{14}"); no harness lever in skill.md makes θ0 better at it, verified samples can;
  * only a harness change: h0's MAX_TOKENS (30) is shorter than the taught reasoning of every problem of
    three or four steps (31 to 51 tokens of the embedded policy's tokenizer; one or two steps take 13 to
    29), so those are cut off under h0 whatever the weights: the warm-start format writes every step, and
    training under h0 only ever sees accepted one- and two-step answers.
Data, verifier and warm-start are the math domain's; the embedded policy is built from the same
conversations (its cache entry is keyed on this domain's name).
"""

from __future__ import annotations

from pathlib import Path

from domains.math_reasoning import MathDomain
from whale_ray.domain import register_domain


class ComplementaryMathDomain(MathDomain):
    name = "domains.math_reasoning.complementary"
    folder = Path(__file__).resolve().parent  # h0.py and skill.md; no tools.py: this world has no python tool


DOMAIN = register_domain(ComplementaryMathDomain())
