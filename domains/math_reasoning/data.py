"""Loaders for the public math formats, and the splits.

A file is parquet, or JSONL with one JSON object per line. Its rows give, each by the first field present:
  * the question: a plain `Problem` / `problem` / `question` field, else verl's chat `prompt` (the first user
    message's content; a plain string is taken as it is) less the instruction verl's or DAPO's preprocessing
    wrapped around the problem (PROMPT_PREFIXES, PROMPT_SUFFIXES);
  * the answer: verl's `reward_model.ground_truth`, else a top-level `ground_truth` / `Answer` / `answer`; a
    number becomes its text ("70", never "70.0"); GSM8K's own `answer` (a worked solution ending in `#### 72`)
    gives what follows its last `####`;
  * the id: `ID` / `id`, else `extra_info.index`, else the row number; the source (task meta "source"):
    `data_source`, else the file's stem.
So DAPO-Math-17K, GSM8K as published, verl's GSM8K and MATH parquet, AIME 2024/2025 and files with a `ground_truth` column all
load; docs/data.md has the table of layouts.

Problems: a missing, unreadable or wrongly named file, a JSON array in a JSONL file, or no question or no answer
column raises DataError with a one-line message naming the file. A row whose question or answer is missing,
empty or not text (a list, say) is skipped with a logged warning naming the file, the row and what is wrong, and
a count; rows are numbered from 0 in parquet files and lines from 1 in JSONL files. A file with no usable row
raises DataError. Repeated questions are kept once (the published DAPO-Math-17K parquet repeats each of its
17,917 problems many times).
"""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

from domains.files import cell_text, read_rows, user_message
from whale_ray.domain import (
    DataError,
    Splits,
    distinct_questions,
    split_sizes,
    stratified_sample,
    train_splits,
    without_test_questions,
)
from whale_ray.records import Task

from . import generator

if TYPE_CHECKING:
    from whale_ray.config import DataConfig

log = logging.getLogger(__name__)

DAPO_PROMPT_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
DAPO_PROMPT_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'
# The instructions preprocessing wraps around a problem (DAPO's; verl's MATH and GSM8K scripts append theirs) are
# removed: the harness writes its own instructions and the verifier reads the last \boxed{} (GSM8K's "after ####"
# would ask for a format it never reads), and a problem stays one question whichever file it comes from, so that
# the test problems are found and kept out of training.
PROMPT_PREFIXES = (DAPO_PROMPT_PREFIX,)
PROMPT_SUFFIXES = (
    DAPO_PROMPT_SUFFIX,
    "Let's think step by step and output the final answer within \\boxed{}.",
    'Let\'s think step by step and output the final answer after "####".',
)
QUESTION_COLUMNS = ("Problem", "problem", "question")  # else verl's `prompt`
ANSWER_COLUMNS = ("ground_truth", "Answer", "answer")  # after verl's `reward_model.ground_truth`
ID_COLUMNS = ("ID", "id")  # else `extra_info.index`
GSM8K_FINAL = "####"  # GSM8K's solutions end in "#### <answer>"
MAX_ROW_WARNINGS = 5  # per file; the summary line always has the total


# --- turning rows into tasks -----------------------------------------------------------------------


def _first(record: dict[str, Any], keys: tuple[str, ...]) -> Any:
    return next((record[k] for k in keys if record.get(k) is not None), None)


def _without_instructions(prompt: str) -> str | None:
    for prefix in PROMPT_PREFIXES:
        prompt = prompt.removeprefix(prefix.strip())
    for suffix in PROMPT_SUFFIXES:
        prompt = prompt.removesuffix(suffix.strip())
    return cell_text(prompt)


def _question(record: dict[str, Any]) -> Any:
    plain = _first(record, QUESTION_COLUMNS)
    if plain is not None:
        return plain
    prompt = user_message(record.get("prompt"))
    return _without_instructions(prompt) if prompt is not None else None


def _answer(record: dict[str, Any]) -> Any:
    reward = record.get("reward_model")
    truth = reward.get("ground_truth") if isinstance(reward, dict) else None
    answer = truth if truth is not None else _first(record, ANSWER_COLUMNS)
    # GSM8K's answer is the worked solution, its final answer after "####": the verifier compares one number, so
    # the whole solution would be a gold answer no completion ever matches (a thousands comma stays: the verifier's
    # normalize reads "6,000" as 6000)
    if isinstance(answer, str) and GSM8K_FINAL in answer:
        return answer.rsplit(GSM8K_FINAL, 1)[1].strip()
    return answer


