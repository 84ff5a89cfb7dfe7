"""Read-only tools over the archive for an LLM proposer: list, read, grep, diff, frontier, history.

Every path is relative to the archive root and checked before use: absolute paths, `..`, hidden names
(temp folders of unfinished writes) and symbolic links anywhere on the way are refused, and the
resolved path must stay under the root. The archive holds only D_harness data (code, per-example
scores and raw traces of candidates), so nothing here can show D_test, a test score, the verifier or
a gold answer beyond what D_harness traces hold.

Each tool returns text for the model. A bad argument raises `ToolInputError`, whose message goes back
to the model as the tool's result.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import stat
from pathlib import Path
from typing import Any

from whale_ray import selection
from whale_ray.archive import Archive, ArchiveError, Candidate
from whale_ray.harness import harness_diff


class ToolInputError(ValueError):
    """A tool call with bad arguments; the message is returned to the model."""


def _fmt(x: Any, digits: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def _one_line(text: str, limit: int = 160) -> str:
    text = " ".join(str(text or "").split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


class ArchiveTools:
    """The archive as the proposer sees it (read-only; see the module docstring)."""

    GREP_FILE_BYTES = 8 << 20  # files larger than this are skipped by grep

    def __init__(self, archive: Archive, *, read_max_chars: int = 20000) -> None:
        self.archive = archive
        self.root = Path(archive.root)
        self.real_root = Path(os.path.realpath(self.root))
        self.read_max_chars = int(read_max_chars)

    # ------------------------------------------------------------------------------ paths
    def resolve(self, path: Any, *, want: str | None = None) -> Path:
        """The host path of archive-relative `path` ("." is the root); `want` is "file" or "dir"."""
        if path is None or path == "":
            path = "."
        if not isinstance(path, str):
            raise ToolInputError(f"path must be a string, got {type(path).__name__}")
        if "\x00" in path:
            raise ToolInputError("path contains a NUL byte")
        if path.startswith(("/", "\\", "~")) or re.match(r"^[A-Za-z]:", path):
            raise ToolInputError(f"{path!r}: use a path relative to the archive root (e.g. 'h0/harness.py')")
        parts = [p for p in path.replace("\\", "/").split("/") if p not in ("", ".")]
        for p in parts:
            if p == "..":
                raise ToolInputError(f"{path!r}: '..' is not allowed; paths stay inside the archive")
            if p.startswith("."):
                raise ToolInputError(f"{path!r}: hidden files are not part of the archive")
        current = self.root
        for p in parts:
            current = current / p
            try:
                st = os.lstat(current)
            except FileNotFoundError:
                raise ToolInputError(f"{path!r}: no such file or folder in the archive") from None
            except OSError as e:
                raise ToolInputError(f"{path!r}: cannot be read ({e.strerror})") from None
            if stat.S_ISLNK(st.st_mode):
                raise ToolInputError(f"{path!r}: symbolic links are not followed")
        real = Path(os.path.realpath(current))
        if real != self.real_root and self.real_root not in real.parents:
            raise ToolInputError(f"{path!r}: outside the archive")
        if want == "file" and not real.is_file():
            raise ToolInputError(f"{path!r}: not a file" + (" (a folder: list it)" if real.is_dir() else ""))
        if want == "dir" and not real.is_dir():
            raise ToolInputError(f"{path!r}: not a folder")
        return current

    def rel(self, p: Path) -> str:
        r = p.relative_to(self.root).as_posix()
        return r or "."

    def _walk_files(self, top: Path) -> list[Path]:
        """Regular files under `top`, hidden names and links skipped, sorted."""
        if top.is_file():
            return [top]
        out = []
        for dirpath, dirnames, filenames in os.walk(top, followlinks=False):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith(".")
                                 and not os.path.islink(os.path.join(dirpath, d)))
            for f in sorted(filenames):
                fp = Path(dirpath) / f
                if not f.startswith(".") and not fp.is_symlink() and fp.is_file():
                    out.append(fp)
        return out

    # ------------------------------------------------------------------------------ tools
    def list_files(self, path: str = ".", recursive: bool = False) -> tuple[str, list[str]]:
        top = self.resolve(path, want="dir")
        lines = []
        if recursive:
            for f in self._walk_files(top):
                lines.append(f"{self.rel(f)}  ({f.stat().st_size} bytes)")
        else:
            for entry in sorted(top.iterdir(), key=lambda e: e.name):
                if entry.name.startswith(".") or entry.is_symlink():
                    continue
                if entry.is_dir():
                    lines.append(f"{entry.name}/")
                elif entry.is_file():
                    lines.append(f"{entry.name}  ({entry.stat().st_size} bytes)")
        text = "\n".join(lines) if lines else "(empty)"
        return self._cap(f"{self.rel(top)}:\n{text}"), []

    def read_file(self, path: str, offset: int = 1, limit: int = 200, char_offset: int = 0) -> tuple[str, list[str]]:
        """Lines offset..offset+limit-1 (1-based); a single line longer than the cap is paged by char_offset."""
        for name, v, lo in (("offset", offset, 1), ("limit", limit, 1), ("char_offset", char_offset, 0)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise ToolInputError(f"{name} must be an integer, got {v!r}")
            if v < lo:
                raise ToolInputError(f"{name} must be >= {lo}, got {v}")
        f = self.resolve(path, want="file")
        try:
            text = f.read_text(encoding="utf-8", errors="replace")
        except OSError as e:
            raise ToolInputError(f"{path!r}: cannot be read ({e.strerror})") from None
        lines = text.splitlines()
        total = len(lines)
        if total == 0:
            return f"{self.rel(f)}: (empty file)", [self.rel(f)]
        if offset > total:
            raise ToolInputError(f"{path!r} has {total} lines; offset {offset} is past the end")
        cap = self.read_max_chars
        first = lines[offset - 1]
        if len(first) > cap or char_offset:
            chunk = first[char_offset:char_offset + cap]
            end = char_offset + len(chunk)
            more = f"\n[more: continue with offset={offset}, char_offset={end}]" if end < len(first) else ""
            return (f"{self.rel(f)} line {offset} of {total}, characters {char_offset}..{end} of {len(first)}:\n"
                    f"{chunk}{more}"), [self.rel(f)]
        out, used, last = [], 0, offset - 1
        for i in range(offset - 1, min(total, offset - 1 + limit)):
            line = f"{i + 1:>5}  {lines[i]}"
            if used + len(line) + 1 > cap and out:
                break
            out.append(line)
            used += len(line) + 1
            last = i + 1
        head = f"{self.rel(f)} (lines {offset}-{last} of {total})"
        tail = f"\n[more: continue with offset={last + 1}]" if last < total else ""
        return head + ":\n" + "\n".join(out) + tail, [self.rel(f)]

    def grep(self, pattern: str, path: str = ".", glob: str = "*", max_matches: int = 50,
             ignore_case: bool = False) -> tuple[str, list[str]]:
        if not isinstance(pattern, str) or not pattern:
            raise ToolInputError("pattern must be a non-empty regular expression string")
        if not isinstance(glob, str) or not glob:
            raise ToolInputError("glob must be a non-empty file-name pattern such as '*.py'")
        if isinstance(max_matches, bool) or not isinstance(max_matches, int) or not 1 <= max_matches <= 1000:
            raise ToolInputError(f"max_matches must be an integer from 1 to 1000, got {max_matches!r}")
        try:
            rx = re.compile(pattern, re.IGNORECASE if ignore_case else 0)
        except re.error as e:
            raise ToolInputError(f"bad regular expression {pattern!r}: {e}") from None
        top = self.resolve(path)
        hits, searched, n = [], [], 0
        for f in self._walk_files(top):
            if not fnmatch.fnmatch(f.name, glob) or f.stat().st_size > self.GREP_FILE_BYTES:
                continue
            searched.append(self.rel(f))
            try:
                text = f.read_text(encoding="utf-8", errors="replace")
            except OSError:
                continue
            for lineno, line in enumerate(text.splitlines(), 1):
                m = rx.search(line)
                if m is None:
                    continue
                n += 1
                if len(hits) < max_matches:
                    start = max(0, m.start() - 100)
                    snippet = line[start:m.end() + 100]
                    pre, post = "…" if start else "", "…" if m.end() + 100 < len(line) else ""
                    hits.append(f"{self.rel(f)}:{lineno}: {pre}{snippet}{post}")
        if not hits:
            return f"no match for {pattern!r} in {len(searched)} file(s) under {self.rel(top)}", searched
        more = f"\n[{n - len(hits)} more matches not shown; narrow the path or glob]" if n > len(hits) else ""
        return self._cap("\n".join(hits) + more), sorted({h.split(":", 1)[0] for h in hits})

    def _candidate(self, cid: Any) -> Candidate:
        if not isinstance(cid, str) or not cid:
            raise ToolInputError(f"a candidate id must be a string such as 'h0' or 'c003', got {cid!r}")
        try:
            return self.archive.get(cid)
        except ArchiveError:
            ids = ", ".join(self.archive.ids()[-30:])
            raise ToolInputError(f"no candidate {cid!r}; the archive has {ids}") from None

    def diff(self, a: str, b: str) -> tuple[str, list[str]]:
        ca, cb = self._candidate(a), self._candidate(b)
        d = harness_diff(ca.code, cb.code, f"{a}/harness.py", f"{b}/harness.py")
        return self._cap(d or f"{a} and {b} have the same code"), [f"{a}/harness.py", f"{b}/harness.py"]

    def frontier(self, k: int = 5, weight_version: int | None = None) -> tuple[str, list[str]]:
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= 100:
            raise ToolInputError(f"k must be an integer from 1 to 100, got {k!r}")
        if weight_version is not None and (isinstance(weight_version, bool) or not isinstance(weight_version, int)):
            raise ToolInputError(f"weight_version must be an integer or null, got {weight_version!r}")
        return self._cap(frontier_text(self.archive, k, weight_version)), []

    def history(self) -> tuple[str, list[str]]:
        return self._cap(history_text(self.archive)), []

    def _cap(self, text: str) -> str:
        if len(text) <= self.read_max_chars:
            return text
        return text[: self.read_max_chars] + f"\n[cut at {self.read_max_chars} characters]"


# ------------------------------------------------------------------------------ shared views


def latest_version(archive: Archive) -> int | None:
    return selection.latest_version(archive.candidates("evaluated"))


def default_parent(archive: Archive) -> str:
    """The id of `selection.default_parent`: the frontier top under the newest weights, else the seed."""
    try:
        return selection.default_parent(archive.candidates()).id
    except selection.SelectionError as e:
        raise ArchiveError(f"archive {archive.root}: {e}") from None


def frontier_text(archive: Archive, k: int = 5, weight_version: int | None = None) -> str:
    cands = archive.candidates("evaluated")
    wv = selection.latest_version(cands) if weight_version is None else weight_version
    if wv is None:
        return "no candidate has been evaluated yet"
    front = selection.frontier(cands, wv)
    if not front:
        return f"no candidate was evaluated under weight version {wv}; versions: {archive.weight_versions()}"
    lines = [f"Pareto frontier under weight version {wv} ({selection.objectives_text()}), best first:",
             "| rank | id | parent | success | mean turns | mean prompt tokens | truncation | hypothesis |",
             "|---|---|---|---|---|---|---|---|"]
    for i, c in enumerate(front[:k], 1):
        lines.append(f"| {i} | {c.id} | {c.parent or '-'} | {_fmt(c.success_rate)} | {_fmt(c.mean_turns, 2)} | "
                     f"{_fmt(c.mean_prompt_tokens, 1)} | {_fmt(c.scores.get('truncation_rate'))} | "
                     f"{_one_line(c.hypothesis, 120)} |")
    if len(front) > k:
        lines.append(f"({len(front) - k} more on the frontier)")
    return "\n".join(lines)


def history_text(archive: Archive) -> str:
    """Every candidate in creation order: the iteration history."""
    lines = ["| id | parent | iteration | cycle | status | θ version | success | mean turns | truncation | "
             "hypothesis (or why invalid) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for c in archive.candidates():
        s = c.scores or {}
        what = c.hypothesis if c.status != "invalid" else f"INVALID: {c.meta.get('reason', '')} | {c.hypothesis}"
        lines.append(f"| {c.id} | {c.parent or '-'} | {c.iteration} | {c.cycle} | {c.status} | "
                     f"{_fmt(c.weight_version)} | {_fmt(s.get('success_rate'))} | {_fmt(s.get('mean_turns'), 2)} | "
                     f"{_fmt(s.get('truncation_rate'))} | {_one_line(what, 200)} |")
    return "\n".join(lines)


def tool_schemas() -> list[dict[str, Any]]:
    """The OpenAI function tools of the LLM proposer."""

    def fn(name: str, description: str, props: dict[str, Any], required: list[str]) -> dict[str, Any]:
        return {"type": "function", "function": {
            "name": name, "description": description,
            "parameters": {"type": "object", "properties": props, "required": required,
                           "additionalProperties": False}}}

    path = {"type": "string", "description": "relative to the archive root, e.g. 'c003/traces.jsonl'"}
    cid = {"type": "string", "description": "a candidate id, e.g. 'h0' or 'c003'"}
    return [
        fn("list_files", "List a folder of the archive (one folder per candidate, plus summary.jsonl and "
           "frontier.json).", {"path": {**path, "default": "."},
                               "recursive": {"type": "boolean", "default": False}}, []),
        fn("read_file", "Read a text file of the archive with line numbers. traces.jsonl has one JSON trace per "
           "episode per line; scores.json has per-example rows. Long outputs are paged: pass offset (1-based "
           "line) and limit; a very long single line is paged with char_offset.",
           {"path": path, "offset": {"type": "integer", "minimum": 1, "default": 1},
            "limit": {"type": "integer", "minimum": 1, "default": 200},
            "char_offset": {"type": "integer", "minimum": 0, "default": 0}}, ["path"]),
        fn("grep", "Search archive files for a Python regular expression; returns path:line: text.",
           {"pattern": {"type": "string"}, "path": {**path, "default": "."},
            "glob": {"type": "string", "description": "file-name pattern, e.g. 'traces.jsonl' or '*.py'",
                     "default": "*"},
            "max_matches": {"type": "integer", "minimum": 1, "maximum": 1000, "default": 50},
            "ignore_case": {"type": "boolean", "default": False}}, ["pattern"]),
        fn("diff", "Unified diff between the harness code of two candidates.", {"a": cid, "b": cid}, ["a", "b"]),
        fn("show_frontier", "The Pareto frontier (top k) of evaluated candidates under a weight version (default: "
           "the newest).", {"k": {"type": "integer", "minimum": 1, "maximum": 100, "default": 5},
                            "weight_version": {"type": ["integer", "null"], "default": None}}, []),
        fn("list_candidates", "Every candidate in creation order with parent, iteration, status, scores and "
           "hypothesis (or why it was invalid): the iteration history.", {}, []),
        fn("write_candidate", "Submit one new candidate harness: the COMPLETE Python file (not a diff) and the "
           "hypothesis it tests. It is checked at once (it must parse, define run(task, agent) and import only the "
           "standard library) and the result comes back; fix and resubmit when it is rejected. Only candidates "
           "accepted by this tool count.",
           {"code": {"type": "string", "description": "the whole harness.py"},
            "hypothesis": {"type": "string", "description": "what you changed and why you expect it to help, "
                           "citing the trace evidence"},
            "parent": {"type": "string", "description": "the candidate this one derives from (default: the "
                       "frontier's top)"}}, ["code", "hypothesis"]),
    ]


def parse_arguments(raw: Any) -> dict[str, Any]:
    """A tool call's JSON arguments as a dict, or ToolInputError."""
    if raw is None or raw == "":
        return {}
    if isinstance(raw, dict):
        return raw
    try:
        args = json.loads(raw)
    except (TypeError, ValueError) as e:
        raise ToolInputError(f"the arguments are not valid JSON ({e}); send a JSON object") from None
    if not isinstance(args, dict):
        raise ToolInputError(f"the arguments must be a JSON object, got {type(args).__name__}")
    return args


__all__ = ["ArchiveTools", "ToolInputError", "tool_schemas", "parse_arguments", "frontier_text", "history_text",
           "default_parent", "latest_version"]
