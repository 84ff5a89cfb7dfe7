"""The search_qa domain: loaders, generated world and splits, retrievers (BM25, dense, HTTP, Ray actor),
verifier and judge, h0 (in process and in the real sandbox), warm-start data, skill.md, metrics."""

from __future__ import annotations

import ast
import inspect
import json
import logging
import os
import random
import re
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from domains.search_qa import DOMAIN, SearchQADomain, data, generator, retrieval, tools, verifier
from domains.search_qa.config import JudgeConfig, RetrievalConfig
from domains.search_qa.retrieval import BM25Retriever, HTTPRetriever, Passage, RetrievalError
from tests.helpers import load_harness
from tests.inprocess_agent import InProcessEpisode
from whale_ray.config import DataConfig, load_config
from whale_ray.domain import DataError, Domain, get_domain
from whale_ray.proposers.skill import parse_skill
from whale_ray.records import EpisodeResult, ModelCall, Task

FOLDER = Path(__file__).resolve().parents[2] / "domains" / "search_qa"
H0_KNOBS = {
    "SYSTEM_PROMPT": ("Answer the question. To search, write <search>query</search>; the results come back inside "
                      "<information></information>. Put the answer in <answer></answer>."),
    "MAX_TURNS": 2,
    "N_PASSAGES": 1,
    "PASSAGE_TOKENS": 200,
    "MAX_TOKENS": 64,
    "TEMPERATURE": 1.0,
    "TOP_K": 20,
}
CORPUS = [  # Search-R1 wiki layout: '"Title"\ntext'
    {"id": "0", "contents": '"Velmora"\nVelmora is a port city in Norvessa, known for its harbour.'},
    {"id": "1", "contents": '"Oren Taltavi"\nOren Taltavi was a painter born in Velmora in 1874.'},
    {"id": "2", "contents": '"Kesto Mills"\nKesto Mills is a textile company founded in 1921 by Oren Taltavi.'},
    {"id": "3", "contents": '"Photosynthesis"\nPhotosynthesis is how plants turn sunlight, water and carbon dioxide '
                            'into sugar and oxygen.'},
    {"id": "4", "contents": '"Volcano"\nA volcano is a rupture in the crust of a planet through which lava, ash '
                            'and gases escape.'},
]


# --- helpers ---------------------------------------------------------------------------------------


def searchr1_row(question, answers, source="nq", index=0, *, top_level=True, with_question=True):
    """One row of Search-R1's published parquet files (qa_search_train_merge.py / qa_search_test_merge.py)."""
    row = {
        "id": f"train_{index}",
        "data_source": source,
        "prompt": [{"role": "user", "content": f"Answer the given question. ... Question: {question}\n"}],
        "ability": "fact-reasoning",
        "reward_model": {"style": "rule", "ground_truth": {"target": answers}},
        "extra_info": {"split": "train", "index": index},
    }
    if with_question:
        row["question"] = question
    if top_level:
        row["golden_answers"] = answers
    return row


