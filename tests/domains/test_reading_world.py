"""The reading world (domains/search_qa/reading): search_qa's data and verifier under a harness that searches for
the model, h0 against the real BM25 retriever and the verifier, the warm-start that follows h0's chat, and
skill.md's variants through the offline proposer."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from domains.search_qa import DOMAIN as SEARCH_QA
from domains.search_qa import generator, verifier
from domains.search_qa.reading import DOMAIN, warmstart
from domains.search_qa.retrieval import BM25Retriever
from tests.helpers import check_skill_variants, load_harness
from tests.inprocess_agent import InProcessEpisode
from whale_ray.config import DataConfig, load_config
from whale_ray.domain import get_domain
from whale_ray.proposers.skill import parse_skill
from whale_ray.records import Task
from whale_ray.resources import role_demands

FOLDER = DOMAIN.folder
H0 = (FOLDER / "h0.py").read_text()


@pytest.fixture(scope="module")
def world():
    return generator.eval_world(0)


@pytest.fixture(scope="module")
def search(world):
    return DOMAIN.host_tools({"retriever": BM25Retriever(world.passages)})["search"]


def harness(variant: str | None = None) -> dict:
    if variant is None:
        return load_harness(FOLDER)
    code = next(v for v in parse_skill(DOMAIN.skill_text).variants if v.name == variant).code
    return load_harness(FOLDER, H0 + "\n" + code)


def episode(completions: list[str], search, **kw) -> InProcessEpisode:
    """The sandbox's real Agent in process, replaying `completions`, with the real search tool over BM25."""
    return InProcessEpisode(list(completions), host_tools={"search": search}, **kw)


def score(question, answer: str | None) -> float:
    return verifier.verify(generator.to_task(question, "weight", 0), answer)


def test_registered_beside_search_qa_with_its_data_verifier_and_retriever():
    assert get_domain("domains.search_qa.reading") is DOMAIN
    assert DOMAIN.difficulty_field == "group" and DOMAIN.sandbox_tools_path == SEARCH_QA.sandbox_tools_path
    data = DataConfig(n_weight=8, n_harness=4, n_val=4, n_test=4)
    assert DOMAIN.load_splits(data, seed=0) == SEARCH_QA.load_splits(data, seed=0)
    task = Task(id="t", question="q", answer="Velmora")
    assert DOMAIN.verify(task, "<answer>the Velmora.</answer>") == 1.0 and DOMAIN.verify(task, "Velmora") == 0.0
    # its retriever is counted before a run starts, as search_qa's is
    demands = role_demands(load_config(None, {"domain": DOMAIN.name, "resources.retriever.num_cpus": 3}), trains=True,
                           cpus=8)
    assert demands["retriever"] == (1, {"CPU": 3.0})


def test_h0_searches_the_question_and_the_model_reads_the_text(world, search):
    q = next(q for q in world.questions if q.hops == 1 and q.answer_type == "city")
    ep = episode([f"<answer>{q.answers[0]}</answer>"], search)
    assert score(q, harness()["run"]({"id": "t", "question": q.text, "group": q.group}, ep.agent)) == 1.0
    assert [c["args"] for c in ep.tool_calls] == [{"query": q.text, "topk": 3}]
    [messages] = ep.prompts
    assert messages[0] == {"role": "system",
                           "content": "Answer the question from the text. Put the answer in <answer></answer>."}
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant", "user"]
    text, question = messages[-1]["content"].split("\nQuestion: ")
    answer_passage = next(p for p in world.passages if p.title == q.answer_title)
    lines = text.removeprefix("Text: ").split("\n")
    assert question == q.text and text.startswith("Text: ") and answer_passage.text in lines
    assert len(lines) == 3 and not any(line.startswith("Doc ") for line in lines)
    assert ep.sampling[0]["max_tokens"] == 32 and ep.sampling[0]["temperature"] == 1.0


def test_a_failed_search_leaves_the_model_an_empty_text_not_a_crash(world):
    def broken(query, topk=1):
        raise ConnectionError("retriever down")

    q = world.questions[0]
    ep = episode(["<answer>x</answer>"], broken)
    assert harness()["run"]({"id": "t", "question": q.text}, ep.agent) == "<answer>x</answer>"
    assert ep.prompts[0][-1]["content"] == f"Text: \nQuestion: {q.text}"
    assert any(e["type"] == "tool_error" for e in ep.events)


