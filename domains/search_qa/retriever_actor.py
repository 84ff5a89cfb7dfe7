"""Retriever: the search_qa corpus index, one Ray actor shared by every evaluator of a run.

A thin shell over the plain backends of retrieval.py (BM25, dense, HTTP client); evaluators reach it
through the domain's `search` host tool, never from inside a sandbox.
"""

from __future__ import annotations

from typing import Any

import ray

from .config import RetrievalConfig
from .retrieval import Passage, SearchBackend, build_retriever

MAX_CONCURRENCY = 8  # concurrent searches; an HTTP backend spends most of its time waiting


@ray.remote
class Retriever:
    def __init__(self, retrieval: RetrievalConfig, passages: list[Passage] | None = None, events_dir: str | None = None):
        """`passages`: the generated corpus, used unless `retrieval` names a corpus file or an HTTP service;
        `events_dir`: the run directory, whose events.jsonl hears of a restart."""
        self._backend: SearchBackend | None = None
        self._start_error: Exception | None = None
        try:
            self._backend = build_retriever(retrieval, passages)
        except Exception as e:  # kept for describe(): Ray would turn it into an ActorDiedError without a cause
            self._start_error = e
        if events_dir and ray.get_runtime_context().was_current_actor_reconstructed:
            from whale_ray.events import EventLog

            EventLog(events_dir).emit("actor_restarted", "the Retriever was restarted by Ray and has built its index "
                                      "again", actor="Retriever")

    def _ready(self) -> SearchBackend:
        if self._backend is None:
            assert self._start_error is not None
            raise self._start_error
        return self._backend

    def search(self, queries: list[str], topk: int) -> list[list[Passage]]:
        return self._ready().search(queries, topk)

    def describe(self) -> dict[str, Any]:
        backend = self._ready()
        passages = getattr(backend, "passages", None)
        return {"backend": type(backend).__name__, "passages": len(passages) if passages is not None else None}


def start_retriever(retrieval: RetrievalConfig, passages: list[Passage] | None = None,
                    options: dict[str, Any] | None = None, events_dir: str | None = None) -> "ray.actor.ActorHandle":
    """A started Retriever (`options`: its Ray `.options()`, from config resources.retriever). Waits until its
    index is built, so a bad corpus or model fails here, with the original exception (a DataError, say)."""
    handle = Retriever.options(**(options or {"num_cpus": 0}), max_concurrency=MAX_CONCURRENCY).remote(
        retrieval, passages, events_dir)
    try:
        ray.get(handle.describe.remote())
    except ray.exceptions.RayTaskError as e:
        ray.kill(handle)
        cause = getattr(e, "cause", None)
        if isinstance(cause, Exception):
            raise cause from None
        raise
    return handle
