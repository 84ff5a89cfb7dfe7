"""The search_qa domain: questions over a generated world (default) or Search-R1's seven benchmarks
(files), a shared retriever reached as the `search` host tool, and exact match on <answer> (with an
optional LLM judge). Its config sections are `retrieval` and `judge` (config.py). See skill.md for what
a harness may change."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from whale_ray.domain import AnswerFormat, DataError, DataSpec, Domain, RunConfig, Splits, register_domain
from whale_ray.records import Task

from . import data, generator, retrieval, verifier
from .config import SearchQAConfig

if TYPE_CHECKING:
    from whale_ray.records import EpisodeResult

# A file that is not a corpus is refused before a run starts from this many lines; the retriever reads all.
CORPUS_CHECK_LINES = 1000


class SearchQADomain(Domain):
    name = "search_qa"
    folder = Path(__file__).resolve().parent
    warmstart_version = "2"
    answer_format = AnswerFormat("<answer>", "</answer>")
    difficulty_field = "group"  # generated-1hop / generated-2hop, or the benchmark of a file
    config_model = SearchQAConfig
    service_roles = ("retriever",)

    def load_splits(self, data_config: DataSpec, seed: int) -> Splits:
        return data.load_splits(data_config, seed)

    def verify(self, task: Task, response: str | None) -> float:
        return verifier.verify(task, response)

    def make_verifier(self, cfg: RunConfig) -> Callable[[Task, str | None], float]:
        judge = self.settings(cfg).judge
        return verifier.JudgedVerifier(judge) if judge.enabled else self.verify

    def warmstart_conversations(self, n: int, seed: int) -> list[list[dict[str, str]]]:
        return generator.warmstart_conversations(n, seed)

    def check_inputs(self, cfg: RunConfig) -> None:
        r = self.settings(cfg).retrieval
        if r.kind == "http":
            return
        if r.corpus_path is None and cfg.data.source != "generated":
            raise DataError(f"retrieval.kind {r.kind!r} with data.source 'files' needs retrieval.corpus_path "
                            "(a Search-R1 style JSONL corpus) or retrieval.kind 'http' with retrieval.url")
        if r.corpus_path is not None:
            try:
                retrieval.load_corpus(r.corpus_path, max_lines=CORPUS_CHECK_LINES)
            except DataError as e:
                raise DataError(f"retrieval.corpus_path: {e}") from None

    def start_services(self, cfg: RunConfig, splits: Splits, placement: Any = None) -> dict[str, Any]:
        """{"retriever": a Retriever actor}, over the retrieval section's corpus, else the seed's generated one;
        restarted by Ray if it dies (it holds no state beyond its index, which it builds again)."""
        from whale_ray.resources import Placement

        from .retriever_actor import start_retriever

        self.check_inputs(cfg)
        r = self.settings(cfg).retrieval
        use_generated = r.kind != "http" and r.corpus_path is None
        restarts = cfg.faults.actor_restarts
        options = {**(placement or Placement()).options("retriever", cfg.resources.retriever),
                   "max_restarts": restarts, "max_task_retries": restarts}
        return {"retriever": start_retriever(r, generator.corpus(cfg.seed) if use_generated else None, options=options,
                                             events_dir=str(cfg.run_dir))}

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


DOMAIN = register_domain(SearchQADomain())
