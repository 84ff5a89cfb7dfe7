"""The math_reasoning domain: loaders, splits, generator, warm-start formats, verifier, tool, h0, skill."""

from __future__ import annotations

import ast
import inspect
import json
import logging
import operator
import random
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from domains.math_reasoning import DOMAIN, MathDomain, data, generator, tools, verifier
from tests.helpers import load_harness, safe_eval
from tests.inprocess_agent import InProcessEpisode
from whale_ray.config import DataConfig
from whale_ray.domain import DataError, Domain, Splits, get_domain
from whale_ray.records import Task

FOLDER = Path(__file__).resolve().parents[2] / "domains" / "math_reasoning"
H0_KNOBS = {
    "SYSTEM_PROMPT": generator.SYSTEM_PROMPTS[0],
    "MAX_TURNS": 2,
    "MAX_TOKENS": 48,
    "TEMPERATURE": 1.0,
    "TOP_K": 20,
    "N_VOTES": 1,
    "OFFER_TOOLS": True,
}


# --- helpers ---------------------------------------------------------------------------------------

def dapo_row(question, answer, index, prompt_text=None):
    return {
        "data_source": "math_dapo",
        "prompt": [{"role": "user", "content": prompt_text if prompt_text is not None else question}],
        "ability": "MATH",
        "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": index},
    }


def write_dapo(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def load_h0(source: str | None = None) -> dict:
    return load_harness(FOLDER, source)


def episode(completions, **kwargs) -> InProcessEpisode:
    """The sandbox's real Agent in process, replaying `completions`, with the domain's real python tool."""
    return InProcessEpisode(list(completions), tools_path=DOMAIN.sandbox_tools_path, **kwargs)


# --- the domain object -----------------------------------------------------------------------------


def test_domain_object():
    assert isinstance(DOMAIN, MathDomain) and isinstance(DOMAIN, Domain)
    assert get_domain("math_reasoning") is DOMAIN
    assert DOMAIN.name == "math_reasoning"
    assert DOMAIN.folder == FOLDER
    assert DOMAIN.h0_path.is_file() and DOMAIN.sandbox_tools_path.is_file()
    assert "## Function variants" in DOMAIN.skill_text
    task = Task(id="t", question="q", answer="14")
    assert DOMAIN.verify(task, "so \\boxed{14}") == 1.0
    assert DOMAIN.verify(task, "The answer is 14.") == 0.0
    assert DOMAIN.verify(task, None) == 0.0


# --- loaders ---------------------------------------------------------------------------------------


def test_dapo_parquet(tmp_path):
    wrapped = data.DAPO_PROMPT_PREFIX + "What is 2+3?" + data.DAPO_PROMPT_SUFFIX
    path = write_dapo(tmp_path / "dapo.parquet", [
        dapo_row("What is 1+1?", "2", "a"),
        dapo_row(None, "5", "b", prompt_text=wrapped),
        dapo_row("What is 1+1?", "2", "c"),  # repeated question: kept once
    ])
    tasks = data.load_tasks(path)
    assert [(t.id, t.question, t.answer) for t in tasks] == [
        ("dapo-a", "What is 1+1?", "2"), ("dapo-b", "What is 2+3?", "5"),
    ]
    assert tasks[0].meta == {"source": "math_dapo"}


def test_dapo_without_extra_info_uses_row_numbers(tmp_path):
    rows = [{"prompt": [{"role": "system", "content": "sys"}, {"role": "user", "content": f"q{i}"}],
             "reward_model": {"ground_truth": str(i)}} for i in range(3)]
    tasks = data.load_tasks(write_dapo(tmp_path / "train.parquet", rows))
    assert [(t.id, t.question, t.answer) for t in tasks] == [(f"train-{i}", f"q{i}", str(i)) for i in range(3)]


def test_aime_parquet_and_jsonl(tmp_path):
    pq.write_table(pa.table({"ID": ["2024-I-1", "2024-I-2"], "Problem": ["P one", "P two"], "Answer": [204, 25]}),
                   tmp_path / "aime_2024.parquet")
    tasks = data.load_tasks(tmp_path / "aime_2024.parquet")
    assert [(t.id, t.question, t.answer) for t in tasks] == [("aime_2024-2024-I-1", "P one", "204"),
                                                            ("aime_2024-2024-I-2", "P two", "25")]
    path = write_jsonl(tmp_path / "aime_2025.jsonl", [
        json.dumps({"problem": "Q a", "answer": 70}), "", json.dumps({"problem": "Q b", "answer": "588"}),
    ])
    tasks = data.load_tasks(path)
    assert [(t.id, t.question, t.answer) for t in tasks] == [("aime_2025-0", "Q a", "70"), ("aime_2025-1", "Q b", "588")]


def test_missing_file_and_wrong_extension(tmp_path):
    with pytest.raises(DataError, match=r"data file .*nope\.parquet: not found"):
        data.load_tasks(tmp_path / "nope.parquet")
    (tmp_path / "x.csv").write_text("Problem,Answer\n")
    with pytest.raises(DataError, match=r"x\.csv: unsupported extension '\.csv'"):
        data.load_tasks(tmp_path / "x.csv")


def test_unreadable_parquet(tmp_path):
    (tmp_path / "bad.parquet").write_bytes(b"this is not parquet")
    with pytest.raises(DataError, match=r"bad\.parquet: not a readable parquet file") as e:
        data.load_tasks(tmp_path / "bad.parquet")
    assert "\n" not in str(e.value)


def test_missing_column(tmp_path):
    path = tmp_path / "x.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": [{"role": "user", "content": "q"}]}]), path)
    with pytest.raises(DataError, match=r"data file .*x\.parquet: missing column 'reward_model'"):
        data.load_tasks(path)
    pq.write_table(pa.table({"Problem": ["q"]}), path)
    with pytest.raises(DataError, match=r"missing column 'Answer'"):
        data.load_tasks(path)
    pq.write_table(pa.table({"Answer": ["1"]}), path)
    with pytest.raises(DataError, match=r"missing column 'Problem'"):
        data.load_tasks(path)


