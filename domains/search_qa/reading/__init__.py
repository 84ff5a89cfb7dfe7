"""The reading world: a search world for small real models. Select it with `domain: domains.search_qa.reading`
(`whale run --domain domains.search_qa.reading`).

search_qa's questions, corpus, retriever and exact-match verifier; only the harness differs. search_qa's h0
leaves the search to the model (a two-turn protocol a 135M model never follows); here h0 searches for the
question itself before the model's first turn and the model reads what was found and answers, with the answer
format stated in words and shown in two worked examples. What the parts can fix, and SmolLM2-135M-Instruct's
measured pass@k under h0, are in docs/worlds.md.
"""

from __future__ import annotations

from pathlib import Path

from domains.search_qa import SearchQADomain
from whale_ray.domain import register_domain

from . import warmstart


class ReadingDomain(SearchQADomain):
    name = "domains.search_qa.reading"
    folder = Path(__file__).resolve().parent  # h0.py and skill.md
    warmstart_version = "1"

    @property
    def sandbox_tools_path(self) -> Path:
        return SearchQADomain.folder / "tools.py"  # none: search is a host tool

    def warmstart_conversations(self, n: int, seed: int) -> list[list[dict[str, str]]]:
        return warmstart.conversations(n, seed)


DOMAIN = register_domain(ReadingDomain())
