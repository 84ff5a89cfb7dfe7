"""The harness contract, checked statically in the trusted process.

A harness is one untrusted Python file (see docs/contracts.md). The trusted side never imports or
executes it: it only parses the source and checks the shape of the contract. Running it happens in
the sandbox.
"""

from __future__ import annotations

import ast
import difflib
import sys
from pathlib import Path

STDLIB_MODULES = frozenset(sys.stdlib_module_names)


class HarnessError(ValueError):
    """A harness file breaks the contract; the message names the file and what is wrong."""


def _module_errors(tree: ast.Module, filename: str) -> None:
    def non_stdlib(module: str, line: int, how: str) -> None:
        top = module.split(".")[0]
        if top not in STDLIB_MODULES:
            raise HarnessError(
                f"harness {filename}: line {line}: {how} {module!r}, which is not a standard-library module "
                "(a harness may import only the standard library)"
            )

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                non_stdlib(alias.name, node.lineno, "imports")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                raise HarnessError(
                    f"harness {filename}: line {node.lineno}: relative import 'from {'.' * node.level}"
                    f"{node.module or ''} import ...' (a harness is a single file; import only the standard library)"
                )
            non_stdlib(node.module or "", node.lineno, "imports from")
        elif isinstance(node, ast.Call) and node.args:
            # __import__("x") and importlib.import_module("x") with a literal name
            func = node.func
            dynamic = (isinstance(func, ast.Name) and func.id == "__import__") or (
                isinstance(func, ast.Attribute) and func.attr == "import_module"
            )
            first = node.args[0]
            if dynamic and isinstance(first, ast.Constant) and isinstance(first.value, str) and first.value:
                non_stdlib(first.value, node.lineno, "dynamically imports")


def _run_errors(tree: ast.Module, filename: str) -> None:
    runs = [s for s in tree.body if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)) and s.name == "run"]
    if not runs:
        raise HarnessError(f"harness {filename}: defines no top-level function run(task, agent)")
    run = runs[-1]  # the last definition is the one that counts at runtime
    if isinstance(run, ast.AsyncFunctionDef):
        raise HarnessError(f"harness {filename}: line {run.lineno}: run must be a plain 'def', not 'async def'")
    a = run.args
    positional = [p.arg for p in a.posonlyargs + a.args]
    extras = []
    if a.vararg:
        extras.append(f"*{a.vararg.arg}")
    extras += [f"{p.arg} (keyword-only)" for p in a.kwonlyargs]
    if a.kwarg:
        extras.append(f"**{a.kwarg.arg}")
    if len(positional) != 2 or extras:
        got = ", ".join(positional + extras) or "no parameters"
        raise HarnessError(
            f"harness {filename}: line {run.lineno}: run must take exactly two positional parameters "
            f"(task, agent); it takes {got}"
        )


def check_harness_source(source: str, filename: str) -> None:
    """Static checks, without executing anything: it parses, defines a top-level `def run(task, agent)`
    with exactly two positional parameters, and imports only standard-library modules."""
    if not isinstance(source, str):
        raise HarnessError(f"harness {filename}: source must be text, got {type(source).__name__}")
    if not source.strip():
        raise HarnessError(f"harness {filename}: is empty")
    try:
        tree = ast.parse(source, filename=filename)
    except SyntaxError as e:
        raise HarnessError(f"harness {filename}: syntax error at line {e.lineno}: {e.msg}") from None
    except ValueError as e:  # e.g. null bytes in the source
        raise HarnessError(f"harness {filename}: cannot be parsed: {e}") from None
    _module_errors(tree, filename)
    _run_errors(tree, filename)


def load_harness_file(path: str | Path) -> str:
    """Read a harness file (clear errors for missing, not .py, not UTF-8, empty) and check it."""
    p = Path(path)
    if not p.exists():
        raise HarnessError(f"harness file {p}: not found")
    if not p.is_file():
        raise HarnessError(f"harness file {p}: not a regular file")
    if p.suffix != ".py":
        raise HarnessError(f"harness file {p}: not a .py file")
    raw = p.read_bytes()
    try:
        source = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise HarnessError(f"harness file {p}: not UTF-8 text (invalid byte at offset {e.start})") from None
    if not source.strip():
        raise HarnessError(f"harness file {p}: is empty")
    check_harness_source(source, str(p))
    return source


def harness_diff(old: str, new: str, old_name: str = "a/harness.py", new_name: str = "b/harness.py") -> str:
    """A unified diff from `old` to `new` (empty string when they are equal)."""

    def lines(text: str) -> list[str]:
        out = text.splitlines(keepends=True)
        if out and not out[-1].endswith(("\n", "\r")):
            out[-1] += "\n\\ No newline at end of file\n"
        return out

    return "".join(difflib.unified_diff(lines(old), lines(new), fromfile=old_name, tofile=new_name))


def normalize_code(code: str) -> str:
    """A form of the source that ignores comments, blank lines and formatting (the AST dump), so two
    candidates that differ only in layout compare equal. Falls back to stripped lines when it does not parse."""
    try:
        return ast.dump(ast.parse(code), annotate_fields=True, include_attributes=False)
    except (SyntaxError, ValueError):
        return "\n".join(line.rstrip() for line in code.strip().splitlines() if line.strip())