def test_rows_missing_a_field_are_skipped_with_a_count(tmp_path, caplog):
    path = write_dapo(tmp_path / "dapo.parquet", [
        dapo_row("ok one", "1", "a"),
        dapo_row("no answer", None, "b"),
        dapo_row("", "3", "c"),
        dapo_row("ok two", "4", "d"),
    ])
    with caplog.at_level(logging.WARNING, logger="domains.math_reasoning.data"):
        tasks = data.load_tasks(path)
    assert [t.question for t in tasks] == ["ok one", "ok two"]
    text = caplog.text
    assert "dapo.parquet: row 1: missing or empty answer" in text
    assert "dapo.parquet: row 2: missing or empty question" in text
    assert "skipped 2 of 4 rows" in text

    caplog.clear()
    path = write_jsonl(tmp_path / "aime.jsonl", [json.dumps({"Problem": "p", "Answer": None}),
                                                 json.dumps({"Problem": "q", "Answer": 5})])
    with caplog.at_level(logging.WARNING, logger="domains.math_reasoning.data"):
        assert [t.answer for t in data.load_tasks(path)] == ["5"]
    assert "aime.jsonl: line 1: missing or empty answer" in caplog.text and "skipped 1 of 2" in caplog.text


def test_all_rows_bad(tmp_path):
    path = write_dapo(tmp_path / "dapo.parquet", [dapo_row("q", None, "a"), dapo_row("q2", "", "b")])
    with pytest.raises(DataError, match=r"dapo\.parquet: no usable rows \(2 of 2 skipped\)"):
        data.load_tasks(path)


