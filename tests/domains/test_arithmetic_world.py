"""The arithmetic world (domains/math_reasoning/arithmetic): its generator, h0 against the verifier, the
warm-start that follows h0's chat, and skill.md's variants through the offline proposer."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from domains.math_reasoning import verifier
from domains.math_reasoning.arithmetic import DOMAIN, generator
from tests.helpers import check_skill_variants, load_harness, safe_eval
from tests.inprocess_agent import InProcessEpisode
from whale_ray.config import DataConfig
from whale_ray.domain import Splits, get_domain
from whale_ray.proposers.skill import parse_skill
from whale_ray.records import Task

FOLDER = DOMAIN.folder
SIZES = {"weight": 160, "harness": 48, "val": 32, "test": 32}


def h0(source: str | None = None) -> dict:
    return load_harness(FOLDER, source)


def with_variant(name: str) -> dict:
    variant = next(v for v in parse_skill(DOMAIN.skill_text).variants if v.name == name)
    return h0((FOLDER / "h0.py").read_text() + "\n" + variant.code)


def episode(completions: list[str]) -> InProcessEpisode:
    """The sandbox's real Agent in process, replaying `completions`, with the world's real python tool."""
    return InProcessEpisode(list(completions), tools_path=DOMAIN.sandbox_tools_path)


def score(answer: str | None, gold: int) -> float:
    return verifier.verify(Task(id="t", question="q", answer=str(gold)), answer)


# --- the generator -------------------------------------------------------------------------------------------


def test_registered_beside_math_with_its_verifier_and_tool():
    assert get_domain("domains.math_reasoning.arithmetic") is DOMAIN
    assert DOMAIN.difficulty_field == "level" and DOMAIN.sandbox_tools_path.is_file()
    assert DOMAIN.verify(Task(id="t", question="q", answer="61"), "The answer is \\boxed{61}.") == 1.0
    splits = DOMAIN.load_splits(DataConfig(n_weight=8, n_harness=4, n_val=4, n_test=4), seed=0)
    assert splits.sizes() == {"weight": 8, "harness": 4, "val": 4, "test": 4}


@pytest.mark.parametrize("level", [1, 2, 3])
def test_levels(level):
    import random

    rng = random.Random(level)
    for _ in range(300):
        q = generator.draw_question(rng, level)
        assert q.level == level and len(q.ops) == (2 if level == 3 else 1)
        assert safe_eval(q.expression) == q.answer >= 0
        words = re.fullmatch(r"What is (\d+) (plus|minus|times) (\d+)(?: (plus|minus) (\d+))?\?", q.text)
        assert words, q.text
        if level == 1:
            assert all(2 <= n <= 20 for n in q.numbers) and q.ops[0] != "*"
        elif level == 2 and q.ops == ("*",):
            assert all(2 <= n <= 12 for n in q.numbers)
        elif level == 2:
            assert all(10 <= n <= 99 for n in q.numbers)


def test_splits_deterministic_disjoint_graded_and_public():
    a, b = generator.generate_splits(SIZES, 0), generator.generate_splits(SIZES, 0)
    assert a == b and a != generator.generate_splits(SIZES, 1)
    Splits(**a)  # raises when a question is in two splits
    questions = [t.question for split in a.values() for t in split]
    assert len(set(questions)) == len(questions) == sum(SIZES.values())
    assert not any(generator.is_warmstart_question(q) or q in generator.EXAMPLE_QUESTIONS for q in questions)
    assert {t.meta["level"] for t in a["weight"]} == {1, 2, 3}
    for t in a["weight"]:
        assert t.public() == {"id": t.id, "question": t.question, "level": t.meta["level"], "steps": t.meta["steps"]}
        assert safe_eval(t.meta["_expression"]) == int(t.answer)
    # D_test depends only on the seed and its own size
    assert generator.generate_splits({**SIZES, "weight": 3}, 0)["test"] == a["test"]


# --- h0 and the verifier ------------------------------------------------------------------------------------


def test_h0_states_the_format_and_shows_one_example():
    h = h0()
    ep = episode(["34 + 27 = 61. The answer is \\boxed{61}."])
    answer = h["run"]({"id": "t", "question": "What is 34 plus 27?", "level": 2, "steps": 1}, ep.agent)
    assert score(answer, 61) == 1.0
    [messages] = ep.prompts
    assert messages[0] == {"role": "system", "content": "Answer the question. Put the final answer in \\boxed{}."}
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[-1]["content"] == "What is 34 plus 27?"
    assert ep.sampling[0]["max_tokens"] == 32 and ep.sampling[0]["temperature"] == 1.0


def test_h0_weaknesses_a_harness_change_fixes():
    # an unboxed right answer scores 0 under h0, 1 with skill.md's extract_answer
    assert score(h0()["run"]({"id": "t", "question": "Q"}, episode(["The answer is 61."]).agent), 61) == 0.0
    fixed = with_variant("extract_answer")
    assert score(fixed["run"]({"id": "t", "question": "Q"}, episode(["The answer is 61."]).agent), 61) == 1.0
    assert score(fixed["extract_answer"]("34 + 27 = 61"), 61) == 1.0
    # every worked example, with the build_messages variant
    ep = episode(["\\boxed{1}"])
    with_variant("build_messages")["run"]({"id": "t", "question": "Q"}, ep.agent)
    assert len(ep.prompts[0]) == 2 + 2 * len(generator.EXAMPLES)
    # a completion cut at max_tokens is asked again with twice the budget
    ep = InProcessEpisode(["34 + 27 = 61. The answer is \\boxed{61}."] * 2, finish_reason="length")
    with_variant("run_episode")["run"]({"id": "t", "question": "Q"}, ep.agent)
    assert [s["max_tokens"] for s in ep.sampling] == [32, 64]


def test_h0_tool_protocol_in_words():
    h = h0((FOLDER / "h0.py").read_text().replace("OFFER_TOOLS = False", "OFFER_TOOLS = True"))
    ep = episode(["```python\nprint(34 + 27)\n```", "The answer is \\boxed{61}."])
    assert score(h["run"]({"id": "t", "question": "What is 34 plus 27?"}, ep.agent), 61) == 1.0
    assert "```python block that prints the result" in ep.prompts[0][0]["content"]
    assert ep.prompts[1][-1] == {"role": "user", "content": "Output: 61"}
    # without the tool offered, a python block is the answer (and scores 0)
    assert h0()["run"]({"id": "t", "question": "Q"}, episode(["```python\nprint(1)\n```"]).agent).startswith("```")


def test_warmstart_follows_h0s_chat():
    h = h0()
    assert (h["SYSTEM_PROMPT"], h["TOOL_PROTOCOL"], h["EXAMPLES"]) == (
        generator.SYSTEM_PROMPT, generator.TOOL_PROTOCOL, generator.EXAMPLES)
    conversations = DOMAIN.warmstart_conversations(400, seed=0)
    assert conversations == DOMAIN.warmstart_conversations(400, seed=0)
    tool_source = (FOLDER / "h0.py").read_text().replace("OFFER_TOOLS = False", "OFFER_TOOLS = True")
    laid_out = 0
    for conv in conversations:
        question = next(m for m in conv[1:] if m["role"] == "user" and m["content"] not in generator.EXAMPLE_QUESTIONS)
        opening = conv[: conv.index(question) + 1]
        tool = generator.TOOL_PROTOCOL in conv[0]["content"]
        n_examples = (len(opening) - 2) // 2
        if conv[0]["content"].startswith(generator.SYSTEM_PROMPT):  # h0's prompt: h0's exact chat
            source = (tool_source if tool else (FOLDER / "h0.py").read_text()).replace(
                "N_EXAMPLES = 1", f"N_EXAMPLES = {n_examples}")
            assert h0(source)["build_messages"]({"question": question["content"]}) == opening
            laid_out += 1
        assert generator.is_warmstart_question(question["content"])
        assert re.search(r"The answer is (\\boxed\{-?\d+\}|-?\d+)\.$", conv[-1]["content"]), conv[-1]
    assert laid_out > 50


# --- skill.md -------------------------------------------------------------------------------------------------


def test_skill_variants_parse_and_the_offline_proposer_applies_them(tmp_path: Path):
    check_skill_variants(DOMAIN, generator.SYSTEM_PROMPTS, tmp_path / "archive")