def _index(record: dict[str, Any]) -> Any:
    index, extra = _first(record, ID_COLUMNS), record.get("extra_info")
    return extra.get("index") if index is None and isinstance(extra, dict) else index


def _problem(name: str, value: Any) -> str | None:
    """What is wrong with a row's question or answer, or None."""
    if cell_text(value) is not None:
        return None
    if isinstance(value, (dict, list, tuple, bool)):
        return f"{name} is a {type(value).__name__}, not text or a number"
    return f"missing or empty {name}"


def _check_columns(path: Path, columns: list[str]) -> None:
    if not any(c in columns for c in (*QUESTION_COLUMNS, "prompt")):
        raise DataError(f"data file {path}: missing column 'Problem' (or 'problem', 'question', or verl's chat "
                        "'prompt')")
    if not any(c in columns for c in ("reward_model", *ANSWER_COLUMNS)):
        first, others = ("'reward_model'", "'ground_truth', 'Answer', 'answer'") if "prompt" in columns else (
            "'Answer'", "'answer', 'ground_truth', or verl's 'reward_model'")
        raise DataError(f"data file {path}: missing column {first} (or {others})")


def load_tasks(path: Path | str) -> list[Task]:
    """The tasks of one math file (parquet or JSONL, any layout above), distinct by question text."""
    rows = read_rows(path)
    path, stem = rows.path, rows.path.stem
    if isinstance(rows.records, list):  # JSONL: a line that is not a JSON object means another format
        bad = next((r for r in rows.records if r.value is None), None)
        if bad is not None:
            raise DataError(f"data file {path}: {bad.label} is {bad.problem}")
    _check_columns(path, rows.columns)

    tasks: list[Task] = []
    seen_ids: set[str] = set()
    seen_questions: set[str] = set()
    skipped: list[str] = []
    duplicates = 0
    n_rows = 0
    for n, record in enumerate(rows.records):
        n_rows += 1
        label, rec = record.label, record.value
        question, answer = _question(rec), _answer(rec)
        problems = [p for p in (_problem("question", question), _problem("answer", answer)) if p]
        if problems:
            if len(skipped) < MAX_ROW_WARNINGS:
                log.warning("data file %s: %s: %s; skipped", path, label, "; ".join(problems))
            skipped.append(label)
            continue
        question, answer = cell_text(question), cell_text(answer)
        if question in seen_questions:
            duplicates += 1
            continue
        seen_questions.add(question)
        task_id = f"{stem}-{cell_text(_index(rec)) or n}"
        if task_id in seen_ids:
            task_id = f"{stem}-{label.replace(' ', '')}"
        seen_ids.add(task_id)
        source = cell_text(rec.get("data_source")) or stem
        tasks.append(Task(id=task_id, question=question, answer=answer, meta={"source": source}))

    if skipped:
        log.warning("data file %s: skipped %d of %d rows with a missing, empty or wrong field", path, len(skipped),
                    n_rows)
    if duplicates:
        log.info("data file %s: %d repeated questions kept once (%d distinct)", path, duplicates, len(tasks))
    if not tasks:
        raise DataError(f"data file {path}: no usable rows ({len(skipped)} of {n_rows} skipped)")
    return tasks


# --- splits ----------------------------------------------------------------------------------------


def _file_splits(data: "DataConfig", seed: int) -> Splits:
    """D_test: n_test problems of the test files; D_val, D_harness and D_weight, in that order, from a seeded
    shuffle of the train file without any test problem."""
    assert data.train_path is not None  # DataConfig checks it for source "files"
    test_all = distinct_questions(t for p in data.test_paths for t in load_tasks(p))
    clean = without_test_questions(load_tasks(data.train_path), test_all, data.train_path, "problems")
    random.Random(seed).shuffle(clean)
    # n_test of the test problems, spread evenly over their sources (AIME 2024 and 2025, say)
    test = stratified_sample(test_all, data.n_test, "whale-math-test", seed, group=lambda t: t.meta["source"])
    return train_splits(clean, test, data, "problems")


def load_splits(data: "DataConfig", seed: int) -> Splits:
    """Disjoint D_weight / D_harness / D_val / D_test from the generator or from files."""
    if data.source == "generated":
        return Splits(**generator.generate_splits(split_sizes(data), seed))
    return _file_splits(data, seed)
