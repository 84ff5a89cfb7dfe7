"""The chess_puzzles domain: Lichess puzzles (files) or generated ones, played one UCI move at a time
against a trusted environment that answers with the opponent's replies. See skill.md for what a harness
may change, env.py for the tools, verifier.py for what scores."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from whale_ray.domain import DataSpec, Domain, Splits, register_domain
from whale_ray.records import Task

from . import data, env, generator, verifier

if TYPE_CHECKING:
    from whale_ray.records import EpisodeResult


class ChessDomain(Domain):
    name = "chess_puzzles"
    folder = Path(__file__).resolve().parent
    warmstart_version = "3"
    difficulty_field = "moves"  # the solver's moves in the line

    def load_splits(self, data_config: DataSpec, seed: int) -> Splits:
        return data.load_splits(data_config, seed)

    def verify(self, task: Task, response: str | None) -> float:
        return verifier.verify(task, response)

    def warmstart_conversations(self, n: int, seed: int) -> list[list[dict[str, str]]]:
        return generator.warmstart_conversations(n, seed)

    def host_tools(self, services: dict[str, Any]) -> dict[str, Callable[..., str]]:
        return env.host_tools()

    def episode_tools(self, task: Task, services: dict[str, Any]) -> dict[str, Callable[..., str]]:
        return env.episode_tools(task)

    def episode_metrics(self, task: Task, episode: "EpisodeResult") -> dict[str, float]:
        """illegal_move: the environment saw an illegal or unparsable move; env_solved: it said "Solved."
        (a solved episode whose answer still scores 0 lost the moves in answer extraction)."""
        outputs = [str(c.get("output", "")) for c in getattr(episode, "tool_calls", None) or []
                   if c.get("name") == "move"]
        return {
            "illegal_move": float(any(o.startswith("Error:") for o in outputs)),
            "env_solved": float(any(o == "Solved." for o in outputs)),
        }


DOMAIN = register_domain(ChessDomain())
