"""The search_qa domain: questions over a generated world (default) or Search-R1's seven benchmarks
(files), a shared retriever reached as the `search` host tool, and exact match on <answer> (with an
optional LLM judge). See skill.md for what a harness may change."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from whale_ray.domain import DataError, Domain, Splits
from whale_ray.records import Task

from . import data, generator, retrieval, verifier

if TYPE_CHECKING:
    from whale_ray.config import DataConfig, WhaleConfig
    from whale_ray.records import EpisodeResult


class SearchQADomain(Domain):
    name = "search_qa"
    folder = Path(__file__).resolve().parent
    warmstart_version = "1"  # part of the embedded policy's cache key: bump when the warm-start formats change

    def load_splits(self, data_config: "DataConfig", seed: int) -> Splits:
        return data.load_splits(data_config, seed)

    def verify(self, task: Task, response: str | None) -> float:
        return verifier.verify(task, response)

    def make_verifier(self, cfg: "WhaleConfig") -> Callable[[Task, str | None], float]:
        return verifier.JudgedVerifier(cfg.judge) if cfg.judge.enabled else self.verify

    def warmstart_conversations(self, n: int, seed: int) -> list[list[dict[str, str]]]:
        return generator.warmstart_conversations(n, seed)

    def check_inputs(self, cfg: "WhaleConfig") -> None:
        r = cfg.retrieval
        if r.kind == "http":
            return
        if r.corpus_path is None and cfg.data.source != "generated":
            raise DataError(f"retrieval.kind {r.kind!r} with data.source 'files' needs retrieval.corpus_path "
                            "(a Search-R1 style JSONL corpus) or retrieval.kind 'http' with retrieval.url")
        if r.corpus_path is not None and not Path(r.corpus_path).is_file():
            raise DataError(f"retrieval.corpus_path {r.corpus_path}: not found")

    def start_services(self, cfg: "WhaleConfig", splits: Splits) -> dict[str, Any]:
        """{"retriever": a Retriever actor}, over cfg.retrieval's corpus, else the seed's generated corpus."""
        from actors.retriever import start_retriever

        self.check_inputs(cfg)
        r = cfg.retrieval
        use_generated = r.kind != "http" and r.corpus_path is None
        return {"retriever": start_retriever(r, generator.corpus(cfg.seed) if use_generated else None)}

    def host_tools(self, services: dict[str, Any]) -> dict[str, Callable[..., str]]:
        """{"search": search(query, topk=1) -> str}; services["retriever"] is a Retriever actor handle or
        any object with search(queries, topk) (a plain backend, in tests)."""
        if services.get("retriever") is None:
            raise ValueError("search_qa needs the 'retriever' service: start it with DOMAIN.start_services(cfg, splits)")
        return {"search": retrieval.search_tool(services["retriever"])}

    def episode_metrics(self, task: Task, episode: "EpisodeResult") -> dict[str, float]:
        """retrieval_hit: 1.0 when a gold answer appears (normalised, as whole words) in any search result
        of the episode, from the runner's trusted record of tool calls."""
        golds = verifier.golden_answers(task)
        hit = any(
            isinstance(call, dict) and call.get("name") == "search" and isinstance(call.get("output"), str)
            and verifier.contains_answer(call["output"], golds)
            for call in getattr(episode, "tool_calls", None) or []
        )
        return {"retrieval_hit": 1.0 if hit else 0.0}


DOMAIN = SearchQADomain()
