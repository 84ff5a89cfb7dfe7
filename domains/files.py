"""Readers shared by the domains' loaders: the rows of a parquet or JSONL file, labelled for messages.

Rows are labelled "row N" (from 0) in parquet files and "line N" (from 1) in JSONL files. A file-level
problem (missing, unsupported extension, unreadable, a JSON array in a JSONL file) raises DataError naming the
file; a JSONL line that is not a JSON object is passed on with its problem, for the loader to skip or refuse.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from whale_ray.domain import DataError

EXTENSIONS = (".parquet", ".jsonl")
PARQUET_BATCH = 8192  # rows per batch: memory follows the batch, not the 1.8M-row DAPO file


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


@dataclass
class Record:
    index: int  # the row (from 0) or line (from 1) number
    value: dict[str, Any] | None  # None: the line is not a JSON object
    problem: str | None = None  # why value is None: "not valid JSON (...)", "not a JSON object"
    kind: str = "line"  # "row" in parquet files

    @property
    def label(self) -> str:
        return f"{self.kind} {self.index}"


@dataclass
class Rows:
    path: Path
    columns: list[str]
    records: Iterable[Record]


def cell_text(value: Any) -> str | None:
    """A field value as non-empty text (numbers become strings, 72.0 as "72": parquet stores an integer column
    with gaps as floats), else None (also for a list, a mapping or a bool)."""
    if value is None or isinstance(value, (dict, list, tuple, bool)):
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    s = str(value).strip()
    return s or None


def user_message(prompt: Any) -> str | None:
    """The text of a chat prompt (verl's `prompt` column): its first user message's content, or the prompt itself
    when it is a plain string."""
    if isinstance(prompt, list):
        users = [m.get("content") for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
        prompt = users[0] if users else None
    return cell_text(prompt)


def _is_json_array(path: Path) -> bool:
    """The whole file is one JSON array (what `json.dump(rows, f)` writes), not one object per line."""
    try:
        with Path(path).open(encoding="utf-8") as f:
            return isinstance(json.load(f), list)
    except (OSError, ValueError):
        return False


def jsonl_records(path: Path, what: str = "data file") -> Iterator[Record]:
    """The non-blank lines of a JSONL file, streamed; `what` names the file in errors."""
    n = 0
    first = True
    try:
        with Path(path).open(encoding="utf-8") as f:
            for n, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    obj, problem = None, f"not valid JSON ({e.msg})"
                else:
                    problem = None if isinstance(obj, dict) else "not a JSON object"
                if problem and first and line.lstrip().startswith("[") and _is_json_array(path):
                    raise DataError(f"{what} {path}: a JSON array, not JSON Lines (one JSON object per line); "
                                    f"convert it with: jq -c '.[]' {path} > {Path(path).with_suffix('.lines.jsonl')}")
                first = False
                yield Record(n, obj) if problem is None else Record(n, None, problem)
    except UnicodeDecodeError:
        raise DataError(f"{what} {path}: line {n + 1} is not UTF-8 text") from None
    except OSError as e:
        raise DataError(f"{what} {path}: not readable after line {n} ({type(e).__name__}: {e})") from None


def _parquet(path: Path) -> Rows:
    try:
        pfile = pq.ParquetFile(path)
        columns = pfile.schema_arrow.names
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"data file {path}: not a readable parquet file ({first_line(e)})") from None

    def records() -> Iterator[Record]:
        i = 0
        try:
            for batch in pfile.iter_batches(batch_size=PARQUET_BATCH):
                for value in batch.to_pylist():
                    yield Record(i, value, kind="row")
                    i += 1
        except (pa.ArrowException, OSError) as e:
            raise DataError(f"data file {path}: not a readable parquet file at row {i} ({first_line(e)})") from None

    return Rows(path, columns, records())


def _jsonl(path: Path) -> Rows:
    records = list(jsonl_records(path))  # the columns are the union of the lines' keys: read them all first
    columns: dict[str, None] = {}
    for r in records:
        columns.update(dict.fromkeys(r.value or {}))
    return Rows(path, list(columns), records)


def read_rows(path: Path | str) -> Rows:
    """The rows of one parquet or JSONL file."""
    path = Path(path)
    if path.suffix.lower() not in EXTENSIONS:
        raise DataError(f"data file {path}: unsupported extension {path.suffix!r} (expected .parquet or .jsonl)")
    if not path.is_file():
        raise DataError(f"data file {path}: not found")
    return _parquet(path) if path.suffix.lower() == ".parquet" else _jsonl(path)
