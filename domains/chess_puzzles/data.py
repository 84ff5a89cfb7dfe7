"""Loaders for the Lichess puzzle CSV, and the splits.

Format (database.lichess.org/#puzzles, `.csv` or `.csv.gz`; decompress the published `.csv.zst` first):
a header line, then one puzzle per line with the columns
    PuzzleId,FEN,Moves,Rating,RatingDeviation,Popularity,NbPlays,Themes,GameUrl,OpeningTags
FEN is the position before the opponent's move; Moves is that move, then the solution in UCI, ending
with the solver's move. PuzzleId, FEN, Moves and Rating are required; Themes is kept (private) if present.

Problems: a missing or unreadable file, an unsupported extension, an empty file, a file without puzzle
rows or a missing required column raises DataError naming the file (and the column). A bad row (empty
PuzzleId, unparsable FEN, an impossible position, too few moves, a move list that ends on the opponent's
move, a move that is unparsable or illegal from its FEN, a non-integer Rating) is skipped with a logged
warning naming the file, the line and the problem, and a count of skipped rows; `parse_row` raises the
same DataError for one row. A file with no usable row raises DataError. Puzzles repeating a start
position already taken are left out (the splits are disjoint by question text, which holds the FEN).

The full database has millions of rows; a split needs a few hundred. A sample is the rows with the
smallest seeded hash of their PuzzleId, found in one streaming pass that keeps only a few more rows than
needed (another, wider pass only when too many of those are bad), so it depends on the seed and the file's
rows, not their order, and only the sampled rows are checked with python-chess.
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import heapq
import io
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import chess

from whale_ray.domain import DataError, Splits, split_sizes, train_splits
from whale_ray.records import Task

from . import generator
from .generator import Puzzle

if TYPE_CHECKING:
    from whale_ray.config import DataConfig

log = logging.getLogger(__name__)

COLUMNS = ("PuzzleId", "FEN", "Moves", "Rating", "RatingDeviation", "Popularity", "NbPlays", "Themes", "GameUrl",
           "OpeningTags")
REQUIRED_COLUMNS = ("PuzzleId", "FEN", "Moves", "Rating")
MAX_ROW_WARNINGS = 5  # per file; the summary line always has the total

Row = tuple[Path, int, dict[str, str]]  # file, line number (the header is line 1), record


# --- reading files ---------------------------------------------------------------------------------------


def _open_text(path: Path) -> io.TextIOBase:
    name = path.name.lower()
    if name.endswith(".zst"):
        raise DataError(f"data file {path}: zstd-compressed; decompress it first (zstd -d {path.name})")
    if not name.endswith((".csv", ".csv.gz")):
        raise DataError(f"data file {path}: unsupported extension (expected .csv or .csv.gz)")
    if not path.is_file():
        raise DataError(f"data file {path}: not found")
    if name.endswith(".gz"):
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8-sig", newline="")
    return open(path, encoding="utf-8-sig", newline="")


def read_rows(path: Path | str) -> Iterator[Row]:
    """The rows of one Lichess CSV, streamed; DataError for a file-level problem (before the first row)."""
    path = Path(path)
    with _open_text(path) as f:
        reader = csv.DictReader(f)
        try:
            columns = reader.fieldnames
        except (OSError, EOFError, UnicodeDecodeError, csv.Error) as e:
            raise DataError(f"data file {path}: not readable as CSV ({type(e).__name__}: {e})") from None
        if not columns:
            raise DataError(f"data file {path}: empty")
        columns = [c.strip() for c in columns]
        for column in REQUIRED_COLUMNS:
            if column not in columns:
                raise DataError(f"data file {path}: missing column {column!r} (the first line must be the header "
                                f"{','.join(COLUMNS)})")
        reader.fieldnames = columns
        n = 0
        try:
            for rec in reader:
                n += 1
                yield path, reader.line_num, rec
        except (OSError, EOFError, UnicodeDecodeError, csv.Error) as e:
            raise DataError(f"data file {path}: unreadable after line {reader.line_num} ({type(e).__name__}: {e})") \
                from None
        if n == 0:
            raise DataError(f"data file {path}: no puzzle rows after the header")


# --- turning rows into puzzles ---------------------------------------------------------------------------


def parse_row(path: Path, line: int, rec: dict[str, str]) -> Puzzle:
    """One row as a Puzzle, its move list replayed with python-chess; DataError naming file, line and problem."""
    puzzle_id = (rec.get("PuzzleId") or "").strip()
    where = f"data file {path}: line {line}" + (f" (puzzle {puzzle_id})" if puzzle_id else "")
    if not puzzle_id:
        raise DataError(f"{where}: empty PuzzleId")
    fen = (rec.get("FEN") or "").strip()
    try:
        board = chess.Board(fen)
    except ValueError as e:
        raise DataError(f"{where}: unparsable FEN {fen!r} ({e})") from None
    if not board.is_valid():
        raise DataError(f"{where}: FEN {fen!r} is not a possible position ({board.status()!r})")
    moves = (rec.get("Moves") or "").split()
    if len(moves) < 2:
        raise DataError(f"{where}: Moves needs the opponent's move and at least one solver move, got {len(moves)}")
    if len(moves) % 2:
        raise DataError(f"{where}: Moves has {len(moves)} moves; a puzzle ends with the solver's move (an even count)")
    for i, uci in enumerate(moves, start=1):
        try:
            board.push_uci(uci)
        except chess.InvalidMoveError:
            raise DataError(f"{where}: move {i} {uci!r} is not a UCI move") from None
        except ValueError:  # chess.IllegalMoveError
            raise DataError(f"{where}: move {i} {uci!r} is illegal after the moves before it from the FEN") from None
    rating_text = (rec.get("Rating") or "").strip()
    try:
        rating = int(rating_text)
    except ValueError:
        raise DataError(f"{where}: Rating {rating_text!r} is not an integer") from None
    return Puzzle(fen, tuple(m.lower() for m in moves), rating, (rec.get("Themes") or "").strip())


def _key(seed: int, row: Row) -> int:
    ident = (row[2].get("PuzzleId") or "").strip() or f"{row[0].name}:{row[1]}"
    return int.from_bytes(hashlib.blake2b(f"{seed}:{ident}".encode(), digest_size=8).digest(), "big")


def _smallest(paths: list[Path], k: int, seed: int) -> tuple[list[Row], int]:
    """The k rows of smallest seeded key over `paths`, in key order, and the number of rows read."""
    heap: list[tuple[int, int, Row]] = []  # (-key, order, row): the root is the largest key kept
    total = 0
    for path in paths:
        for row in read_rows(path):
            total += 1
            key = _key(seed, row)
            if len(heap) < k:
                heapq.heappush(heap, (-key, total, row))
            elif key < -heap[0][0]:
                heapq.heapreplace(heap, (-key, total, row))
    return [row for _, _, row in sorted(heap, key=lambda t: (-t[0], t[1]))], total


def _tasks(rows: list[Row], n: int, exclude: set[str]) -> tuple[list[Task], dict[Path, list[str]], dict[Path, int]]:
    """Up to n tasks from `rows` in order, leaving out repeated start positions; also the problems of the
    bad rows and the number of rows examined, per file."""
    tasks: list[Task] = []
    seen = set(exclude)
    skipped: dict[Path, list[str]] = {}
    examined: dict[Path, int] = {}
    for path, line, rec in rows:
        if len(tasks) >= n:
            break
        examined[path] = examined.get(path, 0) + 1
        try:
            puzzle = parse_row(path, line, rec)
        except DataError as e:
            skipped.setdefault(path, []).append(str(e))
            continue
        task = generator.to_task(puzzle, f"{path.name.split('.')[0]}-{rec['PuzzleId'].strip()}", "lichess")
        if task.question not in seen:
            seen.add(task.question)
            tasks.append(task)
    return tasks, skipped, examined


def _checked(tasks: list[Task], skipped: dict[Path, list[str]], examined: dict[Path, int], names: str,
             total: int) -> list[Task]:
    """Log the skipped rows (the first few by name, then a count per file); DataError when none is usable."""
    for path, problems in skipped.items():
        for problem in problems[:MAX_ROW_WARNINGS]:
            log.warning("%s; skipped", problem)
        log.warning("data file %s: skipped %d of %d rows examined", path, len(problems), examined[path])
    if not tasks:
        first = next((problems[0] for problems in skipped.values()), None)
        raise DataError(f"data file {names}: no usable puzzle rows ({total} read)"
                        + (f"; the first problem: {first}" if first else ""))
    return tasks


def sample_tasks(paths: list[Path | str], n: int, seed: int, exclude: set[str] = frozenset()) -> list[Task]:
    """`n` puzzles (fewer when the files hold fewer usable ones) from Lichess CSVs, as tasks in seeded order.
    `exclude`: question texts to leave out (the test puzzles, when sampling training ones)."""
    paths = [Path(p) for p in paths]
    k = n + n // 4 + 16
    while True:
        rows, total = _smallest(paths, k, seed)
        tasks, skipped, examined = _tasks(rows, n, set(exclude))
        if len(tasks) >= n or k >= total:
            break
        k *= 4  # too many bad or excluded rows among the sampled: look wider
    return _checked(tasks, skipped, examined, ", ".join(str(p) for p in paths), total)


def load_tasks(path: Path | str) -> list[Task]:
    """Every usable puzzle of one Lichess CSV, in file order."""
    rows = list(read_rows(Path(path)))
    return _checked(*_tasks(rows, len(rows), set()), str(path), len(rows))


# --- splits ----------------------------------------------------------------------------------------------


def _file_splits(data: "DataConfig", seed: int) -> Splits:
    assert data.train_path is not None  # DataConfig checks it for source "files"
    test = sample_tasks(list(data.test_paths), data.n_test, seed)
    wanted = data.n_val + data.n_harness + data.n_weight
    train = sample_tasks([data.train_path], wanted, seed, exclude={t.question for t in test})
    return train_splits(train, test, data, "puzzles")


def load_splits(data: "DataConfig", seed: int) -> Splits:
    """Disjoint D_weight / D_harness / D_val / D_test from the generator or from Lichess CSV files."""
    if data.source == "generated":
        return Splits(**generator.generate_splits(split_sizes(data), seed))
    return _file_splits(data, seed)