def write_parquet(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def corpus_passages() -> list[Passage]:
    return [Passage.from_contents(r["id"], r["contents"]) for r in CORPUS]


def load_h0(source: str | None = None) -> dict:
    return load_harness(FOLDER, source)


def episode(policy, search) -> InProcessEpisode:
    """The sandbox's real Agent in process: completions from `policy(messages)`, the real search host tool."""
    return InProcessEpisode(lambda messages, sampling: policy(messages), host_tools={"search": search})


def scripted(*completions):
    queue = list(completions)
    return lambda messages: queue.pop(0)


@pytest.fixture(scope="module")
def world():
    return generator.eval_world(0)


@pytest.fixture(scope="module")
def world_bm25(world):
    return BM25Retriever(world.passages)


class _Handler(BaseHTTPRequestHandler):
    """A loopback server: Search-R1's /retrieve and OpenAI's /v1/chat/completions, plus broken variants."""

    def log_message(self, *args):
        pass

    def _reply(self, code, body, content_type="application/json"):
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def do_POST(self):
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests.append((self.path, request))
        if self.path == "/retrieve":
            hits = self.server.backend.search(request["queries"], request["topk"])
            result = [[{"document": {"id": p.id, "contents": p.contents}, "score": p.score} for p in row] for row in hits]
            return self._reply(200, {"result": result})
        if self.path == "/retrieve-no-scores":
            hits = self.server.backend.search(request["queries"], request["topk"])
            return self._reply(200, {"result": [[{"id": p.id, "contents": p.contents} for p in row] for row in hits]})
        if self.path == "/not-json":
            return self._reply(200, b"<html>oops</html>", "text/html")
        if self.path == "/wrong-shape":
            return self._reply(200, {"result": []})
        if self.path == "/no-contents":
            return self._reply(200, {"result": [[{"document": {"id": "1"}, "score": 1.0}]]})
        if self.path == "/slow":
            time.sleep(1.5)
            return self._reply(200, {"result": [[]]})
        if self.path == "/v1/chat/completions":
            if request["model"] == "judge-fails":
                return self._reply(500, {"error": {"message": "judge is down", "type": "server_error"}})
            prompt = request["messages"][-1]["content"]
            predicted = prompt.split("Predicted answer:")[1].split("\n")[0].strip()
            verdict = "maybe" if request["model"] == "judge-rambles" else (
                "Yes." if predicted.lower() == "the city of velmora" else "no")
            return self._reply(200, {
                "id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": request["model"],
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": verdict}}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            })
        return self._reply(500, {"error": "no such path"})


@contextmanager
def loopback_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.requests = []
    server.backend = BM25Retriever(corpus_passages())
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def server():
    with loopback_server() as s:
        yield s


# --- the domain object -----------------------------------------------------------------------------


def test_domain_object():
    assert isinstance(DOMAIN, SearchQADomain) and isinstance(DOMAIN, Domain)
    assert get_domain("search_qa") is DOMAIN
    assert DOMAIN.name == "search_qa" and DOMAIN.warmstart_version == "2"
    assert DOMAIN.folder == FOLDER
    assert DOMAIN.h0_path.is_file() and DOMAIN.sandbox_tools_path.is_file()
    assert tools.TOOL_SPECS == {}  # search is a host tool
    task = Task(id="t", question="q", answer="Velmora", meta={"_golden_answers": ["Velmora", "Velmora City"]})
    assert DOMAIN.verify(task, "<answer>velmora city</answer>") == 1.0
    assert DOMAIN.verify(task, "The answer is Velmora.") == 0.0
    assert DOMAIN.make_verifier(load_config(None, {"domain": "search_qa"})) == DOMAIN.verify


# --- loaders ---------------------------------------------------------------------------------------


def test_searchr1_parquet_top_level_golden_answers(tmp_path):
    path = write_parquet(tmp_path / "test.parquet", [
        searchr1_row("who wrote hamlet?", ["William Shakespeare", "Shakespeare"], "nq", 0),
        searchr1_row("capital of france?", ["Paris"], "triviaqa", 1),
    ])
    tasks = data.load_questions(path)
    assert [t.question for t in tasks] == ["who wrote hamlet?", "capital of france?"]
    assert tasks[0].answer == "William Shakespeare"
    assert tasks[0].meta == {"group": "nq", "_golden_answers": ["William Shakespeare", "Shakespeare"]}
    assert tasks[1].id == "triviaqa-train_1"
    public = tasks[0].public()
    assert public == {"id": tasks[0].id, "question": "who wrote hamlet?", "group": "nq"}


def test_searchr1_parquet_reward_model_target_only(tmp_path):
    rows = [searchr1_row("who painted the mona lisa?", ["Leonardo da Vinci"], "popqa", 3, top_level=False,
                         with_question=False)]
    rows[0]["id"] = None
    tasks = data.load_questions(write_parquet(tmp_path / "train.parquet", rows))
    # the question comes from the prompt's "Question:" line, the answers from reward_model.ground_truth.target
    assert tasks[0].question == "who painted the mona lisa?"
    assert verifier.golden_answers(tasks[0]) == ["Leonardo da Vinci"]
    assert tasks[0].id == "popqa-3" and tasks[0].meta["group"] == "popqa"


def test_jsonl_questions_and_defaults(tmp_path):
    path = write_lines(tmp_path / "bamboogle.jsonl", [
        json.dumps({"question": "q one?", "golden_answers": "solo"}),
        "",
        json.dumps({"question": "q two?", "golden_answers": [" a ", "a", 7]}),
    ])
    tasks = data.load_questions(path)
    assert [t.meta["group"] for t in tasks] == ["bamboogle", "bamboogle"]  # no data_source: the file's stem
    assert verifier.golden_answers(tasks[0]) == ["solo"]
    assert verifier.golden_answers(tasks[1]) == ["a", "7"]
    assert [t.id for t in tasks] == ["bamboogle-0", "bamboogle-1"]


def test_missing_file_extension_and_columns(tmp_path):
    with pytest.raises(DataError, match=r"nope\.parquet: not found"):
        data.load_questions(tmp_path / "nope.parquet")
    with pytest.raises(DataError, match="unsupported extension '.csv'"):
        data.load_questions(tmp_path / "x.csv")
    bad = tmp_path / "broken.parquet"
    bad.write_bytes(b"not parquet")
    with pytest.raises(DataError, match="broken.parquet: not a readable parquet file"):
        data.load_questions(bad)
    no_answers = write_parquet(tmp_path / "no_answers.parquet", [{"question": "q?", "data_source": "nq"}])
    with pytest.raises(DataError, match=r"no_answers\.parquet: missing column 'golden_answers'"):
        data.load_questions(no_answers)
    no_question = write_parquet(tmp_path / "no_question.parquet", [{"golden_answers": ["a"]}])
    with pytest.raises(DataError, match=r"no_question\.parquet: missing column 'question'"):
        data.load_questions(no_question)


def test_bad_rows_are_skipped_with_file_row_and_count(tmp_path, caplog):
    path = write_parquet(tmp_path / "mixed.parquet", [
        searchr1_row("good one?", ["yes"], index=0),
        searchr1_row("no answers?", [], index=1),
        searchr1_row("", ["x"], index=2),
        searchr1_row("good two?", ["no"], index=3),
        searchr1_row("good one?", ["yes"], index=4),  # a repeat: kept once
    ])
    with caplog.at_level(logging.WARNING, logger="domains.search_qa.data"):
        tasks = data.load_questions(path)
    assert [t.question for t in tasks] == ["good one?", "good two?"]
    text = caplog.text
    assert "mixed.parquet: row 1: empty golden_answers; skipped" in text
    assert "mixed.parquet: row 2: no question; skipped" in text
    assert "mixed.parquet: skipped 2 of 5 rows" in text

    jsonl = write_lines(tmp_path / "lines.jsonl", ["{not json", json.dumps({"question": "q?", "golden_answers": ["a"]})])
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="domains.search_qa.data"):
        assert len(data.load_questions(jsonl)) == 1
    assert "lines.jsonl: line 1: not valid JSON (Expecting property name enclosed in double quotes); skipped" in caplog.text

    all_bad = write_parquet(tmp_path / "all_bad.parquet", [searchr1_row("q?", [], index=0)])
    with pytest.raises(DataError, match=r"all_bad\.parquet: no usable rows \(1 of 1 skipped\)"):
        data.load_questions(all_bad)


def test_file_splits_disjoint_stratified_and_sized(tmp_path):
    train = write_parquet(tmp_path / "train.parquet",
                          [searchr1_row(f"train q{i}?", [f"a{i}"], "nq" if i % 2 else "hotpotqa", i) for i in range(40)]
                          + [searchr1_row("shared q?", ["s"], "nq", 99)])
    test_rows = [searchr1_row(f"test {b} q{i}?", ["t"], b, i) for b in data.BENCHMARKS for i in range(5)]
    test = write_parquet(tmp_path / "test.parquet", test_rows + [searchr1_row("shared q?", ["s"], "nq", 98)])
    cfg = DataConfig(source="files", train_path=train, test_paths=[test], n_weight=20, n_harness=8, n_val=6, n_test=14)
    splits = data.load_splits(cfg, seed=3)
    assert splits.sizes() == {"weight": 20, "harness": 8, "val": 6, "test": 14}
    groups = [t.meta["group"] for t in splits.test]
    assert sorted(set(groups)) == sorted(data.BENCHMARKS) and all(groups.count(g) == 2 for g in set(groups))
    assert "shared q?" not in {t.question for t in splits.weight + splits.harness + splits.val}
    assert data.load_splits(cfg, seed=3) == splits
    assert data.load_splits(cfg, seed=4).val != splits.val
    every = DataConfig(source="files", train_path=train, test_paths=[test], n_test=1000, n_weight=1, n_harness=1,
                       n_val=1)
    assert len(data.load_splits(every, seed=0).test) == 36  # 35 benchmark questions + the shared one


# --- the generated world and its splits --------------------------------------------------------------


def test_world_shape_and_passages(world):
    assert len(world.passages) == generator.N_CITIES + generator.N_PEOPLE + generator.N_COMPANIES
    assert len({p.title for p in world.passages}) == len(world.passages)
    assert len({q.text for q in world.questions}) == len(world.questions)
    assert all(len(p.text) < 250 and "\n" not in p.text for p in world.passages)
    titles = {p.title: p for p in world.passages}
    for q in world.questions:  # every answer is written in the passage that the question leads to
        assert q.answers[0] in titles[q.answer_title].text
        if q.hops == 2:
            assert q.bridge == q.answer_title and q.bridge in titles[q.hop1_title].text
            assert q.answers[0] not in titles[q.hop1_title].text
    assert generator.build_world(0).passages == world.passages
    assert generator.build_world(1).passages != world.passages


def test_warmstart_names_never_in_an_evaluation_world(world):
    eval_titles = {p.title for p in world.passages}
    assert not any(generator.is_warmstart_name(t) for t in eval_titles)
    ws = generator.build_world("0:0", warmstart=True)
    assert all(generator.is_warmstart_name(p.title) for p in ws.passages)
    assert not eval_titles & {p.title for p in ws.passages}


def test_generated_splits_disjoint_balanced_deterministic():
    cfg = DataConfig(n_weight=40, n_harness=12, n_val=10, n_test=9)
    splits = DOMAIN.load_splits(cfg, seed=0)
    assert splits.sizes() == {"weight": 40, "harness": 12, "val": 10, "test": 9}
    groups = [t.meta["group"] for t in splits.weight]
    assert groups.count("generated-1hop") == groups.count("generated-2hop") == 20
    assert set(splits.test[0].public()) == {"id", "question", "group"}
    assert DOMAIN.load_splits(cfg, seed=0) == splits
    assert DOMAIN.load_splits(cfg, seed=1).test != splits.test
    bigger = DOMAIN.load_splits(DataConfig(n_weight=100, n_harness=12, n_val=10, n_test=9), seed=0)
    assert bigger.test == splits.test  # D_test depends only on the seed and n_test
    with pytest.raises(DataError, match=r"has \d+ 1-hop questions left for D_weight, which needs 2500"):
        DOMAIN.load_splits(DataConfig(n_weight=5000, n_harness=1, n_val=1, n_test=1), seed=0)


# --- corpus and retrievers ---------------------------------------------------------------------------


def test_corpus_loading_and_bad_lines(tmp_path, caplog):
    path = retrieval.write_corpus(corpus_passages(), tmp_path / "wiki.jsonl")
    loaded = retrieval.load_corpus(path)
    assert loaded == corpus_passages()
    assert loaded[0] == Passage("0", "Velmora", "Velmora is a port city in Norvessa, known for its harbour.")
    bad = write_lines(tmp_path / "bad.jsonl", [json.dumps(CORPUS[0]), "{oops", json.dumps({"id": "9"}), "[1, 2]",
                                               json.dumps({"contents": "no title line"})])
    with caplog.at_level(logging.WARNING, logger="domains.search_qa.retrieval"):
        passages = retrieval.load_corpus(bad)
    assert [p.title for p in passages] == ["Velmora", ""] and passages[1].id == "5"
    assert "bad.jsonl: line 2: not valid JSON" in caplog.text
    assert 'bad.jsonl: line 3: no "contents" string' in caplog.text
    assert "bad.jsonl: line 4: not a JSON object" in caplog.text
    assert "bad.jsonl: skipped 3 of 5 lines" in caplog.text
    with pytest.raises(DataError, match=r"empty\.jsonl: not a Search-R1 JSONL corpus, no usable passage"):
        retrieval.load_corpus(write_lines(tmp_path / "empty.jsonl", [""]))
    with pytest.raises(DataError, match=r"missing\.jsonl: not found"):
        retrieval.load_corpus(tmp_path / "missing.jsonl")
    with pytest.raises(DataError, match="the corpus is empty"):
        BM25Retriever([])


def test_bm25_finds_each_single_hop_fact_by_its_entity(world, world_bm25):
    single = [q for q in world.questions if q.hops == 1]
    top = world_bm25.search([q.entity for q in single], 1)
    assert all(hits[0].title == q.answer_title for q, hits in zip(single, top))
    assert all(verifier.contains_answer(hits[0].text, q.answers) for q, hits in zip(single, top))
    double = [q for q in world.questions if q.hops == 2]
    bridges = world_bm25.search([q.bridge for q in double], 1)
    assert all(hits[0].title == q.answer_title for q, hits in zip(double, bridges))


def test_bm25_with_the_question_as_query(world, world_bm25):
    """The numbers the report quotes: the question text finds single-hop facts, never two-hop ones at top 1."""
    def accuracy(hops, k):
        qs = [q for q in world.questions if q.hops == hops]
        found = world_bm25.search([q.text for q in qs], k)
        return sum(any(verifier.contains_answer(p.text, q.answers) for p in hits) for q, hits in zip(qs, found)) / len(qs)

    assert accuracy(1, 1) >= 0.98
    assert accuracy(2, 1) <= 0.05 < 0.3 <= accuracy(2, 3)


def test_bm25_edge_cases():
    bm25 = BM25Retriever(corpus_passages())
    hits = bm25.search(["Oren Taltavi", "zzzz qqqq", "the"], 3)
    assert hits[0][0].title == "Oren Taltavi" and hits[0][0].score > 0
    assert hits[1] == [] and hits[2] == []  # nothing shares a word with the query: no padding
    assert len(bm25.search(["Velmora"], 50)[0]) <= len(CORPUS)
    with pytest.raises(ValueError, match="topk must be a positive integer"):
        bm25.search(["x"], 0)


def test_bm25_never_runs_jax_where_it_is_installed(tmp_path):
    """bm25s runs a JAX op at import when JAX is installed, and real JAX then takes most of a GPU's memory beside
    the PolicyServer's engine. A stand-in `jax` package on the path records being imported and fails if used."""
    (tmp_path / "jax").mkdir()
    (tmp_path / "jax" / "__init__.py").write_text(
        "import pathlib, sys\npathlib.Path(sys.argv[1]).write_text('imported')\nfrom . import lax\n")
    (tmp_path / "jax" / "lax.py").write_text("def top_k(*args, **kwargs):\n    raise RuntimeError('jax was used')\n")
    marker = tmp_path / "jax-imported"
    script = ("import sys\n"
              "from domains.search_qa.retrieval import BM25Retriever, Passage\n"
              "hits = BM25Retriever([Passage('1', 'Paris', 'capital of France'), Passage('2', 'Rome', 'in Italy')])"
              ".search(['capital of France'], 2)\n"
              "print(hits[0][0].id, 'jax' in sys.modules)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(FOLDER.parents[1])])}
    done = subprocess.run([sys.executable, "-c", script, str(marker)], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1", "False"] and not marker.exists()


@pytest.mark.slow
def test_dense_retrieval_with_the_real_minilm():
    from domains.search_qa.retrieval import DenseRetriever, default_embedding_model

    dense = DenseRetriever(corpus_passages())
    assert dense.model_path == default_embedding_model() and (dense.model_path / "model.safetensors").is_file()
    hits = dense.search(["How do plants make food from light?", "mountain that erupts molten rock"], 2)
    # no word in common with the passages: only the meaning can find them
    assert hits[0][0].title == "Photosynthesis" and hits[1][0].title == "Volcano"
    assert hits[0][0].score > hits[0][1].score
    embedded = dense.embed(["a", "b"])
    assert embedded.shape == (2, 384) and abs(float(embedded[0].norm()) - 1) < 1e-4
    with pytest.raises(DataError, match="not a model directory"):
        DenseRetriever(corpus_passages(), FOLDER)


def test_http_retriever_against_a_loopback_service(server):
    srv, base = server
    client = HTTPRetriever(f"{base}/retrieve", timeout_s=5)
    hits = client.search(["Oren Taltavi", "Velmora"], 2)
    assert [len(h) for h in hits] == [2, 2]
    assert hits[0][0] == Passage("1", "Oren Taltavi", "Oren Taltavi was a painter born in Velmora in 1874.",
                                 hits[0][0].score) and hits[0][0].score > 0
    assert srv.requests[-1] == ("/retrieve", {"queries": ["Oren Taltavi", "Velmora"], "topk": 2,
                                              "return_scores": True})
    assert HTTPRetriever(f"{base}/retrieve-no-scores").search(["Velmora"], 1)[0][0].title == "Velmora"


@pytest.mark.parametrize("path, message", [
    ("/not-json", "the answer is not JSON"),
    ("/wrong-shape", "needs a 'result' list with one entry per query"),
    ("/no-contents", "has no 'contents' string"),
    ("/missing", "HTTP 500"),
    ("/slow", r"no answer within 0.3 s"),
])
def test_http_retriever_errors_are_retrieval_errors(server, path, message):
    _, base = server
    with pytest.raises(RetrievalError, match=message):
        HTTPRetriever(f"{base}{path}", timeout_s=0.3).search(["q"], 1)
    # as a tool, the error reaches the harness as an error message, never a crash of the evaluator
    search = retrieval.search_tool(HTTPRetriever(f"{base}{path}", timeout_s=0.3))
    with pytest.raises(RetrievalError, match=message):
        search("q")


def test_http_retriever_unreachable():
    with pytest.raises(RetrievalError, match="unreachable"):
        HTTPRetriever("http://127.0.0.1:9/retrieve", timeout_s=1).search(["q"], 1)
    with pytest.raises(ValueError, match="must be an http"):
        HTTPRetriever("ftp://x")


def test_search_tool_contract():
    search = DOMAIN.host_tools({"retriever": BM25Retriever(corpus_passages())})["search"]
    assert search("Oren Taltavi") == "Doc 1(Title: Oren Taltavi) Oren Taltavi was a painter born in Velmora in 1874."
    lines = search("Velmora", topk=3).split("\n")
    assert len(lines) == 2 and lines[1].startswith("Doc 2(Title: ")
    assert search("zzzz") == retrieval.NO_RESULTS
    for bad, message in (({"query": "  "}, "non-empty string"), ({"query": "x", "topk": 0}, "from 1 to 20"),
                         ({"query": "x", "topk": True}, "from 1 to 20"), ({"query": "x" * 1001}, "limit is 1000")):
        with pytest.raises(ValueError, match=message):
            search(**bad)
    from whale_ray.sandbox.runner import host_tool_spec

    spec = host_tool_spec("search", search)
    assert spec["parameters"]["required"] == ["query"] and "topk" in spec["parameters"]["properties"]
    with pytest.raises(ValueError, match="needs the 'retriever' service"):
        DOMAIN.host_tools({})


def test_retriever_actor_on_ray(ray_cluster, tmp_path):
    from domains.search_qa.retriever_actor import start_retriever

    cfg = load_config(None, {"domain": "search_qa", "seed": 0})
    services = DOMAIN.start_services(cfg, splits=None)
    handle = services["retriever"]
    assert ray_cluster.get(handle.describe.remote()) == {"backend": "BM25Retriever", "passages": 480}
    search = DOMAIN.host_tools(services)["search"]
    person = generator.eval_world(0).passages[generator.N_CITIES]
    assert search(person.title).startswith(f"Doc 1(Title: {person.title}) {person.text}")
    with pytest.raises(ValueError, match="topk must be an integer"):
        search("x", topk=99)

    corpus = retrieval.write_corpus(corpus_passages(), tmp_path / "wiki.jsonl")
    from_file = start_retriever(RetrievalConfig(corpus_path=corpus))
    assert ray_cluster.get(from_file.search.remote(["Kesto Mills"], 1))[0][0].title == "Kesto Mills"
    with pytest.raises(DataError, match=r"nothing\.jsonl: not found"):
        start_retriever(RetrievalConfig(corpus_path=tmp_path / "nothing.jsonl"))
    files = load_config(None, {"domain": "search_qa", "data.source": "files", "data.train_path": "t.parquet",
                               "data.test_paths": ["t.parquet"]})
    with pytest.raises(DataError, match="needs retrieval.corpus_path"):
        DOMAIN.start_services(files, splits=None)
    with loopback_server() as (_, base):  # a retriever service error comes back to the tool as RetrievalError
        http = start_retriever(RetrievalConfig(kind="http", url=f"{base}/not-json"))
        with pytest.raises(RetrievalError, match="not JSON"):
            retrieval.search_tool(http)("q")
    for actor in (handle, from_file, http):
        ray_cluster.kill(actor)


# --- verifier and judge ----------------------------------------------------------------------------


@pytest.mark.parametrize("response, golds, expected", [
    ("<answer>Velmora</answer>", ["Velmora"], 1.0),
    ("<answer> the  VELMORA. </answer>", ["Velmora"], 1.0),  # articles, case, punctuation, spaces
    ("<answer>An apple</answer>", ["apple"], 1.0),
    ("<answer>Velmora City</answer>", ["Velmora"], 0.0),  # extra words
    ("<answer>Theodore</answer>", ["Odore"], 0.0),  # "the" is removed only as a word
    ("<answer>Paris</answer> then <answer>Velmora</answer>", ["Velmora"], 1.0),  # the last one counts
    ("<answer>Velmora</answer> <answer>Paris</answer>", ["Velmora"], 0.0),
    ("<answer>\nVelmora\n</answer>", ["Velmora"], 1.0),
    ("<answer>Shakespeare</answer>", ["William Shakespeare", "Shakespeare"], 1.0),  # any gold answer
    ("<answer>1,874</answer>", ["1874"], 1.0),  # punctuation goes, also inside numbers
    ("<answer></answer>", ["Velmora"], 0.0),
    ("The answer is Velmora.", ["Velmora"], 0.0),
    ("<answer>Velmora", ["Velmora"], 0.0),  # never closed
    (None, ["Velmora"], 0.0),
])
def test_exact_match(response, golds, expected):
    task = Task(id="t", question="q", answer=golds[0], meta={"_golden_answers": golds})
    assert verifier.verify(task, response) == expected


def test_normalisation_and_containment():
    assert verifier.normalize_answer("The  Quick, brown-fox!") == "quick brownfox"
    assert verifier.contains_answer("Doc 1(Title: X) born in Velmora in 1874.", ["velmora"])
    assert not verifier.contains_answer("born in Velmorana", ["Velmora"])
    assert not verifier.contains_answer("anything", [""])


def test_judge_over_loopback_with_the_openai_client(server, monkeypatch, caplog):
    srv, base = server
    monkeypatch.setenv("WHALE_TEST_JUDGE_KEY", "sk-test")
    judge = JudgeConfig(enabled=True, model="judge-1", base_url=f"{base}/v1", api_key_env="WHALE_TEST_JUDGE_KEY",
                        timeout_s=5, max_retries=0)
    cfg = load_config(None, {"domain": "search_qa"})
    cfg.domain_config.judge = judge
    verify = DOMAIN.make_verifier(cfg)
    assert isinstance(verify, verifier.JudgedVerifier)
    task = Task(id="t7", question="Where is Velmora?", answer="Velmora", meta={"_golden_answers": ["Velmora"]})
    n = len(srv.requests)
    assert verify(task, "<answer>Velmora</answer>") == 1.0 and len(srv.requests) == n  # EM passed: no judge call
    assert verify(task, "<answer>the city of Velmora</answer>") == 1.0  # the judge says yes
    path, request = srv.requests[-1]
    assert path == "/v1/chat/completions" and request["model"] == "judge-1"
    assert "Gold answers: Velmora" in request["messages"][0]["content"]
    assert verify(task, "<answer>Paris</answer>") == 0.0  # the judge says no
    n = len(srv.requests)
    assert verify(task, "no tags at all") == 0.0 and len(srv.requests) == n  # nothing to judge

    import pickle

    assert pickle.loads(pickle.dumps(verify))(task, "<answer>the city of Velmora</answer>") == 1.0

    with caplog.at_level(logging.WARNING, logger="domains.search_qa.verifier"):
        for model in ("judge-fails", "judge-rambles"):
            cfg.domain_config.judge = judge.model_copy(update={"model": model})
            assert DOMAIN.make_verifier(cfg)(task, "<answer>the city of Velmora</answer>") == 0.0
    assert caplog.text.count("judge failed on task t7") == 2 and "not yes or no" in caplog.text

    unreachable = verifier.JudgedVerifier(judge.model_copy(update={"base_url": "http://127.0.0.1:9/v1"}))
    assert unreachable(task, "<answer>the city of Velmora</answer>") == 0.0

    monkeypatch.delenv("WHALE_TEST_JUDGE_KEY")
    with pytest.raises(ValueError, match="WHALE_TEST_JUDGE_KEY"):
        verifier.JudgedVerifier(judge)
    with pytest.raises(ValueError, match="needs judge.model"):
        verifier.JudgedVerifier(JudgeConfig(enabled=True))


# --- h0 --------------------------------------------------------------------------------------------


def test_h0_contract_and_knobs():
    source = (FOLDER / "h0.py").read_text()
    tree = ast.parse(source)
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not any(isinstance(n, ast.ImportFrom) for n in ast.walk(tree))
    assert imported <= {"re"}
    h0 = load_h0(source)
    assert list(inspect.signature(h0["run"]).parameters) == ["task", "agent"]
    knobs = {k: v for k, v in h0.items() if k.isupper()}
    assert knobs == H0_KNOBS and all(type(knobs[k]) is type(v) for k, v in H0_KNOBS.items())
    for name in ("build_messages", "find_search_query", "format_observation", "extract_answer", "call_search",
                 "run_episode", "run"):
        assert callable(h0[name])


def test_h0_shares_the_warmstart_formats(world):
    h0 = load_h0()
    assert h0["SYSTEM_PROMPT"] == generator.H0_SYSTEM_PROMPT
    assert h0["find_search_query"](generator.search_turn("Oren Taltavi")) == "Oren Taltavi"
    assert h0["find_search_query"](generator.answer_turn("Velmora", True)) is None
    assert h0["find_search_query"]("<answer>x</answer> <search>y</search>") is None  # the first action decides
    tool = retrieval.search_tool(BM25Retriever(world.passages))
    person = world.passages[generator.N_CITIES]
    assert h0["format_observation"](tool(person.title)) == generator.information([person])
    assert h0["build_messages"]({"id": "t", "question": "Q?", "group": "g"}) == [
        {"role": "system", "content": generator.H0_SYSTEM_PROMPT}, {"role": "user", "content": "Q?"}]


def test_h0_truncates_passages_to_words():
    h0 = load_h0((FOLDER / "h0.py").read_text().replace("PASSAGE_TOKENS = 200", "PASSAGE_TOKENS = 4"))
    assert h0["format_observation"]("Doc 1(Title: A) one two three four\nDoc 2(Title: B) x") == \
        "<information>Doc 1(Title: A) one</information>"


def test_h0_two_turns_search_then_answer():
    h0 = load_h0()
    search = retrieval.search_tool(BM25Retriever(corpus_passages()))
    ep = episode(scripted("<search>Oren Taltavi</search>", "<answer>Velmora</answer>"), search)
    assert h0["run"]({"id": "t", "question": "Where was Oren Taltavi born?"}, ep.agent) == "<answer>Velmora</answer>"
    assert ep.prompts[1][-1] == {
        "role": "user", "content": "<information>Doc 1(Title: Oren Taltavi) Oren Taltavi was a painter born in "
                                   "Velmora in 1874.</information>"}
    assert ep.sampling[0] == {"max_tokens": 64, "temperature": 1.0, "top_k": 20, "top_p": 1.0, "stop": []}
    assert [e["type"] for e in ep.events] == ["tool_call"]


def test_h0_turn_budget_exhausted_and_tool_errors():
    h0 = load_h0()
    search = retrieval.search_tool(BM25Retriever(corpus_passages()))
    ep = episode(scripted("<search>Kesto Mills</search>", "<search>Oren Taltavi</search>"), search)
    assert h0["run"]({"id": "t", "question": "Where was the founder of Kesto Mills born?"}, ep.agent) is None
    assert ep.events[-1] == {"type": "turn_budget_exhausted", "max_turns": 2} and len(ep.prompts) == 2
    ep = episode(scripted("<search></search>", "The answer is 1874."), search)
    assert h0["run"]({"id": "t", "question": "Q?"}, ep.agent) == "The answer is 1874."
    assert ep.prompts[1][-1]["content"] == "<information>Error: tool 'search' raised ValueError: search: query must be a non-empty string</information>"


@pytest.mark.usefixtures("bwrap")
@pytest.mark.timeout(60)
def test_h0_in_the_real_sandbox():
    from whale_ray.sandbox import SandboxLimits, run_episode

    host_tools = DOMAIN.host_tools({"retriever": BM25Retriever(corpus_passages())})
    task = Task(id="t1", question="Where was Oren Taltavi born?", answer="Velmora",
                meta={"group": "generated-1hop", "_golden_answers": ["Velmora"]})

    def generate(messages, sampling):
        seen = messages[-1]["content"]
        match = re.search(r"born in (\w+)", seen)
        text = f"<answer>{match.group(1)}</answer>" if match else "<search>Oren Taltavi</search>"
        return ModelCall(messages=messages, text=text, prompt_ids=[1], completion_ids=[2], logprobs=[-0.1],
                         weight_version=0, finish_reason="stop")

    def run(harness_source):
        return run_episode(harness_source, task.public(), generate=generate, tools_path=DOMAIN.sandbox_tools_path,
                           host_tools=host_tools, limits=SandboxLimits(wall_s=20), seed=0)

    source = DOMAIN.h0_path.read_text()
    ep = run(source)
    assert (ep.status, ep.answer, ep.turns) == ("ok", "<answer>Velmora</answer>", 2), ep.reason
    assert DOMAIN.verify(task, ep.answer) == 1.0
    assert ep.tool_calls == [{"name": "search", "args": {"query": "Oren Taltavi", "topk": 1},
                              "output": "Doc 1(Title: Oren Taltavi) Oren Taltavi was a painter born in Velmora in 1874."}]
    assert DOMAIN.episode_metrics(task, ep) == {"retrieval_hit": 1.0}

    # asking for more passages than the tool allows: the harness sees a ToolError, the episode goes on
    ep = run(source.replace("N_PASSAGES = 1", "N_PASSAGES = 50"))
    assert ep.status == "ok" and "error" in ep.tool_calls[0] and "from 1 to 20" in ep.tool_calls[0]["error"]
    assert DOMAIN.episode_metrics(task, ep) == {"retrieval_hit": 0.0}


def test_episode_metrics_from_trusted_tool_calls():
    task = Task(id="t", question="q", answer="Velmora", meta={"_golden_answers": ["Velmora", "Velmora City"]})

    def episode(tool_calls):
        ep = EpisodeResult(status="ok", reason="", answer=None, calls=[], events=[], wall_s=0.1)
        if tool_calls is not None:
            ep.tool_calls = tool_calls
        return ep

    hit = {"name": "search", "args": {"query": "x"}, "output": "Doc 1(Title: V) born in velmora."}
    miss = {"name": "search", "args": {"query": "x"}, "output": "Doc 1(Title: P) born in Paris."}
    failed = {"name": "search", "args": {"query": "Velmora"}, "error": "Velmora service down"}
    other = {"name": "lookup", "args": {}, "output": "Velmora"}
    assert DOMAIN.episode_metrics(task, episode([miss, hit])) == {"retrieval_hit": 1.0}
    assert DOMAIN.episode_metrics(task, episode([miss, failed, other])) == {"retrieval_hit": 0.0}
    assert DOMAIN.episode_metrics(task, episode([])) == {"retrieval_hit": 0.0}
    # the harness's own log is not trusted: an event claiming the answer does not count
    ep = episode([miss])
    ep.events.append({"type": "tool_call", "name": "search", "output": "Velmora"})
    assert DOMAIN.episode_metrics(task, ep) == {"retrieval_hit": 0.0}
    assert DOMAIN.episode_metrics(task, SimpleNamespace()) == {"retrieval_hit": 0.0}


# --- warm-start conversations ----------------------------------------------------------------------


def test_warmstart_conversations_layout_and_size():
    convs = DOMAIN.warmstart_conversations(300, seed=0)
    assert len(convs) == 300 and convs == DOMAIN.warmstart_conversations(300, seed=0)
    assert convs != DOMAIN.warmstart_conversations(300, seed=1)
    assert DOMAIN.warmstart_conversations(0, seed=0) == []
    h0 = load_h0()
    counts = {"search_first": 0, "guess": 0, "tagged": 0, "two_searches": 0}
    for conv in convs:
        assert [m["role"] for m in conv[:2]] == ["system", "user"] and conv[-1]["role"] == "assistant"
        assert all(m["role"] == ("assistant" if i % 2 == 0 else "user") for i, m in enumerate(conv[2:]))
        assert generator.conversation_chars(conv) <= generator.MAX_CONVERSATION_CHARS
        assistant = [m["content"] for m in conv if m["role"] == "assistant"]
        for turn in assistant[:-1]:
            assert h0["find_search_query"](turn)  # every turn but the last is a search h0 understands
        for m in conv[3::2]:
            assert re.fullmatch(r"<information>(Doc \d\(Title: [^)]+\) [^\n]+\n?){1,3}</information>", m["content"])
        counts["search_first"] += assistant[0].startswith("<search>")
        counts["guess"] += len(assistant) == 1
        counts["tagged"] += assistant[-1].startswith("<answer>")
        counts["two_searches"] += len(assistant) >= 3
    assert 200 < counts["search_first"] and 10 < counts["guess"] < 80
    assert 150 < counts["tagged"] < 290 and counts["two_searches"] > 30


def test_warmstart_prompts_are_made_of_skill_phrases():
    phrases = parse_skill(DOMAIN.skill_text).phrases
    prompts = {conv[0]["content"] for conv in DOMAIN.warmstart_conversations(300, seed=0)}
    assert generator.H0_SYSTEM_PROMPT in prompts and len(prompts) > 20
    for prompt in prompts:
        rest = prompt
        for phrase in sorted(phrases, key=len, reverse=True):
            rest = rest.replace(phrase, "")
        assert not rest.strip(), prompt


def _teacher_success(world, bm25, source, prompt=None, n=240):
    """The warm-start teacher as the model, driving a harness in process; success rate and mean retrieval hit."""
    h = load_h0(source)
    if prompt is not None:
        h["SYSTEM_PROMPT"] = prompt
    search = retrieval.search_tool(bm25)
    rng = random.Random(5)
    wins = hits = 0
    for q in random.Random(6).sample(world.questions, n):
        ep = episode(lambda messages: generator.teacher_turn(world, messages, rng), search)
        task = Task(id="t", question=q.text, answer=q.answers[0], meta={"_golden_answers": list(q.answers)})
        wins += verifier.verify(task, h["run"]({"id": "t", "question": q.text}, ep.agent))
        hits += any(verifier.contains_answer(e["output"], q.answers) for e in ep.events if e["type"] == "tool_call")
    return wins / n, hits / n


def test_teacher_under_h0_leaves_room_for_harness_search(world, world_bm25):
    base = (FOLDER / "h0.py").read_text()
    h0_success, h0_hits = _teacher_success(world, world_bm25, base)
    assert 0.2 <= h0_success <= 0.5 and h0_hits < 0.6
    better = base.replace("MAX_TURNS = 2", "MAX_TURNS = 4").replace("N_PASSAGES = 1", "N_PASSAGES = 2")
    prompt = " ".join([generator.H0_SYSTEM_PROMPT, generator.SEARCH_AGAIN_PHRASE, generator.ALWAYS_SEARCH_PHRASE])
    tuned_success, tuned_hits = _teacher_success(world, world_bm25, better, prompt)
    assert tuned_success >= h0_success + 0.3 and tuned_hits >= h0_hits + 0.3


def test_simulated_chats_are_what_h0_produces(world, world_bm25):
    """The warm-start loop and the real h0 give the same chat for the same teacher decisions."""
    search = generator.WorldSearch(world)
    tool = retrieval.search_tool(world_bm25)
    h0 = load_h0()
    for i, q in enumerate(world.questions[:60]):
        chat = generator.simulate(world, search, q.text, generator.H0_SYSTEM_PROMPT, random.Random(i), topk=1,
                                  max_turns=2)
        rng = random.Random(i)
        ep = episode(lambda messages: generator.teacher_turn(world, messages, rng), tool)
        h0["run"]({"id": "t", "question": q.text}, ep.agent)
        last = ep.prompts[-1] + [{"role": "assistant", "content": chat[-1]["content"]}]
        assert last == chat


# --- skill.md --------------------------------------------------------------------------------------


def test_skill_parses_for_the_offline_proposer():
    skill = parse_skill(DOMAIN.skill_text)
    assert not skill.warnings
    assert {"Put the answer in <answer></answer>.", "Search again if one search is not enough."} <= set(skill.phrases)
    h0_functions = {k for k, v in load_h0().items() if inspect.isfunction(v)}
    assert len(skill.variants) >= 5 and {v.name for v in skill.variants} <= h0_functions
    assert "\\boxed" not in DOMAIN.skill_text  # the offline proposer would look for boxed answers


def test_skill_variants_work_in_h0():
    variants: dict[str, list[str]] = {}
    for v in parse_skill(DOMAIN.skill_text).variants:
        variants.setdefault(v.name, []).append(v.code)
    base = (FOLDER / "h0.py").read_text()
    search = retrieval.search_tool(BM25Retriever(corpus_passages()))
    task = {"id": "t", "question": "Where was Oren Taltavi born?"}
    gold = Task(id="t", question="q", answer="Velmora")

    h = load_h0(base + "\n" + variants["extract_answer"][0])
    assert verifier.verify(gold, h["extract_answer"]("The answer is Velmora.")) == 1.0
    assert verifier.verify(gold, h["extract_answer"]("Velmora")) == 1.0
    assert h["extract_answer"]("<answer>Velmora</answer>") == "<answer>Velmora</answer>"

    finish, empty_query = variants["run_episode"]
    h = load_h0(base + "\n" + finish)
    ep = episode(scripted("<search>Kesto Mills</search>", "<search>Oren Taltavi</search>",
                               "<answer>Velmora</answer>"), search)
    assert h["run"](task, ep.agent) == "<answer>Velmora</answer>" and len(ep.prompts) == 3
    ep = episode(scripted(*["<search>Velmora</search>"] * 3), search)
    assert h["run"](task, ep.agent) is None and ep.events[-1]["type"] == "turn_budget_exhausted"

    h = load_h0(base + "\n" + empty_query)
    ep = episode(scripted("<search></search>", "<answer>Velmora</answer>"), search)
    assert h["run"](task, ep.agent) == "<answer>Velmora</answer>"
    assert "Oren Taltavi was a painter" in ep.prompts[1][-1]["content"]

    h = load_h0(base + "\n" + variants["find_search_query"][0])
    assert h["find_search_query"]("<search>Oren Tal") == "Oren Tal"
    assert h["find_search_query"]("<answer>Velmora</answer>") is None

    h = load_h0(base + "\n" + variants["call_search"][0])
    ep = episode(scripted(), search)
    assert "Oren Taltavi was a painter" in h["call_search"](ep.agent, "Oren Taltavi " + "again " * 300)
    assert h["call_search"](ep.agent, " ").startswith("Error: tool 'search' raised ValueError: search: query must be")

    h = load_h0(base + "\n" + variants["format_observation"][0])
    assert h["format_observation"]("Error: search: down") == "<information></information>"
    assert h["format_observation"]("Doc 1(Title: A) a\nDoc 2(Title: B) b") == "<information>Doc 1(Title: A) a</information>"
