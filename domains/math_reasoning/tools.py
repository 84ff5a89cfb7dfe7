"""The math domain's sandbox tools. STANDARD LIBRARY ONLY: this file is copied into the sandbox.

python(code) runs `code` in a fresh, isolated child interpreter (-I -S: no user site, no site
packages, no PYTHON* environment variables) with a 5-second timeout, and returns what it printed.
"""

from __future__ import annotations

import subprocess
import sys
import threading

TIMEOUT_S = 5
MAX_OUTPUT_CHARS = 1000
MAX_CODE_CHARS = 10_000

TOOL_SPECS = {
    "python": {
        "description": (
            "Run a Python program and return what it prints (stdout, then stderr). "
            "Use print() to see a value. Times out after 5 s; output is cut to 1000 characters."
        ),
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "the Python source to run"}},
            "required": ["code"],
            "additionalProperties": False,
        },
    }
}


def _drain(stream, keep: bytearray, limit: int) -> None:
    """Read `stream` to its end, keeping only the first `limit` bytes (so a print loop cannot fill memory)."""
    while True:
        chunk = stream.read1(65536)
        if not chunk:
            return
        if len(keep) < limit:
            keep.extend(chunk[: limit - len(keep)])


def python(code: str) -> str:
    """Run `code` with the current interpreter; return stdout (+ stderr), at most 1000 characters.

    Behaves like subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True,
    timeout=5), except that only the first few kilobytes of each stream are kept in memory.
    """
    if not isinstance(code, str):
        raise TypeError(f"python: code must be a string, got {type(code).__name__}")
    if "\x00" in code:
        raise ValueError("python: code contains a NUL character")
    if len(code) > MAX_CODE_CHARS:
        raise ValueError(f"python: code is {len(code)} characters long; the limit is {MAX_CODE_CHARS}")
    proc = subprocess.Popen(
        [sys.executable, "-I", "-S", "-c", code],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    limit = 4 * MAX_OUTPUT_CHARS  # bytes; enough for MAX_OUTPUT_CHARS characters of UTF-8
    out, err = bytearray(), bytearray()
    readers = [
        threading.Thread(target=_drain, args=(proc.stdout, out, limit), daemon=True),
        threading.Thread(target=_drain, args=(proc.stderr, err, limit), daemon=True),
    ]
    for r in readers:
        r.start()
    timed_out = False
    try:
        proc.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        timed_out = True
        proc.kill()
        proc.wait()
    for r in readers:
        r.join(timeout=1.0)  # a grandchild may still hold a pipe open; do not wait for it
    output = out.decode("utf-8", errors="replace") + err.decode("utf-8", errors="replace")
    if timed_out:  # the note always survives the cut
        note = f"Error: timed out after {TIMEOUT_S} s"
        return output[: MAX_OUTPUT_CHARS - len(note)] + note
    return output[:MAX_OUTPUT_CHARS]
