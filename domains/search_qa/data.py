"""Loaders for the Search-R1 question files, and the splits.

Search-R1's published files (nq_hotpotqa_train train.parquet / test.parquet, one row per question,
built from FlashRAG's datasets) have the columns
    id, question, golden_answers, data_source, prompt, ability, reward_model, extra_info
where golden_answers is a list of strings, data_source the benchmark ("nq", "triviaqa", "popqa",
"hotpotqa", "2wikimultihopqa", "musique", "bamboogle"), prompt the chat with Search-R1's instruction
ending in "Question: ...", and reward_model = {"style": "rule", "ground_truth": {"target": [...]}}.
Files may be parquet or JSONL (one JSON object per line).

Accepted here, each by the first field present: the question from `question`, else from verl's chat `prompt`
(its first user message: the text after its last "Question:", or all of it when there is none); the gold
answers from `golden_answers`, else a top-level `ground_truth`, else verl's `reward_model.ground_truth`, else
`answer`, each a list (any one of them counts), one string or number, Search-R1's {"target": [...]}, or
TriviaQA's {"value": ..., "aliases": [...]} (the value and every alias count); the
benchmark from `data_source` (else the file's stem), put in the task's public meta as "group" (reports average
per group); the id from `id`, else `extra_info.index`, else the row number. A task's answer is its first gold
answer; all of them are in the private meta "_golden_answers". docs/data.md has the table of layouts.

Problems: a missing or unreadable file, a JSON array in a JSONL file, or a missing question / answer column,
raises DataError naming the file. A row without a question or with no gold answer (or a JSONL line that is not a
JSON object) is skipped with a warning naming the file, the row and what is wrong, and a count; a file with no
usable row raises DataError. Rows are numbered from 0 in parquet files and lines from 1 in JSONL files. A question
that repeats is kept once.
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

BENCHMARKS = ("nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle")
MAX_ROW_WARNINGS = 5  # per file; the summary line always has the total


# where the gold answers are, in order; verl's reward_model.ground_truth comes after the top-level ones
GOLD_FIELDS = ("golden_answers", "ground_truth", "reward_model.ground_truth", "answer")


def _question(record: dict[str, Any]) -> str | None:
    question = cell_text(record.get("question"))
    if question is not None:
        return question
    prompt = user_message(record.get("prompt"))
    return cell_text(prompt.rsplit("Question:", 1)[-1]) if prompt is not None else None


def _gold(record: dict[str, Any]) -> tuple[str, Any]:
    """The first gold-answer field present in the row, named, and its value (None: no field)."""
    reward = record.get("reward_model")
    nested = reward.get("ground_truth") if isinstance(reward, dict) else None
    values = {f: nested if f == "reward_model.ground_truth" else record.get(f) for f in GOLD_FIELDS}
    return next(((f, v) for f, v in values.items() if v is not None), (GOLD_FIELDS[0], None))


def _answers(golds: Any) -> list[str]:
    if isinstance(golds, dict) and "target" in golds:  # Search-R1's {"target": [...]}
        golds = golds["target"]
    elif isinstance(golds, dict):  # TriviaQA's {"value": ..., "aliases": [...], "normalized_...": ...}
        golds = [golds.get("value"), *(golds.get("aliases") or [])]
    if not isinstance(golds, (list, tuple)):
        golds = [golds]
    out: list[str] = []
    for g in golds:
        t = cell_text(g)
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
    if not any(f.split(".")[0] in columns for f in GOLD_FIELDS):
        raise DataError(f"data file {path}: missing column 'golden_answers' (or 'ground_truth', 'answer', or verl's "
                        "'reward_model' with ground_truth)")
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
            (field, value), question = _gold(record), _question(record)
            golds = _answers(value)
            problem = "no question" if question is None else f"empty {field}" if not golds else None
        if problem is not None:
            if skipped < MAX_ROW_WARNINGS:
                log.warning("data file %s: %s: %s; skipped", path, label, problem)
            skipped += 1
            continue
        if question in seen_questions:
            duplicates += 1
            continue
        seen_questions.add(question)
        group = cell_text(record.get("data_source")) or path.stem
        extra = record.get("extra_info")
        index = cell_text(record.get("id")) or (cell_text(extra.get("index")) if isinstance(extra, dict) else None)
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
