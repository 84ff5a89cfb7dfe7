"""The arithmetic world: a math world for small real models. Select it with `domain:
domains.math_reasoning.arithmetic` (`whale run --domain domains.math_reasoning.arithmetic`).

Arithmetic questions in plain words, graded by level ("What is 7 plus 12?" ... "What is 4 times 6 plus
9?", generator.py), the math domain's strict \\boxed{} verifier, and its python tool, which h0 does not
offer. h0 is a plain baseline any instruct model can follow: the answer format stated in words, one turn.
What the parts can fix, and SmolLM2-135M-Instruct's measured pass@k under h0, are in docs/worlds.md.
"""

from __future__ import annotations

from pathlib import Path

from domains.math_reasoning import MathDomain
from domains.math_reasoning import data as math_data
from whale_ray.domain import DataSpec, Splits, register_domain, split_sizes

from . import generator


class ArithmeticDomain(MathDomain):
    name = "domains.math_reasoning.arithmetic"
    folder = Path(__file__).resolve().parent  # h0.py and skill.md
    warmstart_version = "1"
    difficulty_field = "level"

    @property
    def sandbox_tools_path(self) -> Path:
        return MathDomain.folder / "tools.py"  # the math domain's python tool

    def load_splits(self, data_config: DataSpec, seed: int) -> Splits:
        if data_config.source == "generated":
            return Splits(**generator.generate_splits(split_sizes(data_config), seed))
        return math_data.load_splits(data_config, seed)

    def warmstart_conversations(self, n: int, seed: int) -> list[list[dict[str, str]]]:
        return generator.warmstart_conversations(n, seed)


DOMAIN = register_domain(ArithmeticDomain())
