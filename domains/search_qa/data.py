"""Loaders for the Search-R1 question files, and the splits.

Search-R1's published files (nq_hotpotqa_train train.parquet / test.parquet, one row per question,
built from FlashRAG's datasets) have the columns
    id, question, golden_answers, data_source, prompt, ability, reward_model, extra_info
where golden_answers is a list of strings, data_source the benchmark ("nq", "triviaqa", "popqa",
"hotpotqa", "2wikimultihopqa", "musique", "bamboogle"), prompt the chat with Search-R1's instruction
ending in "Question: ...", and reward_model = {"style": "rule", "ground_truth": {"target": [...]}}.
Files may be parquet or JSONL (one JSON object per line).

Accepted here: the question from `question`, else from the first user message of `prompt` (the text
after its last "Question:"); the gold answers from `golden_answers`, else `reward_model.ground_truth
.target` (a list or one string); the benchmark from `data_source` (else the file's stem), put in the
task's public meta as "group" (reports average per group); the id from `id`, else `extra_info.index`,
else the row number. A task's answer is its first gold answer; all of them are in the private meta
"_golden_answers".

Problems: a missing or unreadable file, or a missing question / answer column, raises DataError naming
the file. A row without a question or with no gold answer (or a JSONL line that is not a JSON object)
is skipped with a warning naming the file and row, and a count; a file with no usable row raises
DataError. Rows are numbered from 0 in parquet files and lines from 1 in JSONL files. A question that
repeats is kept once.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

from domains.files import read_rows
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

BENCHMARKS = ("nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle")
MAX_ROW_WARNINGS = 5  # per file; the summary line always has the total


def _text(value: Any) -> str | None:
    if value is None or isinstance(value, (dict, list, bool)):
        return None
    s = str(value).strip()
    return s or None


def _question(record: dict[str, Any]) -> str | None:
    question = _text(record.get("question"))
    if question is not None:
        return question
    prompt = record.get("prompt")
    if isinstance(prompt, list):
        users = [m.get("content") for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
        prompt = users[0] if users else None
    if not isinstance(prompt, str) or "Question:" not in prompt:
        return None
    return _text(prompt.rsplit("Question:", 1)[1])


def _answers(record: dict[str, Any]) -> list[str]:
    golds = record.get("golden_answers")
    if golds is None:
        reward = record.get("reward_model")
        truth = reward.get("ground_truth") if isinstance(reward, dict) else None
        golds = truth.get("target") if isinstance(truth, dict) else truth
    if not isinstance(golds, (list, tuple)):
        golds = [golds]
    out: list[str] = []
    for g in golds:
        t = _text(g)
        if t is not None and t not in out:
            out.append(t)
    return out


def load_questions(path: Path | str) -> list[Task]:
    """The tasks of one Search-R1 style file (parquet or JSONL), distinct by question text."""
    path = Path(path)
    rows = read_rows(path)
    columns = rows.columns
    if "question" not in columns and "prompt" not in columns:
        raise DataError(f"data file {path}: missing column 'question' (or a Search-R1 'prompt')")
    if "golden_answers" not in columns and "reward_model" not in columns:
        raise DataError(f"data file {path}: missing column 'golden_answers' (or 'reward_model' with "
                        "ground_truth.target)")
    tasks: list[Task] = []
    seen_ids: set[str] = set()
    seen_questions: set[str] = set()
    skipped, duplicates, n_rows = 0, 0, 0
    for n, row in enumerate(rows.records):
        n_rows += 1
        label, record = row.label, row.value
        if record is None:
            problem = row.problem
        else:
            question, golds = _question(record), _answers(record)
            problem = "no question" if question is None else "empty golden_answers" if not golds else None
        if problem is not None:
            if skipped < MAX_ROW_WARNINGS:
                log.warning("data file %s: %s: %s; skipped", path, label, problem)
            skipped += 1
            continue
        if question in seen_questions:
            duplicates += 1
            continue
        seen_questions.add(question)
        group = _text(record.get("data_source")) or path.stem
        extra = record.get("extra_info")
        index = _text(record.get("id")) or (_text(extra.get("index")) if isinstance(extra, dict) else None)
        task_id = f"{group}-{index if index is not None else n}"
        if task_id in seen_ids:
            task_id = f"{group}-{path.stem}-{label.replace(' ', '')}"
        seen_ids.add(task_id)
        tasks.append(Task(id=task_id, question=question, answer=golds[0],
                          meta={"group": group, "_golden_answers": golds}))
    if skipped:
        log.warning("data file %s: skipped %d of %d rows", path, skipped, n_rows)
    if duplicates:
        log.info("data file %s: %d repeated questions kept once (%d distinct)", path, duplicates, len(tasks))
    if not tasks:
        raise DataError(f"data file {path}: no usable rows ({skipped} of {n_rows} skipped)")
    return tasks


# --- splits ----------------------------------------------------------------------------------------


def _file_splits(data: "DataConfig", seed: int) -> Splits:
    """D_test: n_test questions of the test files, spread evenly over their benchmarks; D_val, D_harness
    and D_weight, in that order, from a seeded shuffle of the train file without the test questions."""
    assert data.train_path is not None  # DataConfig checks it for source "files"
    test_all = distinct_questions(t for p in data.test_paths for t in load_questions(p))
    clean = without_test_questions(load_questions(data.train_path), test_all, data.train_path, "questions")
    random.Random(f"whale-search-train:{seed}").shuffle(clean)
    test = stratified_sample(test_all, data.n_test, "whale-search-test", seed, group=lambda t: t.meta["group"])
    return train_splits(clean, test, data, "questions")


def load_splits(data: "DataConfig", seed: int) -> Splits:
    """Disjoint D_weight / D_harness / D_val / D_test from the generator or from Search-R1 files."""
    if data.source == "generated":
        return Splits(**generator.generate_splits(split_sizes(data), seed))
    return _file_splits(data, seed)