def test_bad_jsonl_line_is_named(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [json.dumps({"Problem": "p", "Answer": 1}), "{not json"])
    with pytest.raises(DataError, match=r"t\.jsonl: line 2 is not valid JSON"):
        data.load_tasks(path)
    path = write_jsonl(tmp_path / "t.jsonl", [json.dumps([1, 2]), json.dumps([3])])  # JSON Lines, of arrays
    with pytest.raises(DataError, match=r"line 1 is not a JSON object"):
        data.load_tasks(path)


# --- splits ----------------------------------------------------------------------------------------


def _file_config(tmp_path, n_train=60, **sizes):
    train = write_dapo(tmp_path / "dapo.parquet", [dapo_row(f"train question {i}", str(i), str(i)) for i in range(n_train)]
                       + [dapo_row("shared with the test", "7", "shared")])
    pq.write_table(pa.table({"ID": [1, 2], "Problem": ["aime a", "shared with the test"], "Answer": [3, 7]}),
                   tmp_path / "aime24.parquet")
    write_jsonl(tmp_path / "aime25.jsonl", [json.dumps({"id": "x", "problem": "aime b", "answer": 9})])
    return DataConfig(source="files", train_path=train, test_paths=[tmp_path / "aime24.parquet", tmp_path / "aime25.jsonl"],
                      **sizes)


def test_file_splits_disjoint_and_sized(tmp_path):
    cfg = _file_config(tmp_path, n_weight=30, n_harness=10, n_val=5)
    splits = DOMAIN.load_splits(cfg, seed=3)
    assert splits.sizes() == {"weight": 30, "harness": 10, "val": 5, "test": 3}
    assert sorted(t.question for t in splits.test) == ["aime a", "aime b", "shared with the test"]
    train_q = [t.question for s in (splits.weight, splits.harness, splits.val) for t in s]
    assert len(set(train_q)) == len(train_q) == 45 and "shared with the test" not in train_q
    again = DOMAIN.load_splits(cfg, seed=3)
    assert [t.id for t in again.val] == [t.id for t in splits.val]
    other = DOMAIN.load_splits(cfg, seed=4)
    assert [t.id for t in other.val] != [t.id for t in splits.val]


def test_file_splits_honour_n_test(tmp_path):
    splits = DOMAIN.load_splits(_file_config(tmp_path, n_weight=30, n_harness=10, n_val=5, n_test=2), seed=3)
    assert len(splits.test) == 2
    assert sorted(t.meta["source"] for t in splits.test) == ["aime24", "aime25"]  # spread over the test files
    train_q = {t.question for s in (splits.weight, splits.harness, splits.val) for t in s}
    assert not train_q & {"aime a", "shared with the test", "aime b"}  # test problems left out stay out of training


def test_file_splits_weight_gets_the_rest(tmp_path):
    splits = DOMAIN.load_splits(_file_config(tmp_path, n_train=20, n_weight=100, n_harness=8, n_val=4), seed=0)
    assert splits.sizes() == {"weight": 8, "harness": 8, "val": 4, "test": 3}
    with pytest.raises(DataError, match="too few"):
        DOMAIN.load_splits(_file_config(tmp_path, n_train=20, n_harness=16, n_val=4), seed=0)


def test_generated_splits_disjoint_and_sized():
    cfg = DataConfig(n_weight=400, n_harness=100, n_val=50, n_test=50)
    splits = DOMAIN.load_splits(cfg, seed=0)
    assert isinstance(splits, Splits)
    assert splits.sizes() == {"weight": 400, "harness": 100, "val": 50, "test": 50}
    questions = [t.question for role in ("weight", "harness", "val", "test") for t in getattr(splits, role)]
    assert len(set(questions)) == len(questions)
    assert splits.test[0].id == "gen-test-0" and splits.weight[399].id == "gen-weight-399"
    # D_test depends only on the seed and n_test
    small = DOMAIN.load_splits(DataConfig(n_weight=5, n_harness=5, n_val=5, n_test=50), seed=0)
    assert [t.question for t in small.test] == [t.question for t in splits.test]


# --- generator -------------------------------------------------------------------------------------