def test_h0_weaknesses_a_harness_change_fixes(world, search):
    q = next(q for q in world.questions if q.hops == 1)
    # an untagged right answer scores 0 under h0, 1 with skill.md's extract_answer
    stated = f"The answer is {q.answers[0]}."
    assert score(q, harness()["run"]({"id": "t", "question": q.text}, episode([stated], search).agent)) == 0.0
    assert score(q, harness("extract_answer")["run"]({"id": "t", "question": q.text},
                                                      episode([stated], search).agent)) == 1.0
    # a two-hop question's answer passage: never shown by h0's one search, often by the second search of find_text
    texts = {p.title: p.text for p in world.passages}
    two_hop = [q for q in world.questions if q.hops == 2][:100]

    def shown(h) -> float:
        return sum(texts[q.answer_title] in h["find_text"]({"question": q.text}, episode([], search).agent)
                   for q in two_hop) / len(two_hop)

    assert shown(harness()) == 0.0 and shown(harness("find_text")) > 0.3
    # a completion cut at max_tokens is asked again with twice the budget
    ep = episode(["<answer>Velm"] * 2, search, finish_reason="length")
    harness("run_episode")["run"]({"id": "t", "question": q.text}, ep.agent)
    assert [s["max_tokens"] for s in ep.sampling] == [32, 64]
    # the question ahead of the text as well as after it
    ep = episode(["<answer>x</answer>"], search)
    harness("format_turn")["run"]({"id": "t", "question": q.text}, ep.agent)
    assert ep.prompts[0][-1]["content"].startswith(f"Question: {q.text}\nText: ")


def test_the_worked_examples_name_no_entity_of_any_evaluation_world():
    for text, question, answer in load_harness(FOLDER)["EXAMPLES"]:
        names = re.findall(r"[A-Z][a-z]+(?: (?:[A-Z][a-z]+))*", text)
        for name in {answer, *[n for n in names if n not in {"In", "It"}]}:
            assert generator.is_warmstart_name(name), name


def test_warmstart_follows_h0s_chat_and_reads_warm_start_worlds_only():
    h = harness()
    assert h["SYSTEM_PROMPT"] in warmstart.SYSTEM_PROMPTS and h["EXAMPLES"] is not None
    conversations = DOMAIN.warmstart_conversations(300, seed=0)
    assert conversations == DOMAIN.warmstart_conversations(300, seed=0) != DOMAIN.warmstart_conversations(300, 1)
    laid_out = tagged = 0
    for conv in conversations:
        assert generator.conversation_chars(conv) <= generator.MAX_CONVERSATION_CHARS
        text, question = conv[-2]["content"].removeprefix("Text: ").split("\nQuestion: ")
        n_examples = (len(conv) - 3) // 2
        if conv[0]["content"] == h["SYSTEM_PROMPT"]:  # h0's prompt: h0's exact chat for that many examples
            source = H0.replace("N_EXAMPLES = 2", f"N_EXAMPLES = {n_examples}")
            assert load_harness(FOLDER, source)["build_messages"]({"question": question}, text) == conv[:-1]
            laid_out += 1
        titles = [t for t in re.findall(r"^([A-Z][a-z]+(?: [A-Z][a-z]+)*) (?:is|was)", text, re.M)]
        assert titles and all(generator.is_warmstart_name(t) for t in titles), text
        assert re.fullmatch(r"<answer>[^<]+</answer>|The answer is [^<]+\.", conv[-1]["content"]), conv[-1]
        tagged += conv[-1]["content"].startswith("<answer>")
    assert laid_out > 50 and 0.5 < tagged / len(conversations) < 0.95


def test_warmstart_conversations_are_the_same_in_every_process():
    # the embedded policy's cache key hashes a sample of them: a process-dependent order would rebuild it every run
    code = ("import hashlib, json; from domains.search_qa.reading import DOMAIN; "
            "print(hashlib.sha256(json.dumps(DOMAIN.warmstart_conversations(200, 0)).encode()).hexdigest())")
    root = Path(__file__).resolve().parents[2]
    digests = {subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True,
                              env={**os.environ, "PYTHONHASHSEED": str(h), "PYTHONPATH": str(root)}).stdout
               for h in (1, 2, 3)}
    assert len(digests) == 1, digests


def test_skill_variants_parse_and_the_offline_proposer_applies_them(tmp_path: Path):
    check_skill_variants(DOMAIN, warmstart.SYSTEM_PROMPTS, tmp_path / "archive")
