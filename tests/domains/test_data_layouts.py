"""Data files in the layouts they come in (docs/data.md): a top-level `ground_truth` beside `question` or `problem`,
verl's parquet (`prompt` as a chat list, `reward_model.ground_truth`, `data_source`, `extra_info`) for math and
search_qa, Search-R1's and nq_open's answer lists, and a JSON array in a file named .jsonl, told apart in the error.
Every file is made here; in process, no Ray."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from domains.math_reasoning import data as math_data
from domains.search_qa import data as search_data
from domains.search_qa import verifier
from domains.search_qa.retrieval import load_corpus
from whale_ray.config import DataConfig
from whale_ray.domain import DataError

# verl's examples/data_preprocess: math_dataset.py and gsm8k.py append these to the problem
VERL_MATH = "Let's think step by step and output the final answer within \\boxed{}."
VERL_GSM8K = 'Let\'s think step by step and output the final answer after "####".'
VERL_SEARCH = ("Answer the given question. You must conduct reasoning inside <think> and </think> first every time "
               "you get new information. ... For example, <answer> Beijing </answer>. Question: ")


def parquet(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def verl_row(content: str, truth, source: str, index: int, ability: str = "math", system: str | None = None) -> dict:
    prompt = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
    return {"data_source": source, "prompt": prompt, "ability": ability,
            "reward_model": {"style": "rule", "ground_truth": truth},
            "extra_info": {"split": "train", "index": index}}


# --- math ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("question", ["question", "problem"])
@pytest.mark.parametrize("truth", [["72", "1/2"], [72, 0.5]], ids=["string", "number"])
@pytest.mark.parametrize("write", [parquet, jsonl], ids=["parquet", "jsonl"])
def test_math_ground_truth_beside_question_or_problem(question, truth, write, tmp_path):
    rows = [{question: "How many eggs?", "ground_truth": truth[0]}, {question: "Half of one?", "ground_truth": truth[1]}]
    path = write(tmp_path / f"gt.{write.__name__}", rows)
    tasks = math_data.load_tasks(path)
    assert [(t.id, t.question, t.answer) for t in tasks] == [("gt-0", "How many eggs?", "72"),
                                                            ("gt-1", "Half of one?", str(truth[1]))]
    assert tasks[0].meta == {"source": "gt"}


def test_math_verl_parquet_loads_without_the_preprocessing_instructions(tmp_path):
    path = parquet(tmp_path / "train.parquet", [
        verl_row(f"What is $1+1$? {VERL_MATH}", "2", "DigitalLearningGmbH/MATH-lighteval", 0),
        verl_row(f"Tom has 3 apples and eats one. How many are left? {VERL_GSM8K}", "2", "openai/gsm8k", 7,
                 system="You are a helpful assistant."),
        verl_row("No instruction here.", "5", "openai/gsm8k", 8),
    ])
    tasks = math_data.load_tasks(path)
    assert [(t.id, t.question, t.answer, t.meta["source"]) for t in tasks] == [
        ("train-0", "What is $1+1$?", "2", "DigitalLearningGmbH/MATH-lighteval"),
        ("train-7", "Tom has 3 apples and eats one. How many are left?", "2", "openai/gsm8k"),
        ("train-8", "No instruction here.", "5", "openai/gsm8k"),
    ]


def test_math_a_test_problem_in_a_verl_train_file_stays_out_of_training(tmp_path):
    train = parquet(tmp_path / "train.parquet", [verl_row(f"train {i} {VERL_MATH}", str(i), "math", i) for i in range(8)]
                    + [verl_row(f"The shared problem. {VERL_MATH}", "9", "math", 99)])
    test = jsonl(tmp_path / "aime.jsonl", [{"problem": "The shared problem.", "ground_truth": 9},
                                           {"problem": "Only in test.", "ground_truth": 3}])
    cfg = DataConfig(source="files", train_path=train, test_paths=[test], n_weight=4, n_harness=2, n_val=2, n_test=2)
    splits = math_data.load_splits(cfg, seed=0)
    assert {t.question for t in splits.test} == {"The shared problem.", "Only in test."}
    assert "The shared problem." not in {t.question for t in splits.weight + splits.harness + splits.val}


def test_math_bad_rows_name_the_file_the_row_and_what_is_wrong(tmp_path, caplog):
    path = parquet(tmp_path / "mixed.parquet", [
        {"question": "good?", "ground_truth": "1"},
        {"question": "no answer?", "ground_truth": None},
        {"question": "", "ground_truth": "2"},
    ])
    rows = [{"question": "good?", "ground_truth": "1"}, {"question": "two golds?", "ground_truth": ["3", "4"]}]
    lines = jsonl(tmp_path / "lists.jsonl", rows)
    with caplog.at_level(logging.WARNING, logger="domains.math_reasoning.data"):
        assert [t.answer for t in math_data.load_tasks(path)] == ["1"]
        assert [t.answer for t in math_data.load_tasks(lines)] == ["1"]
    assert "mixed.parquet: row 1: missing or empty answer; skipped" in caplog.text
    assert "mixed.parquet: row 2: missing or empty question; skipped" in caplog.text
    assert "lists.jsonl: line 2: answer is a list, not text or a number; skipped" in caplog.text
    no_answer = parquet(tmp_path / "no_answer.parquet", [{"question": "q?", "solution": "long"}])
    with pytest.raises(DataError, match=r"no_answer\.parquet: missing column 'Answer' \(or 'answer', 'ground_truth'"):
        math_data.load_tasks(no_answer)


@pytest.mark.parametrize("write", [parquet, jsonl], ids=["parquet", "jsonl"])
def test_math_gsm8k_as_published_answers_with_what_follows_its_marks(write, tmp_path):
    rows = [{"question": "Natalia sold 48 clips in April and half as many in May. How many in all?",
             "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nShe sold 48+24 = <<48+24=72>>72 clips.\n#### 72"},
            {"question": "A plane costs 1,200 a seat. What do 5 seats cost?",
             "answer": "5 * 1,200 = <<5*1200=6000>>6000\n#### 6,000"}]
    tasks = math_data.load_tasks(write(tmp_path / f"gsm8k.{write.__name__}", rows))
    assert [t.answer for t in tasks] == ["72", "6,000"]
    from domains.math_reasoning.verifier import verify

    assert verify(tasks[0], "48 + 24 = 72, so \\boxed{72}") == 1.0
    assert verify(tasks[1], "\\boxed{6,000}") == 1.0 and verify(tasks[1], "\\boxed{6000}") == 1.0


# --- search_qa -------------------------------------------------------------------------------------


def test_search_ground_truth_string_number_or_list(tmp_path):
    path = jsonl(tmp_path / "popqa.jsonl", [
        {"question": "Who wrote Hamlet?", "ground_truth": "Shakespeare"},
        {"question": "When did it open?", "ground_truth": 1999},
        {"question": "Capital of France?", "ground_truth": ["Paris", "City of Paris"]},
    ])
    tasks = search_data.load_questions(path)
    assert [verifier.golden_answers(t) for t in tasks] == [["Shakespeare"], ["1999"], ["Paris", "City of Paris"]]
    assert verifier.verify(tasks[2], "<answer>the city of paris</answer>") == 1.0  # any of the answers counts


def test_search_nq_open_answer_lists(tmp_path):
    path = parquet(tmp_path / "nq_open.parquet", [{"question": "where is the eiffel tower", "answer": ["Paris"]}])
    assert [verifier.golden_answers(t) for t in search_data.load_questions(path)] == [["Paris"]]


@pytest.mark.parametrize("write", [parquet, jsonl], ids=["parquet", "jsonl"])
def test_search_triviaqa_as_published_counts_the_value_and_every_alias(write, tmp_path):
    rows = [{"question": "Which Lloyd Webber musical premiered in 1993?", "question_id": "tc_33",
             "answer": {"value": "Sunset Boulevard", "aliases": ["Sunset Blvd", "Sunset Boulevard"],
                        "normalized_value": "sunset boulevard", "type": "WikipediaEntity"}},
            {"question": "Who was the man behind The Chipmunks?", "question_id": "tc_40",
             "answer": {"value": "David Seville", "aliases": [], "normalized_value": "david seville"}}]
    tasks = search_data.load_questions(write(tmp_path / f"triviaqa.{write.__name__}", rows))
    assert [verifier.golden_answers(t) for t in tasks] == [["Sunset Boulevard", "Sunset Blvd"], ["David Seville"]]
    assert verifier.verify(tasks[0], "<answer>sunset blvd</answer>") == 1.0


def test_search_verl_parquet_loads(tmp_path):
    path = parquet(tmp_path / "train.parquet", [
        verl_row(f"{VERL_SEARCH}who painted the mona lisa?\n", {"target": ["Leonardo da Vinci", "da Vinci"]}, "nq",
                 3, ability="fact-reasoning", system="You are a helpful and harmless assistant."),
        verl_row("Which river runs through Cairo?", {"target": ["Nile"]}, "hotpotqa", 4, ability="fact-reasoning"),
    ])
    tasks = search_data.load_questions(path)
    assert [(t.id, t.question, verifier.golden_answers(t)) for t in tasks] == [
        ("nq-3", "who painted the mona lisa?", ["Leonardo da Vinci", "da Vinci"]),
        ("hotpotqa-4", "Which river runs through Cairo?", ["Nile"]),
    ]
    assert tasks[0].public() == {"id": "nq-3", "question": "who painted the mona lisa?", "group": "nq"}
    assert verifier.verify(tasks[0], "<answer>da Vinci</answer>") == 1.0


def test_search_bad_rows_and_columns(tmp_path, caplog):
    path = parquet(tmp_path / "mixed.parquet", [{"question": "ok?", "ground_truth": ["a"]},
                                                {"question": "none?", "ground_truth": []}])
    with caplog.at_level(logging.WARNING, logger="domains.search_qa.data"):
        assert len(search_data.load_questions(path)) == 1
    assert "mixed.parquet: row 1: empty ground_truth; skipped" in caplog.text
    no_answer = parquet(tmp_path / "no_answer.parquet", [{"question": "q?", "context": "c"}])
    with pytest.raises(DataError, match=r"no_answer\.parquet: missing column 'golden_answers' \(or 'ground_truth'"):
        search_data.load_questions(no_answer)


# --- a JSON array named .jsonl ---------------------------------------------------------------------


@pytest.mark.parametrize("indent", [None, 2], ids=["one-line", "pretty"])
def test_a_json_array_in_a_jsonl_file_is_named_so(indent, tmp_path):
    path = tmp_path / "aime.jsonl"
    path.write_text(json.dumps([{"problem": "p", "answer": 1}, {"problem": "q", "answer": 2}], indent=indent))
    needle = rf"data file {path}: a JSON array, not JSON Lines \(one JSON object per line\); convert it with: jq"
    with pytest.raises(DataError, match=needle) as e:
        math_data.load_tasks(path)
    assert "\n" not in str(e.value) and str(tmp_path / "aime.lines.jsonl") in str(e.value)
    with pytest.raises(DataError, match=needle):
        search_data.load_questions(path)
    with pytest.raises(DataError, match=rf"corpus file {path}: a JSON array, not JSON Lines"):
        load_corpus(path)