def test_generator_deterministic():
    sizes = {"weight": 50, "harness": 10, "val": 10, "test": 10}
    assert generator.generate_splits(sizes, 7) == generator.generate_splits(sizes, 7)
    assert generator.generate_splits(sizes, 7) != generator.generate_splits(sizes, 8)
    assert generator.warmstart_conversations(20, 1) == generator.warmstart_conversations(20, 1)


def test_generator_answers_are_right():
    tasks = generator.generate_splits({"weight": 500, "harness": 0, "val": 0, "test": 0}, 0)["weight"]
    steps = [t.meta["steps"] for t in tasks]
    assert set(steps) == {1, 2, 3, 4} and steps.count(1) + steps.count(2) > len(tasks) / 2
    for t in tasks:
        assert set(t.meta) == {"steps", "_expression"} and "_expression" not in t.public()
        assert "answer" not in t.public()
        assert safe_eval(t.meta["_expression"]) == int(t.answer)
        assert 0 <= int(t.answer) < 100
        assert len(re.findall(r" [-+*] ", t.meta["_expression"])) == t.meta["steps"]
        assert t.question.endswith("now?")


def test_generator_steps_stay_small():
    rng = random.Random(0)
    for _ in range(2000):
        p = generator.draw_problem(rng)
        assert 1 <= len(p.steps) <= 4
        value = p.steps[0].left
        assert 1 <= value <= 20
        for s in p.steps:
            assert s.left == value
            assert 1 <= s.right <= 20 and 0 <= s.result < 100
            assert s.result == {"+": operator.add, "-": operator.sub, "*": operator.mul}[s.op](s.left, s.right)
            value = s.result
        assert safe_eval(p.expression) == p.answer


# --- warm-start conversations ----------------------------------------------------------------------

_TOOL_TURN = re.compile(r"```python\nprint\((.+)\)\n```")
_STEP = re.compile(r"(\d+) ([-+*]) (\d+) = (\d+)")


def _answer_of(text: str) -> int:
    m = re.fullmatch(r"\\boxed\{(\d+)\}", text) or re.fullmatch(r"The answer is (\d+)\.", text)
    assert m, text
    return int(m.group(1))


