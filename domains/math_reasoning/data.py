"""Loaders for the public math formats, and the splits.

Formats (parquet, or JSONL with one JSON object per line):
  * DAPO-Math-17K: `prompt` = list of chat messages {role, content} (the question is the first user
    message's content; DAPO's fixed "Solve the following math problem ... Answer:" wrapper is removed),
    `reward_model` = {ground_truth, ...}; optional `extra_info` = {index, ...} (the id) and `data_source`.
  * AIME 2024 / 2025: `Problem` and `Answer` (or `problem` / `answer`; `question` is accepted too),
    optional `ID` / `id`. Integer answers become strings.
A file is read as DAPO when it has a `prompt` or `reward_model` column, else as AIME.

Problems: a missing, unreadable or wrongly named file, or a missing required column, raises DataError
with a one-line message naming the file. A row with a missing or empty field is skipped with a logged
warning (file, row, and the count of skipped rows); rows are numbered from 0 in parquet files and
lines from 1 in JSONL files. A file with no usable row raises DataError. Repeated questions are kept
once (the published DAPO-Math-17K parquet repeats each of its 17,917 problems many times).
"""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

from domains.files import Rows, read_rows
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
AIME_PROBLEM_COLUMNS = ("Problem", "problem", "question")
AIME_ANSWER_COLUMNS = ("Answer", "answer")
AIME_ID_COLUMNS = ("ID", "id")
MAX_ROW_WARNINGS = 5  # per file; the summary line always has the total


# --- turning rows into tasks -----------------------------------------------------------------------


def _text(value: Any) -> str | None:
    """A non-empty string for a field value (numbers become strings), else None."""
    if value is None or isinstance(value, (dict, list, bool)):
        return None
    if isinstance(value, float):
        value = int(value) if value.is_integer() else value
    s = str(value).strip()
    return s or None


def _pick(columns: list[str], candidates: tuple[str, ...]) -> str | None:
    return next((c for c in candidates if c in columns), None)


def _dapo_question(prompt: Any) -> str | None:
    if isinstance(prompt, str):
        content = prompt
    elif isinstance(prompt, list):
        users = [m for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
        content = users[0].get("content") if users else None
    else:
        return None
    text = _text(content)
    if text is None:
        return None
    return _text(text.removeprefix(DAPO_PROMPT_PREFIX.strip()).removesuffix(DAPO_PROMPT_SUFFIX.strip()))


def _dapo_row(rec: dict[str, Any]) -> tuple[str | None, str | None, Any, str | None]:
    question = _dapo_question(rec.get("prompt"))
    reward = rec.get("reward_model")
    answer = _text(reward.get("ground_truth")) if isinstance(reward, dict) else None
    extra = rec.get("extra_info")
    index = extra.get("index") if isinstance(extra, dict) else None
    return question, answer, index, _text(rec.get("data_source"))


def _tasks_from_rows(rows: Rows, fmt: str | None = None) -> list[Task]:
    path, cols, stem = rows.path, rows.columns, rows.path.stem
    if isinstance(rows.records, list):  # JSONL: a line that is not a JSON object means another format
        bad = next((r for r in rows.records if r.value is None), None)
        if bad is not None:
            raise DataError(f"data file {path}: {bad.label} is {bad.problem}")
    if fmt is None:
        fmt = "dapo" if ("prompt" in cols or "reward_model" in cols) else "aime"
    if fmt == "dapo":
        for required in ("prompt", "reward_model"):
            if required not in cols:
                raise DataError(f"data file {path}: missing column {required!r}")
    else:
        fmt = "aime"
        q_col, a_col, id_col = (_pick(cols, c) for c in (AIME_PROBLEM_COLUMNS, AIME_ANSWER_COLUMNS, AIME_ID_COLUMNS))
        if q_col is None:
            raise DataError(f"data file {path}: missing column 'Problem' (or 'problem'; a DAPO file needs 'prompt')")
        if a_col is None:
            raise DataError(f"data file {path}: missing column 'Answer' (or 'answer')")

    tasks: list[Task] = []
    seen_ids: set[str] = set()
    seen_questions: set[str] = set()
    skipped: list[str] = []
    duplicates = 0
    n_rows = 0
    for n, record in enumerate(rows.records):
        n_rows += 1
        label, rec = record.label, record.value
        if fmt == "dapo":
            question, answer, index, source = _dapo_row(rec)
        else:
            question, answer = _text(rec.get(q_col)), _text(rec.get(a_col))
            index, source = (rec.get(id_col) if id_col else None), None
        if question is None or answer is None:
            missing = " and ".join(f for f, v in (("question", question), ("answer", answer)) if v is None)
            if len(skipped) < MAX_ROW_WARNINGS:
                log.warning("data file %s: %s: missing or empty %s; skipped", path, label, missing)
            skipped.append(label)
            continue
        if question in seen_questions:
            duplicates += 1
            continue
        seen_questions.add(question)
        task_id = f"{stem}-{_text(index) or n}"
        if task_id in seen_ids:
            task_id = f"{stem}-{label.replace(' ', '')}"
        seen_ids.add(task_id)
        tasks.append(Task(id=task_id, question=question, answer=answer, meta={"source": source or stem}))

    if skipped:
        log.warning("data file %s: skipped %d of %d rows with a missing or empty field", path, len(skipped), n_rows)
    if duplicates:
        log.info("data file %s: %d repeated questions kept once (%d distinct)", path, duplicates, len(tasks))
    if not tasks:
        raise DataError(f"data file {path}: no usable rows ({len(skipped)} of {n_rows} skipped)")
    return tasks


def load_tasks(path: Path | str) -> list[Task]:
    """The tasks of one DAPO- or AIME-style file (parquet or JSONL), distinct by question text."""
    return _tasks_from_rows(read_rows(path))


def load_dapo(path: Path | str) -> list[Task]:
    """A DAPO-Math-17K style file: columns `prompt` and `reward_model` required."""
    return _tasks_from_rows(read_rows(path), "dapo")


def load_aime(path: Path | str) -> list[Task]:
    """An AIME 2024/2025 style file: `Problem`/`problem` and `Answer`/`answer` required."""
    return _tasks_from_rows(read_rows(path), "aime")


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
