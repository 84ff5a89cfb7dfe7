"""Crash-safe file writes: readers see the old content or the new one, never a mix; a lock file for builders; the
whale cache that builders fill (embedded tiny policies, imported GGUF checkpoints)."""

from __future__ import annotations

import fcntl
import os
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_file(path: Path, data: str) -> None:
    with open(path, "w", encoding="utf-8", newline="") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def atomic_write_text(path: Path, data: str) -> None:
    """Write `data` to `path` atomically: temp file in the same folder, fsync, os.replace, fsync folder."""
    path = Path(path)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        write_file(tmp, data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


@contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive flock on `path` (created if missing) for the block: processes that build the same cache entry
    take turns; the kernel drops it when a holder dies."""
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def default_cache_dir() -> Path:
    """The whale cache: `$WHALE_CACHE`, default `~/.cache/whale-ray` (a run on shared storage may pick
    `<storage>/cache` instead: whale_ray/resources.py)."""
    return Path(os.environ.get("WHALE_CACHE") or "~/.cache/whale-ray").expanduser()