def test_warmstart_formats():
    convs = DOMAIN.warmstart_conversations(600, seed=0)
    assert len(convs) == 600
    counts = {"tool": 0, "whole": 0, "multi": 0, "plain": 0, "free": 0, "systems": set()}
    for conv in convs:
        system, user, *turns = conv
        assert system["role"] == "system" and system["content"] in generator.SYSTEM_PROMPTS
        assert user["role"] == "user" and user["content"].endswith("now?")
        assert generator.is_warmstart_question(user["content"])
        counts["systems"].add(system["content"])
        prompt = system["content"]
        asked = "\\boxed" in prompt
        assert [m["role"] for m in turns] == ["assistant", "user"] * (len(turns) // 2) + ["assistant"]
        if "python" in prompt.lower():
            counts["tool"] += 1
            calls, observations = turns[:-1:2], turns[1::2]
            for call, obs in zip(calls, observations):
                code = _TOOL_TURN.fullmatch(call["content"])
                assert code, call["content"]
                assert obs["content"] == f"Output: {safe_eval(code.group(1))}"
            final = _answer_of(turns[-1]["content"])
            assert turns[-2]["content"] == f"Output: {final}"
            first_expr = _TOOL_TURN.fullmatch(calls[0]["content"]).group(1)
            n_ops = len(re.findall(r" [-+*] ", first_expr))
            if len(calls) == 1 and n_ops > 1:
                counts["whole"] += 1  # the whole expression in one call
            else:
                assert n_ops == 1  # one step per call: n steps, n + 1 assistant turns
            if n_ops > 1 or len(calls) > 1:
                counts["multi"] += 1
        else:
            assert len(turns) == 1
            *steps, answer = turns[0]["content"].split(" . ")
            value = None
            for step in steps:
                a, op, b, r = _STEP.fullmatch(step).groups()
                assert value is None or int(a) == value
                assert int(r) == safe_eval(f"{a} {op} {b}")
                value = int(r)
            assert _answer_of(answer) == value
        plain = turns[-1]["content"].endswith(".") and "The answer is" in turns[-1]["content"]
        if asked:
            assert not plain  # asked for \boxed{}: always boxed
        else:
            counts["free"] += 1
            counts["plain"] += plain
        assert len(" ".join(m["content"] for m in conv).split()) < 110  # short: fits the tiny model's context
    assert counts["systems"] == set(generator.SYSTEM_PROMPTS)
    assert 0.05 < counts["whole"] / counts["multi"] < 0.3
    assert abs(counts["plain"] / counts["free"] - generator.PLAIN_ANSWER_RATE) < 0.15


def test_warmstart_questions_never_in_generated_splits():
    convs = generator.warmstart_conversations(300, seed=0)
    assert all(generator.is_warmstart_question(c[1]["content"]) for c in convs)
    splits = generator.generate_splits({"weight": 300, "harness": 50, "val": 50, "test": 50}, 0)
    assert not any(generator.is_warmstart_question(t.question) for ts in splits.values() for t in ts)


def test_example_tool_conversation_is_exact():
    p = generator.Problem(
        question="Ann has 12 apples. She buys 7 more. She gives away 5. How many apples does Ann have now?",
        steps=(generator.Step(12, "+", 7, 19), generator.Step(19, "-", 5, 14)), expression="12 + 7 - 5")
    conv = generator.conversation(p, "Solve the problem. You can run python.", whole_expression=False, boxed=True)
    assert [m["content"] for m in conv[2:]] == [
        "```python\nprint(12 + 7)\n```", "Output: 19", "```python\nprint(19 - 5)\n```", "Output: 14", "\\boxed{14}"]
    conv = generator.conversation(p, "Solve the problem. You can run python.", whole_expression=True, boxed=False)
    assert [m["content"] for m in conv[2:]] == ["```python\nprint(12 + 7 - 5)\n```", "Output: 14", "The answer is 14."]
    conv = generator.conversation(p, "Solve the problem.", whole_expression=False, boxed=True)
    assert [m["content"] for m in conv[2:]] == ["12 + 7 = 19 . 19 - 5 = 14 . \\boxed{14}"]


# --- verifier --------------------------------------------------------------------------------------


@pytest.mark.parametrize("response,gold,expected", [
    # what real models write around a correct integer inside the last box
    ("\\boxed{\\text{204}}", "204", 1.0),
    ("\\boxed{\\textbf{204}}", "204", 1.0),
    ("\\boxed{\\mathrm{204}}", "204", 1.0),
    ("\\boxed{\\textbf{\\text{204}}}", "204", 1.0),
    ("\\boxed{60^\\circ}", "60", 1.0),
    ("\\boxed{60^{\\circ}}", "60", 1.0),
    ("\\boxed{60°}", "60", 1.0),
    ("\\boxed{14 \\text{ cm}}", "14", 1.0),
    ("\\boxed{14\\text{ cm}^2}", "14", 0.0),  # a unit with a power is not taken off
    ("\\boxed{14 dollars}", "14", 1.0),
    ("\\boxed{x = 14}", "14", 1.0),
    ("\\boxed{n=14}", "14", 1.0),
    ("\\boxed{1{,}000}", "1000", 1.0),
    ("\\boxed{1\\,000}", "1000", 1.0),
    ("\\boxed{\u22127}", "-7", 1.0),  # a Unicode minus
    ("\\boxed{\\text{\u22127}}", "-7", 1.0),
    ("\\boxed{50\\%}", "50", 1.0),
    ("\\boxed{\\$14}", "14", 1.0),
    # only inside the last box, and never a different number
    ("\\text{204}", "204", 0.0),
    ("x = 204", "204", 0.0),
    ("\\boxed{x = 204} then \\boxed{3}", "204", 0.0),
    ("\\boxed{\\text{2040}}", "204", 0.0),
    ("\\boxed{x = 14 + 1}", "14", 0.0),
    ("\\boxed{\\text{east}}", "east", 0.0),  # text golds keep the exact string match
])
def test_verifier_normalises_inside_the_last_box(response, gold, expected):
    assert verifier.verify(Task(id="t", question="q", answer=gold), response) == expected



@pytest.mark.parametrize("response,gold,expected", [
    ("\\boxed{14}", "14", 1.0),
    ("so the result is \\boxed{ 14 }.", "14", 1.0),
    ("\\boxed{\\frac{1}{2}}", "1/2", 1.0),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1.0),
    ("\\boxed{0.5}", "1/2", 1.0),
    ("\\boxed{-\\frac{3}{4}}", "-0.75", 1.0),
    ("\\boxed{\\dfrac{2}{4}}", "1/2", 1.0),
    ("\\boxed{1,000}", "1000", 1.0),
    ("\\boxed{1000}", "1,000", 1.0),
    ("\\boxed{$14$}", "14", 1.0),
    ("\\boxed{14.}", "14", 1.0),
    ("\\boxed{+14}", "14", 1.0),
    ("\\boxed{1\\!000}", "1000", 1.0),
    ("\\boxed{14.0}", "14", 1.0),
    ("\\boxed{3} then \\boxed{14}", "14", 1.0),  # the last box counts
    ("\\boxed{14} then \\boxed{3}", "14", 0.0),
    ("\\boxed{\\boxed{14}}", "14", 1.0),
    ("\\boxed{x^{2}+1}", "x^{2} + 1", 1.0),  # non-numbers: whitespace-free string match
    ("\\boxed{15}", "14", 0.0),
    ("\\boxed{1/0}", "1/0", 1.0),
    ("\\boxed{1,00}", "100", 0.0),  # not a thousands grouping
    ("The answer is 14.", "14", 0.0),
    ("14", "14", 0.0),
    ("\\boxed{14", "14", 0.0),  # never closed
    ("\\boxed{}", "14", 0.0),
    ("", "14", 0.0),
    (None, "14", 0.0),
    ("\\boxed{14}", "\\boxed{14}", 1.0),  # a boxed gold is unwrapped
    ("\\boxed{204}", "204", 1.0),
])
def test_verifier(response, gold, expected):
    assert verifier.verify(Task(id="t", question="q", answer=gold), response) == expected


def test_last_boxed_nested_braces():
    assert verifier.last_boxed("a \\boxed{\\frac{1}{2}} b") == "\\frac{1}{2}"
    assert verifier.last_boxed("\\boxed{a} \\boxed{{b}}") == "{b}"
    assert verifier.last_boxed("none") is None


# --- the python tool -------------------------------------------------------------------------------


def test_tool_specs():
    spec = tools.TOOL_SPECS["python"]
    assert spec["description"]
    assert spec["parameters"]["properties"]["code"]["type"] == "string"
    assert spec["parameters"]["required"] == ["code"]


def test_tools_is_stdlib_only():
    tree = ast.parse((FOLDER / "tools.py").read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert imported <= {"__future__", "subprocess", "sys", "threading"}


def test_python_tool_output_and_errors():
    assert tools.python("print(12 + 7)") == "19\n"
    out = tools.python("1/0")
    assert "ZeroDivisionError" in out
    assert tools.python("print('x' * 5000)") == "x" * 1000
    assert tools.python("import sys; print('out'); print('err', file=sys.stderr)") == "out\nerr\n"
    with pytest.raises(TypeError):
        tools.python(123)
    with pytest.raises(TypeError):
        tools.python(None)
    with pytest.raises(ValueError):
        tools.python("print(1)\x00")


def test_python_tool_timeout(monkeypatch):
    monkeypatch.setattr(tools, "TIMEOUT_S", 0.5)
    assert tools.python("import time; time.sleep(3)") == "Error: timed out after 0.5 s"
    out = tools.python("while True: print(1)")
    assert len(out) <= 1000 and out.endswith("Error: timed out after 0.5 s")


# --- h0 --------------------------------------------------------------------------------------------


def test_h0_contract_and_knobs():
    source = (FOLDER / "h0.py").read_text()
    tree = ast.parse(source)
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not any(isinstance(n, ast.ImportFrom) for n in ast.walk(tree))
    assert imported <= {"re", "collections"}
    h0 = load_h0(source)
    assert list(inspect.signature(h0["run"]).parameters) == ["task", "agent"]
    knobs = {k: v for k, v in h0.items() if k.isupper()}
    assert knobs == H0_KNOBS
    assert all(type(knobs[k]) is type(v) for k, v in H0_KNOBS.items())
    for name in ("build_messages", "find_tool_call", "format_observation", "extract_answer", "run"):
        assert callable(h0[name])


def test_h0_shares_the_warmstart_formats():
    h0 = load_h0()
    assert h0["SYSTEM_PROMPT"] == generator.SYSTEM_PROMPTS[0]
    assert h0["find_tool_call"](generator.tool_call("12 + 7")) == "print(12 + 7)"
    assert h0["format_observation"](tools.python("print(12 + 7)")) == generator.observation(19)
    assert h0["extract_answer"]("The answer is 14.") == "The answer is 14."
    assert h0["build_messages"]({"id": "t", "question": "Q?"}) == [
        {"role": "system", "content": generator.SYSTEM_PROMPTS[0]}, {"role": "user", "content": "Q?"}]
    assert generator.TOOL_PROTOCOL in h0["SYSTEM_PROMPT"] and generator.BOXED_REQUEST in h0["SYSTEM_PROMPT"]


def test_h0_one_step_tool_episode():
    h0 = load_h0()
    ep = episode(["```python\nprint(12 + 7)\n```", "\\boxed{19}"])
    answer = h0["run"]({"id": "t", "question": "Q?"}, ep.agent)
    assert answer == "\\boxed{19}" and verifier.verify(Task(id="t", question="q", answer="19"), answer) == 1.0
    assert ep.prompts[1][-2:] == [{"role": "assistant", "content": "```python\nprint(12 + 7)\n```"},
                                     {"role": "user", "content": "Output: 19"}]
    assert ep.sampling[0] == {"max_tokens": 48, "temperature": 1.0, "top_k": 20, "top_p": 1.0, "stop": []}
    assert [e["type"] for e in ep.events] == ["tool_call"]


def test_h0_turn_budget_exhausted():
    h0 = load_h0()
    ep = episode(["```python\nprint(12 + 7)\n```", "```python\nprint(19 - 5)\n```"])
    assert h0["run"]({"id": "t", "question": "Q?"}, ep.agent) is None
    assert ep.events[-1]["type"] == "turn_budget_exhausted"
    assert len(ep.prompts) == 2


def test_h0_tool_error_becomes_the_observation():
    h0 = load_h0()
    def refuses(code):
        raise RuntimeError("sandbox says no")

    ep = episode(["```python\nprint(1)\n```", "The answer is 1."], local_tools={"python": refuses})
    assert h0["run"]({"id": "t", "question": "Q?"}, ep.agent) == "The answer is 1."
    assert ep.prompts[1][-1] == {"role": "user", "content": "Output: Error: tool 'python' raised RuntimeError: sandbox says no"}


def test_h0_votes():
    source = (FOLDER / "h0.py").read_text().replace("N_VOTES = 1", "N_VOTES = 3")
    h0 = load_h0(source)
    ep = episode(["\\boxed{5}", "so \\boxed{7}", "\\boxed{7}"])
    assert h0["run"]({"id": "t", "question": "Q?"}, ep.agent) == "so \\boxed{7}"
    ep = episode(["```python\nprint(1)\n```", "```python\nprint(1)\n```"] * 3)
    assert h0["run"]({"id": "t", "question": "Q?"}, ep.agent) is None


def test_h0_without_tools_returns_the_text():
    h0 = load_h0((FOLDER / "h0.py").read_text().replace("OFFER_TOOLS = True", "OFFER_TOOLS = False"))
    ep = episode(["```python\nprint(1)\n```"])
    assert h0["run"]({"id": "t", "question": "Q?"}, ep.agent) == "```python\nprint(1)\n```"


# --- skill.md --------------------------------------------------------------------------------------


def _sections(text: str) -> dict[str, str]:
    parts = re.split(r"^## (.+)$", text, flags=re.MULTILINE)
    return {parts[i].strip(): parts[i + 1] for i in range(1, len(parts), 2)}


def test_skill_layout_parses():
    sections = _sections(DOMAIN.skill_text)
    phrases = [line[2:].strip() for line in sections["Prompt phrases"].splitlines() if line.startswith("- ")]
    assert {"Put the final answer in \\boxed{}.", "You can run python.", generator.TOOL_PROTOCOL} <= set(phrases)
    variants = re.findall(r"^### (\w+): ([^\n]+)\n```python\n(.*?)^```$", sections["Function variants"],
                          flags=re.MULTILINE | re.DOTALL)
    assert len(variants) == sections["Function variants"].count("### ") >= 4
    h0_functions = {k for k, v in load_h0().items() if inspect.isfunction(v)}
    for name, hypothesis, code in variants:
        assert hypothesis.strip() and name in h0_functions
        tree = ast.parse(code)
        assert [n.name for n in tree.body if isinstance(n, ast.FunctionDef)] == [name]


def test_skill_phrases_cover_the_warmstart_prompts():
    phrases = [line[2:].strip() for line in _sections(DOMAIN.skill_text)["Prompt phrases"].splitlines()
               if line.startswith("- ")]
    for prompt in generator.SYSTEM_PROMPTS:  # every warm-start prompt is a concatenation of phrases
        rest = prompt
        for phrase in sorted(phrases, key=len, reverse=True):
            rest = rest.replace(phrase, "")
        assert not rest.strip(), prompt


def test_skill_variants_work_in_h0():
    sections = _sections(DOMAIN.skill_text)
    variants = dict((n, c) for n, _, c in re.findall(r"^### (\w+): ([^\n]+)\n```python\n(.*?)^```$",
                                                     sections["Function variants"], flags=re.MULTILINE | re.DOTALL))
    base = (FOLDER / "h0.py").read_text()
    task = {"id": "t", "question": "Q?"}

    h = load_h0(base + "\n" + variants["extract_answer"])
    assert verifier.verify(Task(id="t", question="q", answer="14"), h["extract_answer"]("The answer is 14.")) == 1.0
    assert verifier.verify(Task(id="t", question="q", answer="14"), h["extract_answer"]("12 + 7 = 19 . 19 - 5 = 14 .")) == 1.0
    assert h["extract_answer"]("\\boxed{3}") == "\\boxed{3}"
    assert h["extract_answer"]("no number") == "no number"

    h = load_h0(base + "\n" + variants["run_episode"])
    ep = episode(["```python\nprint(12 + 7)\n```", "```python\nprint(19 - 5)\n```"])
    assert h["run"](task, ep.agent) == "\\boxed{14}"
    assert ep.events[-1]["type"] == "turn_budget_exhausted"

    h = load_h0(base + "\n" + variants["find_tool_call"])
    assert h["find_tool_call"]("```python\nprint(1 + 2)") == "print(1 + 2)"
    assert h["find_tool_call"]("```python\nprint(1)\n```") == "print(1)"
    assert h["find_tool_call"]("no code") is None

    h = load_h0(base + "\n" + variants["format_observation"])
    assert h["format_observation"](tools.python("1/0")) == "Output: ZeroDivisionError: division by zero"
    assert h["format_observation"]("19\n") == "Output: 19"

    h = load_h0(base + "\n" + variants["build_messages"])
    assert "\\boxed{}" in h["build_messages"](task)[0]["content"]
