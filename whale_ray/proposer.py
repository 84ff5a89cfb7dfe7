"""Harness proposers: read the archive, write new candidate harness files.

`Proposer` is the pluggable interface (`llm` and `agent-cli` are in `whale_ray.proposers`). `OfflineProposer`
needs no model and no API: it picks parents from the archive's Pareto frontier, reads their scores
and traces to diagnose what goes wrong, and applies one or two edits to the parent's code with
libcst (so comments and layout survive):

  constant   change a top-level UPPERCASE int/float knob within sane bounds
  flip       flip a top-level UPPERCASE bool knob
  phrase     append to / remove from a *PROMPT* string constant a phrase from the skill text's
             "## Prompt phrases" section (one "- " bullet each)
  function   replace a top-level function with a variant from the skill text's
             "## Function variants" section ("### <function_name>: <hypothesis>" + one ```python block)

Diagnoses (from the parent's traces and scores) rank these edits: turn-budget exhaustion -> more
turns; completions cut at max tokens -> more tokens; answers without \\boxed{} -> an extraction
variant or a format phrase; failing tools -> tools off, a tool phrase or an observation variant;
harness exceptions -> a variant of the function in the traceback; low success with high variance ->
more votes, lower temperature. Edits that no trace points at are tried afterwards as exploration;
edits that already failed from the same parent are tried last. Every proposal passes
`check_harness_source`, differs from every archive candidate (normalised code), and is a
deterministic function of the archive contents, the skill text, the seed and the iteration.
With `dedupe="weight_version"` it may re-propose code that was only evaluated under older weights.

A variant block may bring imports (added after the harness's own when missing), helper functions or
classes (replaced in place when they exist, else inserted before the function) and constants (only
added when the harness lacks them: a variant never overrides the harness's knobs).
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import json
import math
import random
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Protocol

import libcst as cst

from whale_ray.archive import Archive
from whale_ray.harness import STDLIB_MODULES, check_harness_source, normalize_code

# The final-answer formats the diagnosis recognises ("returned an answer without the marker").
ANSWER_MARKERS = ("\\boxed{", "<answer>")

PROPOSER_KINDS = ("offline", "llm", "agent-cli")


class ProposerError(ValueError):
    """The proposer cannot work on this archive (no candidate at all, say)."""


@dataclass
class Proposal:
    code: str
    parent: str
    hypothesis: str

    def to_dict(self) -> dict[str, str]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Proposal":
        return cls(code=d["code"], parent=d["parent"], hypothesis=d["hypothesis"])


class Proposer(Protocol):
    def propose(
        self, archive: Archive, n: int, iteration: int, *, skill_text: str, seed: int
    ) -> list[Proposal]:
        """Up to `n` new candidates (fewer when no more distinct valid edits exist).

        Model-backed proposers (`llm`, `agent-cli`) also take `limits` (a `proposers.session.Limits`: what
        is left of the run's proposer budget) and `log_path` (where to keep the log of a session in
        progress), and leave the log of the session in `last_session` (a JSON-able dict with "usage")."""
        ...


def make_proposer(kind: str, **kwargs: Any) -> Proposer:
    """The proposer for a config's `harness_phase.proposer` kind. `llm` and `agent-cli` take
    `config=<the HarnessPhaseConfig or its dict>` (see `whale_ray.proposers.proposer_options`)."""
    if kind == "offline":
        return OfflineProposer(**kwargs)
    if kind == "llm":
        from whale_ray.proposers.llm import LLMProposer

        return LLMProposer(**kwargs)
    if kind == "agent-cli":
        from whale_ray.proposers.agent_cli import AgentCLIProposer

        return AgentCLIProposer(**kwargs)
    raise ValueError(f"unknown proposer kind {kind!r}; choose one of {', '.join(PROPOSER_KINDS)}")


# ============================================================================ the skill text


@dataclass(frozen=True)
class FunctionVariant:
    name: str  # the top-level function it replaces
    hypothesis: str  # the heading's one-line hypothesis
    code: str  # the ```python block: imports, optional helpers, and the function

    @property
    def fingerprint(self) -> str:
        return _function_fingerprint(self.code, self.name) or ""


@dataclass
class Skill:
    phrases: list[str] = field(default_factory=list)
    variants: list[FunctionVariant] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


_H2 = re.compile(r"^##(?!#)\s*(.*?)\s*#*\s*$")
_H3 = re.compile(r"^###(?!#)\s*(.*?)\s*#*\s*$")
_FENCE = re.compile(r"^\s*```\s*([A-Za-z0-9_+-]*)\s*$")


def _strip_pair(s: str) -> str:
    s = s.strip()
    for a, b in (("`", "`"), ('"', '"'), ("“", "”")):
        if len(s) >= 2 and s.startswith(a) and s.endswith(b) and not s.startswith("``"):
            return s[len(a):-len(b)].strip()
    return s


def parse_skill(text: str) -> Skill:
    """Read the "## Prompt phrases" and "## Function variants" sections of a domain's skill text.
    Malformed variants are skipped with a warning."""
    skill = Skill()
    lines = (text or "").splitlines()
    section = ""
    i = 0
    heading: str | None = None
    while i < len(lines):
        line = lines[i]
        m2 = _H2.match(line)
        if m2:
            section, heading = m2.group(1).strip().lower(), None
            i += 1
            continue
        if section == "prompt phrases":
            m = re.match(r"^\s*[-*]\s+(.*\S)\s*$", line)
            if m:
                phrase = _strip_pair(m.group(1))
                if phrase and phrase not in skill.phrases:
                    skill.phrases.append(phrase)
        elif section == "function variants":
            m3 = _H3.match(line)
            if m3:
                heading = m3.group(1)
            else:
                mf = _FENCE.match(line)
                if mf:
                    j = i + 1
                    while j < len(lines) and not re.match(r"^\s*```\s*$", lines[j]):
                        j += 1
                    block = "\n".join(lines[i + 1:j]) + "\n"
                    if mf.group(1).lower() in ("python", "py", "python3"):
                        if heading is None:
                            skill.warnings.append(f"skill: a python block at line {i + 1} has no '### name: hypothesis' heading")
                        else:
                            v = _make_variant(heading, block, i + 1, skill.warnings)
                            if v is not None:
                                skill.variants.append(v)
                            heading = None  # one block per heading
                    i = j + 1
                    continue
        i += 1
    return skill


def _make_variant(heading: str, block: str, line: int, warnings: list[str]) -> FunctionVariant | None:
    name_part, _, hyp = heading.partition(":")
    name = _strip_pair(name_part).removesuffix("()").strip()
    where = f"skill: variant '{heading}' (line {line})"
    if not name.isidentifier():
        warnings.append(f"{where}: the heading must read '### <function_name>: <hypothesis>'")
        return None
    try:
        tree = ast.parse(block)
    except SyntaxError as e:
        warnings.append(f"{where}: syntax error at block line {e.lineno}: {e.msg}")
        return None
    if not any(isinstance(s, ast.FunctionDef) and s.name == name for s in tree.body):
        warnings.append(f"{where}: the block does not define a top-level function {name}")
        return None
    for s in tree.body:
        if isinstance(s, (ast.Import, ast.ImportFrom)):
            mods = [a.name for a in s.names] if isinstance(s, ast.Import) else [s.module or ""]
            if getattr(s, "level", 0) or any(m.split(".")[0] not in STDLIB_MODULES for m in mods):
                warnings.append(f"{where}: imports a non-standard-library module")
                return None
        elif not isinstance(s, (ast.FunctionDef, ast.ClassDef, ast.Assign, ast.AnnAssign, ast.Expr)):
            warnings.append(f"{where}: only imports, functions, classes and constants may appear in the block")
            return None
    return FunctionVariant(name=name, hypothesis=hyp.strip() or f"a variant of {name}", code=block)


# ============================================================================ reading a harness


_UPPER = re.compile(r"^[A-Z][A-Z0-9_]*$")


@dataclass(frozen=True)
class Knob:
    name: str
    value: Any  # int | float | bool | str
    literal: str  # the source of the value expression


def _top_assignments(module: cst.Module) -> Iterator[tuple[int, int, str, cst.BaseExpression]]:
    """(statement index, small-statement index, name, value) of top-level `NAME = value` assignments."""
    for i, stmt in enumerate(module.body):
        if not isinstance(stmt, cst.SimpleStatementLine):
            continue
        for j, small in enumerate(stmt.body):
            if isinstance(small, cst.Assign) and len(small.targets) == 1 and isinstance(small.targets[0].target, cst.Name):
                yield i, j, small.targets[0].target.value, small.value
            elif isinstance(small, cst.AnnAssign) and isinstance(small.target, cst.Name) and small.value is not None:
                yield i, j, small.target.value, small.value


def read_knobs(module: cst.Module) -> dict[str, Knob]:
    """Top-level UPPERCASE constants whose value is a literal int, float, bool or str (last assignment wins)."""
    knobs: dict[str, Knob] = {}
    for _, _, name, value in _top_assignments(module):
        if not _UPPER.match(name):
            continue
        literal = module.code_for_node(value)
        try:
            v = ast.literal_eval(literal.strip())
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            knobs.pop(name, None)
            continue
        if isinstance(v, (bool, int, float, str)) and not (isinstance(v, float) and not math.isfinite(v)):
            knobs[name] = Knob(name, v, literal)
        else:
            knobs.pop(name, None)
    return knobs


def read_functions(module: cst.Module) -> dict[str, cst.FunctionDef]:
    return {s.name.value: s for s in module.body if isinstance(s, cst.FunctionDef)}


def _function_fingerprint(code: str, name: str) -> str | None:
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return None
    fns = [s for s in tree.body if isinstance(s, ast.FunctionDef) and s.name == name]
    if not fns:
        return None
    return hashlib.sha1(ast.dump(fns[-1]).encode()).hexdigest()[:12]


# ============================================================================ edits


@dataclass(frozen=True)
class Edit:
    kind: str  # "constant" | "flip" | "phrase_add" | "phrase_remove" | "function"
    target: str  # the constant or function name
    old: Any
    new: Any  # the new value; the phrase; the FunctionVariant

    @property
    def key(self) -> tuple[str, str]:
        """What the edit does, comparable with `changes_between` (used to learn from past children)."""
        if self.kind == "constant":
            return (self.target, "up" if self.new > self.old else "down")
        if self.kind == "flip":
            return (self.target, f"set:{self.new}")
        if self.kind == "phrase_add":
            return (self.target, f"add:{self.new}")
        if self.kind == "phrase_remove":
            return (self.target, f"remove:{self.new}")
        return (self.target, f"replace:{self.new.fingerprint}")

    def describe(self) -> str:
        if self.kind == "constant":
            verb = "Raise" if self.new > self.old else "Lower"
            return f"{verb} {self.target} from {self.old!r} to {self.new!r}"
        if self.kind == "flip":
            return f"Set {self.target} to {self.new} (was {self.old})"
        if self.kind == "phrase_add":
            return f'Append the phrase "{self.new}" to {self.target}'
        if self.kind == "phrase_remove":
            return f'Remove the phrase "{self.new}" from {self.target}'
        return f"Replace {self.target}() with the skill variant '{self.new.hypothesis}'"


def _string_literal(value: str, original: str) -> str:
    m = re.match(r"^\s*\(?\s*([rRuU]*)('''|\"\"\"|'|\")", original)
    quote = m.group(2) if m else '"'
    if len(quote) == 3 and "\\" not in value and quote not in value and not value.endswith(quote[0]) and "\r" not in value:
        return quote + value + quote
    if quote[0] == '"':
        return json.dumps(value, ensure_ascii=False)
    return repr(value)


def _value_literal(value: Any, original: str) -> str:
    if isinstance(value, str):
        return _string_literal(value, original)
    return repr(value)


_FORMAT_FIELD = re.compile(r"(?<!\{)\{[A-Za-z_][A-Za-z0-9_]*(?:\[[^\]]*\]|\.[A-Za-z_]\w*)*(?:![rsa])?(?::[^{}]*)?\}(?!\})")


def _is_template(text: str) -> bool:
    return bool(_FORMAT_FIELD.search(text)) or "{{" in text


def _phrase_in(text: str, phrase: str) -> str:
    """The form of `phrase` as it appears in the prompt `text` (brace-escaped in format templates)."""
    return phrase.replace("{", "{{").replace("}", "}}") if _is_template(text) else phrase


def _append_phrase(text: str, phrase: str) -> str:
    p = _phrase_in(text, phrase)
    if not text.strip():
        return p
    if text.endswith("\n"):
        return text + p + "\n"
    if "\n" in text.strip():
        return text + "\n" + p
    return text.rstrip(" ") + " " + p


def _remove_phrase(text: str, phrase: str) -> str:
    p = _phrase_in(text, phrase)
    for form in (" " + p, "\n" + p, p + " ", p + "\n", p):
        if form in text:
            return text.replace(form, "", 1)
    return text


def _set_constant(module: cst.Module, name: str, literal: str) -> cst.Module:
    spots = [(i, j) for i, j, n, _ in _top_assignments(module) if n == name]
    if not spots:
        raise KeyError(name)
    i, j = spots[-1]
    stmt = module.body[i]
    small = stmt.body[j].with_changes(value=cst.parse_expression(literal))
    new_stmt = stmt.with_changes(body=[small if k == j else s for k, s in enumerate(stmt.body)])
    return module.with_changes(body=[new_stmt if k == i else s for k, s in enumerate(module.body)])


def _bound_import_names(stmt: cst.BaseStatement, module: cst.Module) -> set[str]:
    try:
        tree = ast.parse(module.code_for_node(stmt).strip())
    except SyntaxError:
        return set()
    names = set()
    for s in tree.body:
        if isinstance(s, ast.Import):
            names |= {a.asname or a.name.split(".")[0] for a in s.names}
        elif isinstance(s, ast.ImportFrom):
            names |= {f"{s.module}:{a.asname or a.name}" for a in s.names}
    return names


def _is_import_line(stmt: cst.BaseStatement) -> bool:
    return isinstance(stmt, cst.SimpleStatementLine) and all(
        isinstance(s, (cst.Import, cst.ImportFrom)) for s in stmt.body
    )


def _stmt_name(stmt: cst.BaseStatement) -> str | None:
    if isinstance(stmt, (cst.FunctionDef, cst.ClassDef)):
        return stmt.name.value
    if isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1:
        s = stmt.body[0]
        if isinstance(s, cst.Assign) and len(s.targets) == 1 and isinstance(s.targets[0].target, cst.Name):
            return s.targets[0].target.value
        if isinstance(s, cst.AnnAssign) and isinstance(s.target, cst.Name):
            return s.target.value
    return None


def _replace_function(module: cst.Module, variant: FunctionVariant) -> cst.Module:
    vmod = cst.parse_module(variant.code)
    body = list(module.body)
    idx = [k for k, s in enumerate(body) if isinstance(s, cst.FunctionDef) and s.name.value == variant.name]
    if not idx:
        raise KeyError(variant.name)
    target = idx[-1]
    existing_imports: set[str] = set()
    for s in body:
        if _is_import_line(s):
            existing_imports |= _bound_import_names(s, module)
    top_names = {n: k for k, s in enumerate(body) if (n := _stmt_name(s)) is not None}
    new_imports: list[cst.BaseStatement] = []
    helpers: list[cst.BaseStatement] = []
    new_fn: cst.FunctionDef | None = None
    for s in vmod.body:
        if _is_import_line(s):
            bound = _bound_import_names(s, vmod)
            if not bound <= existing_imports:
                new_imports.append(s.with_changes(leading_lines=[]))
                existing_imports |= bound
        elif isinstance(s, cst.FunctionDef) and s.name.value == variant.name:
            new_fn = s
        else:
            name = _stmt_name(s)
            if name is None:
                continue  # a docstring or comment-only line in the block
            if isinstance(s, (cst.FunctionDef, cst.ClassDef)) and name in top_names:
                k = top_names[name]
                body[k] = s.with_changes(leading_lines=body[k].leading_lines)
            elif name not in top_names:
                gap = [cst.EmptyLine(), cst.EmptyLine()] if isinstance(s, (cst.FunctionDef, cst.ClassDef)) else [cst.EmptyLine()]
                helpers.append(s.with_changes(leading_lines=gap))
    assert new_fn is not None
    body[target] = new_fn.with_changes(leading_lines=body[target].leading_lines)
    body[target:target] = helpers
    if new_imports:
        imp = [k for k, s in enumerate(body) if _is_import_line(s)]
        if imp:
            at = imp[-1] + 1
        else:
            at = 0
            if body and isinstance(body[0], cst.SimpleStatementLine) and isinstance(body[0].body[0], cst.Expr) \
                    and isinstance(body[0].body[0].value, (cst.SimpleString, cst.ConcatenatedString)):
                at = 1  # after the module docstring
        body[at:at] = new_imports
    return module.with_changes(body=body)


def apply_edit(module: cst.Module, edit: Edit) -> cst.Module:
    """The module with one edit applied (libcst keeps everything else byte for byte)."""
    knobs = read_knobs(module)
    if edit.kind in ("constant", "flip"):
        return _set_constant(module, edit.target, _value_literal(edit.new, knobs[edit.target].literal))
    if edit.kind in ("phrase_add", "phrase_remove"):
        k = knobs[edit.target]
        text = _append_phrase(k.value, edit.new) if edit.kind == "phrase_add" else _remove_phrase(k.value, edit.new)
        return _set_constant(module, edit.target, _string_literal(text, k.literal))
    if edit.kind == "function":
        return _replace_function(module, edit.new)
    raise ValueError(f"unknown edit kind {edit.kind!r}")


# ----------------------------------------------------------------------------- knob steps

_TEMP_LADDER = (0.0, 0.2, 0.4, 0.6, 0.7, 0.8, 1.0, 1.2, 1.5)
_TOP_P_LADDER = (0.5, 0.7, 0.8, 0.9, 0.95, 1.0)


def _ladder(v: float, ladder: tuple[float, ...]) -> dict[str, float]:
    out = {}
    lower = [x for x in ladder if x < v - 1e-9]
    higher = [x for x in ladder if x > v + 1e-9]
    if lower:
        out["down"] = lower[-1]
    if higher:
        out["up"] = higher[0]
    return out


def numeric_steps(name: str, value: int | float) -> dict[str, int | float]:
    """The next value up and down for a numeric knob, within sane bounds for what its name says."""
    n = name.upper()
    is_int = isinstance(value, int)
    out: dict[str, int | float] = {}
    if "TEMP" in n:
        return _ladder(float(value), _TEMP_LADDER)
    if "TOP_P" in n:
        return _ladder(float(value), _TOP_P_LADDER)
    if value < 0:
        return {}
    if is_int and ("TURN" in n or "STEP" in n or "ROUND" in n):
        lo, hi = 1, max(16, value)
        out = {"up": max(value + 1, math.ceil(value * 1.5)), "down": min(value - 1, math.floor(value / 1.5))}
    elif is_int and "TOKEN" in n:
        lo, hi = min(16, value), max(4096, value)
        out = {"up": value * 2, "down": value // 2}
    elif is_int and ("VOTE" in n or "SAMPLE" in n):
        lo, hi = 1, max(9, value)
        out = {"up": value + 2, "down": value - 2}
    elif is_int and "TOP_K" in n:
        if value == 0:
            return {}  # 0 means "off" for top-k
        lo, hi = 1, max(200, value)
        out = {"up": value * 2, "down": value // 2}
    elif is_int:
        lo, hi = (0, 1) if value == 0 else (1, min(max(value * 8, 8), 1_000_000))
        out = {"up": 1} if value == 0 else {"up": value * 2, "down": value // 2}
    else:
        if value == 0:
            return {}
        lo, hi = value / 8, min(value * 8, 1e6)
        out = {"up": float(f"{value * 1.5:.3g}"), "down": float(f"{value / 1.5:.3g}")}
    clamped = {}
    for d, v in out.items():
        v = min(max(v, lo), hi)
        if v != value:
            clamped[d] = v
    return clamped


# ============================================================================ diagnosis


_ERROR_TEXT = re.compile(r"Traceback|\bError\b|Error:|Exception|timed out|ToolError|nonzero exit|exit code [1-9]")
_TRACEBACK_FN = re.compile(r"line \d+, in ([A-Za-z_]\w*)")


@dataclass
class Finding:
    """One diagnosed problem: how often it happens and which edits it asks for."""

    name: str
    severity: float  # 0..1, usually the rate
    sentence: str  # cites the numbers; goes into hypotheses
    knobs: list[tuple[Callable[[str, Any], bool], str]] = field(default_factory=list)  # (which knob, direction)
    keywords: tuple[str, ...] = ()  # phrases and variants mentioning these fit
    functions: tuple[str, ...] = ()  # variants of these functions fit
    remove_keywords: tuple[str, ...] = ()  # removing prompt phrases that mention these fits
    phrase_weight: float = 0.7
    variant_weight: float = 0.85


@dataclass
class Diagnosis:
    candidate_id: str
    evaluated: bool
    n: int = 0
    success_rate: float = 0.0
    mean_turns: float = 0.0
    findings: list[Finding] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> str:
        if not self.evaluated:
            return f"{self.candidate_id} is not evaluated yet"
        return f"{self.candidate_id}: success {self.success_rate:.0%} over {self.n} episodes, {self.mean_turns:.1f} turns"


def _pct(k: int, n: int) -> str:
    return f"{k} of {n} episodes ({(k / n if n else 0):.0%})"


def _name_has(*parts: str) -> Callable[[str, Any], bool]:
    return lambda name, value: any(p in name.upper() for p in parts) and not isinstance(value, (bool, str))


def _bool_named(*parts: str) -> Callable[[str, Any], bool]:
    return lambda name, value: isinstance(value, bool) and any(p in name.upper() for p in parts)


def _tool_event(e: dict[str, Any]) -> bool:
    t = str(e.get("type", "")).lower()
    return "tool" in t or "observation" in t or t in ("python", "code", "exec")


def _tool_failed(e: dict[str, Any]) -> bool:
    t = str(e.get("type", "")).lower()
    if "error" in t or "fail" in t or e.get("error"):
        return True
    return any(isinstance(v, str) and _ERROR_TEXT.search(v) for k, v in e.items()
               if k not in ("type", "name", "code", "args", "arguments"))


def diagnose(
    cand: dict[str, Any], *, functions: Iterable[str] = (), answer_marker: str | None = "\\boxed{",
    same_code_rows: list[dict[str, Any]] | None = None,
) -> Diagnosis:
    """Read one evaluated candidate's scores and traces (a `view_for_proposer` item) and say what goes wrong."""
    cid = cand["id"]
    scores = cand.get("scores")
    if not scores:
        return Diagnosis(cid, evaluated=False)
    traces = cand.get("traces") or []
    rows = scores.get("rows") or []
    n = max(len(traces), len(rows), 1)
    sr = float(scores.get("success_rate", 0.0))
    d = Diagnosis(cid, evaluated=True, n=n, success_rate=sr, mean_turns=float(scores.get("mean_turns", 0.0)))
    functions = set(functions)

    n_trunc = n_len = n_calls = n_len_calls = n_none = n_unboxed = n_lost = 0
    n_tool_eps = n_tool_fail = 0
    tool_rewards: list[float] = []
    plain_rewards: list[float] = []
    n_errors = n_timeouts = 0
    err_fns: dict[str, int] = {}
    for i in range(n):
        t = traces[i] if i < len(traces) else {}
        row = rows[i] if i < len(rows) else {}
        status = t.get("status") or row.get("status") or "ok"
        events = [e for e in (t.get("events") or []) if isinstance(e, dict)]
        calls = [c for c in (t.get("calls") or []) if isinstance(c, dict)]
        truncated = bool(row.get("truncated")) or any(e.get("type") == "turn_budget_exhausted" for e in events)
        n_trunc += truncated
        lens = [c.get("finish_reason") == "length" for c in calls]
        n_calls += len(lens)
        n_len_calls += sum(lens)
        n_len += any(lens)
        reward = float(row.get("reward", 0.0))
        answer = t.get("answer") if "answer" in t else row.get("answer")
        if status == "ok" and not truncated:
            if answer is None or (isinstance(answer, str) and not answer.strip()):
                n_none += 1
            elif (answer_marker and isinstance(answer, str) and answer_marker not in answer
                  and (answer_marker != "\\boxed{" or re.search(r"\d", answer))):
                n_unboxed += 1
            if answer_marker and any(answer_marker in str(c.get("completion", "")) for c in calls) and (
                not isinstance(answer, str) or answer_marker not in answer
            ):
                n_lost += 1
        tool_evs = [e for e in events if _tool_event(e)]
        last_msgs = (calls[-1].get("messages") or []) if calls else []
        tool_msgs = [m for m in last_msgs if isinstance(m, dict) and m.get("role") == "tool"]
        if tool_evs or tool_msgs:
            n_tool_eps += 1
            tool_rewards.append(reward)
            if any(_tool_failed(e) for e in tool_evs) or any(
                _ERROR_TEXT.search(str(m.get("content", ""))) for m in tool_msgs
            ):
                n_tool_fail += 1
        else:
            plain_rewards.append(reward)
        if status == "harness_exception":
            n_errors += 1
            frames = [fn for fn in _TRACEBACK_FN.findall(str(t.get("reason") or row.get("reason") or "")) if fn in functions]
            if frames:  # the innermost harness function is the one that raised
                err_fns[frames[-1]] = err_fns.get(frames[-1], 0) + 1
        elif status == "timeout":
            n_timeouts += 1

    n_miss = n_none + n_unboxed
    d.stats = {
        "truncated": n_trunc, "length_episodes": n_len, "length_calls": n_len_calls, "calls": n_calls,
        "no_answer": n_none, "unboxed": n_unboxed, "boxed_lost": n_lost, "tool_episodes": n_tool_eps,
        "tool_failures": n_tool_fail, "harness_exceptions": n_errors, "timeouts": n_timeouts,
    }
    F = d.findings
    if n_trunc / n >= 0.15:
        F.append(Finding(
            "truncation", n_trunc / n,
            f"{_pct(n_trunc, n)} of {cid} ended with turn_budget_exhausted",
            knobs=[(_name_has("TURN", "STEP", "ROUND"), "up")],
            keywords=("early", "turn", "budget", "immediately", "directly", "at most", "stop", "fewer steps"),
            remove_keywords=("python", "tool"),  # tool calls spend turns
            functions=tuple(f for f in functions if f == "run" or "episode" in f or "loop" in f),
        ))
    if n_len / n >= 0.15:
        F.append(Finding(
            "length", n_len / n,
            f"{_pct(n_len, n)} of {cid} had a completion cut at max tokens "
            f"(finish_reason 'length' on {n_len_calls} of {n_calls} calls)",
            knobs=[(_name_has("TOKEN"), "up")],
            keywords=("concise", "brief", "short", "few words", "directly", "cut off", "max_tokens",
                      "length", "unclosed", "truncat"),
            remove_keywords=("step by step", "explain", "show your work"),
        ))
    if n_miss / n >= 0.15 or n_lost / n >= 0.15:
        k = max(n_miss, n_lost)
        marker = {"\\boxed{": "\\boxed{}", "<answer>": "<answer></answer>"}.get(answer_marker, "a final answer")
        detail = f"{n_none} returned no answer, {n_unboxed} returned an answer without {marker}"
        if n_lost:
            detail += f", {n_lost} wrote {marker} in a completion that the answer lost"
        F.append(Finding(
            "extraction", k / n,
            f"{_pct(k, n)} of {cid} that finished in time had no usable {marker} answer ({detail})",
            keywords=("boxed", "extract", "final answer", "format", "last number", "answer"),
            functions=tuple(f for f in functions if "extract" in f or "answer" in f or "parse" in f),
            phrase_weight=0.6, variant_weight=1.0,
        ))
    if n_tool_eps >= 2 and n_tool_fail / n_tool_eps >= 0.3:
        a = sum(tool_rewards) / len(tool_rewards) if tool_rewards else 0.0
        b = sum(plain_rewards) / len(plain_rewards) if plain_rewards else 0.0
        F.append(Finding(
            "tool_failures", n_tool_fail / n_tool_eps,
            f"{n_tool_fail} of {n_tool_eps} episodes of {cid} that used a tool saw it fail "
            f"(success {a:.0%} with tools, {b:.0%} without)",
            knobs=[(_bool_named("TOOL"), "set:False")],
            keywords=("tool", "python", "print", "code", "error", "observation"),
            remove_keywords=("python", "tool"),
            functions=tuple(f for f in functions if "tool" in f or "observation" in f or "call" in f),
        ))
    if n_errors / n >= 0.1:
        named = ", ".join(f"{fn} x{k}" for fn, k in sorted(err_fns.items(), key=lambda x: (-x[1], x[0])))
        F.append(Finding(
            "harness_errors", n_errors / n,
            f"{_pct(n_errors, n)} of {cid} ended in harness_exception" + (f" (raised in {named})" if named else ""),
            keywords=("error", "robust", "fallback"),
            functions=tuple(sorted(err_fns)),
            phrase_weight=0.0,
        ))
    if n_timeouts / n >= 0.1:
        F.append(Finding(
            "timeouts", 0.6 * n_timeouts / n,
            f"{_pct(n_timeouts, n)} of {cid} hit the sandbox wall-clock limit",
            knobs=[(_name_has("VOTE", "SAMPLE"), "down"), (_name_has("TOKEN"), "down")],
            phrase_weight=0.0, variant_weight=0.0,
        ))
    tool_flag_on = cand.get("_tools_offered")
    if tool_flag_on and n_tool_eps == 0 and n >= 5:
        F.append(Finding(
            "tools_unused", 0.3,
            f"{cid} offers tools but none of its {n} episodes used one",
            keywords=("tool", "python", "calculate", "compute"),
            variant_weight=0.5,
        ))
    if 0 < sr < 0.5:
        mixed = multi = 0
        if same_code_rows:
            by_task: dict[str, list[float]] = {}
            for r in same_code_rows:
                by_task.setdefault(str(r.get("task_id")), []).append(float(r.get("reward", 0.0)))
            multi = sum(1 for v in by_task.values() if len(v) > 1)
            mixed = sum(1 for v in by_task.values() if len(v) > 1 and min(v) != max(v))
        if multi:
            if mixed / multi >= 0.2:
                F.append(Finding(
                    "noise", min(1.0, mixed / multi),
                    f"{cid} succeeds on only {sr:.0%} and {mixed} of {multi} tasks it ran more than once had "
                    "mixed outcomes (sampling noise)",
                    knobs=[(_name_has("VOTE", "SAMPLE"), "up"), (_name_has("TEMP"), "down")],
                    phrase_weight=0.0, variant_weight=0.0,
                ))
        else:
            std = math.sqrt(sr * (1 - sr))
            if std >= 0.2:
                F.append(Finding(
                    "noise", 0.25 * std,
                    f"{cid} succeeds on only {sr:.0%} with a per-episode reward std of {std:.2f} "
                    "(the model solves some tasks sometimes; voting or cooler sampling may make that reliable)",
                    knobs=[(_name_has("VOTE", "SAMPLE"), "up"), (_name_has("TEMP"), "down")],
                    phrase_weight=0.0, variant_weight=0.0,
                ))
    F.sort(key=lambda f: -f.severity)
    return d


def changes_between(parent_code: str, child_code: str, phrases: Iterable[str] = ()) -> set[tuple[str, str]]:
    """Edit keys (see `Edit.key`) that turn the parent into the child, as far as they can be told."""
    try:
        pm, cm = cst.parse_module(parent_code), cst.parse_module(child_code)
    except cst.ParserSyntaxError:
        return set()
    pk, ck = read_knobs(pm), read_knobs(cm)
    keys: set[tuple[str, str]] = set()
    for name in set(pk) & set(ck):
        a, b = pk[name].value, ck[name].value
        if a == b or type(a) is not type(b) and not (isinstance(a, (int, float)) and isinstance(b, (int, float))):
            continue
        if isinstance(a, bool) or isinstance(b, bool):
            keys.add((name, f"set:{b}"))
        elif isinstance(a, str):
            for ph in phrases:
                ia, ib = _phrase_in(a, ph) in a, _phrase_in(b, ph) in b
                if ib and not ia:
                    keys.add((name, f"add:{ph}"))
                elif ia and not ib:
                    keys.add((name, f"remove:{ph}"))
        else:
            keys.add((name, "up" if b > a else "down"))
    pf, cf = read_functions(pm), read_functions(cm)
    for name in set(pf) & set(cf):
        fa, fb = _function_fingerprint(parent_code, name), _function_fingerprint(child_code, name)
        if fa != fb and fb:
            keys.add((name, f"replace:{fb}"))
    return keys


# ============================================================================ the offline proposer


@dataclass
class _Move:
    edit: Edit
    score: float
    reason: str


class _Queue:
    """Edit combinations to try for one parent, best first: each ranked edit alone (a diagnosed one
    sometimes joined by the next diagnosed edit on another target, falling back to the edit alone
    when the pair is rejected), then pairs of the top edits once the singles run out."""

    def __init__(self, moves: list[_Move], rng: random.Random, second_prob: float, pair_pool: int) -> None:
        self.moves, self.rng, self.second_prob, self.pair_pool = moves, rng, second_prob, pair_pool
        self.i = 0
        self.fallback: list[_Move] | None = None
        self.pairs: list[list[_Move]] | None = None

    def take(self) -> list[_Move] | None:
        if self.fallback is not None:
            combo, self.fallback = self.fallback, None
            return combo
        if self.i < len(self.moves):
            m = self.moves[self.i]
            self.i += 1
            combo = [m]
            if m.score > 0.05 and self.rng.random() < self.second_prob:
                for o in self.moves[self.i:]:
                    if o.score > 0.05 and o.edit.target != m.edit.target:
                        combo.append(o)
                        self.fallback = [m]
                        break
            return combo
        if self.pairs is None:
            top = self.moves[: self.pair_pool]
            self.pairs = [[a, b] for k, a in enumerate(top) for b in top[k + 1:] if a.edit.target != b.edit.target]
        return self.pairs.pop(0) if self.pairs else None

    def accepted(self) -> None:
        self.fallback = None


class OfflineProposer:
    """Trace-informed edits of harness code, without a model. See the module docstring."""

    kind = "offline"

    DEDUPE_SCOPES = ("archive", "weight_version")

    def __init__(
        self, *, other_parent_prob: float = 0.34, second_edit_prob: float = 0.5, pair_pool: int = 8,
        dedupe: str = "archive",
    ) -> None:
        """`dedupe`: "archive" never proposes code equal to any archive candidate; "weight_version"
        allows code that was only evaluated under older weights (it may pay off under the new ones)."""
        if dedupe not in self.DEDUPE_SCOPES:
            raise ValueError(f"unknown dedupe scope {dedupe!r}; choose one of {', '.join(self.DEDUPE_SCOPES)}")
        self.dedupe = dedupe
        self.other_parent_prob = other_parent_prob
        self.second_edit_prob = second_edit_prob
        self.pair_pool = pair_pool
        self.notes: list[str] = []  # what the last call diagnosed and skipped, for logs

    # ------------------------------------------------------------------ parents
    def _parents(self, archive: Archive, n: int, rng: random.Random) -> list[str]:
        evaluated = archive.candidates("evaluated")
        if not evaluated:
            all_c = archive.candidates()
            usable = [c for c in all_c if c.status != "invalid"] or all_c
            if not usable:
                raise ProposerError(f"archive {archive.root} is empty: add the seed harness (h0) first")
            seeds = [c for c in usable if c.parent is None] or usable
            self.notes.append(f"no evaluated candidate yet; proposing from {seeds[0].id} without a diagnosis")
            return [seeds[0].id] * n
        latest = max((c.weight_version for c in evaluated if c.weight_version is not None), default=None)
        best = archive.best(weight_version=latest)
        others = [c.id for c in archive.frontier(weight_version=latest) if c.id != best.id]
        if not others:
            others = [c.id for c in archive.frontier() if c.id != best.id]
        slots = [best.id]
        for _ in range(n - 1):
            slots.append(rng.choice(others) if others and rng.random() < self.other_parent_prob else best.id)
        return slots

    # ------------------------------------------------------------------ moves
    def _moves(
        self, code: str, diag: Diagnosis, skill: Skill, failed: set[tuple[str, str]], rng: random.Random,
    ) -> list[_Move]:
        module = cst.parse_module(code)
        knobs = read_knobs(module)
        fns = read_functions(module)
        edits: list[Edit] = []
        for name, k in knobs.items():
            v = k.value
            if isinstance(v, bool):
                edits.append(Edit("flip", name, v, not v))
            elif isinstance(v, (int, float)):
                for direction, new in sorted(numeric_steps(name, v).items()):
                    edits.append(Edit("constant", name, v, new))
            elif isinstance(v, str) and "PROMPT" in name and not k.literal.lstrip("( \n").lower().startswith(("f", "rf", "fr", "b", "rb", "br")):
                for ph in skill.phrases:
                    if _phrase_in(v, ph) in v:
                        edits.append(Edit("phrase_remove", name, v, ph))
                    else:
                        edits.append(Edit("phrase_add", name, v, ph))
        for var in skill.variants:
            if var.name in fns and _function_fingerprint(code, var.name) != var.fingerprint:
                edits.append(Edit("function", var.name, None, var))

        moves = []
        base = diag.summary()
        for e in edits:
            best_score, best_reason, penalty, against = 0.0, "", 0.0, ""
            for f in diag.findings:
                s = 0.0
                if e.kind in ("constant", "flip"):
                    for pred, direction in f.knobs:
                        if pred(e.target, e.old):
                            if e.key[1] == direction:
                                s = max(s, f.severity)
                            elif -0.5 * f.severity < penalty:  # the opposite of what this finding asks for
                                penalty, against = -0.5 * f.severity, f.sentence
                elif e.kind == "phrase_add" and f.phrase_weight:
                    hits = sum(1 for kw in f.keywords if kw in e.new.lower())
                    if hits:
                        s = f.severity * f.phrase_weight * min(1.0, 0.6 + 0.2 * hits)
                elif e.kind == "phrase_remove" and f.remove_keywords:
                    hits = sum(1 for kw in f.remove_keywords if kw in e.new.lower())
                    if hits:
                        s = f.severity * 0.6 * min(1.0, 0.6 + 0.2 * hits)
                elif e.kind == "function" and f.variant_weight:
                    text = f"{e.target} {e.new.hypothesis}".lower()
                    hits = sum(1 for kw in f.keywords if kw in text)
                    if e.target in f.functions:
                        s = f.severity * f.variant_weight * min(1.0, 0.8 + 0.1 * hits)
                    elif hits:
                        s = f.severity * f.variant_weight * min(0.8, 0.4 + 0.15 * hits)
                if s > best_score:
                    best_score, best_reason = s, f.sentence
            if best_score > 0:
                score = best_score + penalty
                reason = best_reason
            else:
                prior = {"function": 0.02, "phrase_add": 0.015, "constant": 0.01, "flip": 0.01, "phrase_remove": 0.005}[e.kind]
                score = penalty + prior * (0.5 + rng.random())
                if against:
                    reason = (f"exploration, although {against}: it may still win on the Pareto frontier "
                              "by spending fewer turns or tokens")
                elif diag.evaluated:
                    reason = f"exploration: no trace signal of {diag.candidate_id} points at this change ({base})"
                else:
                    reason = f"exploration: {base}"
            if e.key in failed:
                score -= 1.0
                reason += f"; a child of {diag.candidate_id} that made this change did not improve on it"
            moves.append(_Move(e, score, reason))
        # stable ranking: score, then a seeded tie-break
        ranked = [(m, rng.random()) for m in moves]
        ranked.sort(key=lambda t: (-t[0].score, t[1]))
        return [m for m, _ in ranked]

    def _failed_keys(self, archive_view: list[dict[str, Any]], parent: dict[str, Any], phrases: list[str]) -> set[tuple[str, str]]:
        """Edits already tried from this parent whose child was invalid or not better."""
        failed: set[tuple[str, str]] = set()
        p_sr = (parent.get("scores") or {}).get("success_rate")
        for c in archive_view:
            if c.get("parent") != parent["id"] or c["id"] == parent["id"]:
                continue
            c_sr = (c.get("scores") or {}).get("success_rate")
            if c["status"] == "invalid" or (c_sr is not None and p_sr is not None and c_sr <= p_sr):
                keys = changes_between(parent["code"], c["code"], phrases)
                if 0 < len(keys) <= 2:
                    failed |= keys
        return failed

    # ------------------------------------------------------------------ propose
    def propose(
        self, archive: Archive, n: int, iteration: int, *, skill_text: str, seed: int
    ) -> list[Proposal]:
        if n <= 0:
            return []
        self.notes = []
        skill = parse_skill(skill_text)
        self.notes += skill.warnings
        all_cands = archive.candidates()
        norms = {c.id: normalize_code(c.code) for c in all_cands}
        fingerprint = hashlib.sha1(
            "\n".join(f"{c.id}:{c.status}:{c.weight_version}:{norms[c.id]}" for c in all_cands).encode()
        ).hexdigest()
        rng = random.Random(f"whale-offline:{seed}:{iteration}:{fingerprint}")
        latest = max((c.weight_version for c in all_cands if c.weight_version is not None), default=None)
        seen = {
            norms[c.id] for c in all_cands
            if self.dedupe == "archive" or c.status != "evaluated" or c.weight_version == latest
        }
        slots = self._parents(archive, n, rng)
        parent_ids = sorted(set(slots))
        view = archive.view_for_proposer(traces=parent_ids)
        by_id = {c["id"]: c for c in view}
        answer_marker = next((m for m in ANSWER_MARKERS if m in (skill_text or "") or any(
            m in c["code"] for c in view)), None)

        queues: dict[str, _Queue] = {}
        diags: dict[str, Diagnosis] = {}
        for pid in parent_ids:
            pc = by_id.get(pid) or {"id": pid, "code": archive.get(pid).code, "scores": None, "traces": None}
            try:
                module = cst.parse_module(pc["code"])
            except cst.ParserSyntaxError as e:
                self.notes.append(f"{pid}: libcst cannot parse it ({e.message}); no edits from it")
                queues[pid] = _Queue([], rng, 0.0, 0)
                continue
            knobs = read_knobs(module)
            pc = {**pc, "_tools_offered": any(isinstance(k.value, bool) and k.value and "TOOL" in k.name for k in knobs.values())}
            same_rows: list[dict[str, Any]] = []
            wv = pc.get("weight_version")
            for c in view:
                if c.get("scores") and c.get("weight_version") == wv and norms.get(c["id"]) == norms.get(pid):
                    same_rows += c["scores"].get("rows") or []
            diag = diagnose(pc, functions=read_functions(module), answer_marker=answer_marker, same_code_rows=same_rows)
            diags[pid] = diag
            for f in diag.findings:
                self.notes.append(f"{pid}: {f.name} ({f.severity:.2f}): {f.sentence}")
            failed = self._failed_keys(view, pc, skill.phrases)
            moves = self._moves(pc["code"], diag, skill, failed, rng)
            queues[pid] = _Queue(moves, rng, self.second_edit_prob, self.pair_pool)

        proposals: list[Proposal] = []
        for pid in slots:
            parent_code = by_id[pid]["code"] if pid in by_id else archive.get(pid).code
            q = queues[pid]
            while (combo := q.take()) is not None:
                try:
                    module = cst.parse_module(parent_code)
                    for m in combo:
                        module = apply_edit(module, m.edit)
                    code = module.code
                    check_harness_source(code, f"proposal from {pid}")
                except Exception as e:  # a bad edit is skipped, never the whole harness phase
                    self.notes.append(f"{pid}: skipped {' + '.join(m.edit.describe() for m in combo)}: {e}")
                    continue
                norm = normalize_code(code)
                if norm in seen:
                    continue
                seen.add(norm)
                proposals.append(Proposal(code=code, parent=pid, hypothesis=self._hypothesis(combo, diags[pid])))
                q.accepted()
                break
            else:
                self.notes.append(f"{pid}: no further distinct valid edit; returning fewer proposals")
        return proposals

    @staticmethod
    def _hypothesis(combo: list[_Move], diag: Diagnosis) -> str:
        parts = [f"{m.edit.describe()} because {m.reason}" if k == 0 or m.reason != combo[0].reason
                 else f"{m.edit.describe()} for the same reason" for k, m in enumerate(combo)]
        text = "; and ".join(parts[:1] + [p[0].lower() + p[1:] for p in parts[1:]]) + "."
        if diag.evaluated:
            text += (f" Parent {diag.candidate_id}: success {diag.success_rate:.0%} over {diag.n} episodes, "
                     f"{diag.mean_turns:.1f} turns on average.")
        else:
            text += f" Parent {diag.candidate_id} has no evaluation yet."
        return text


__all__ = [
    "PROPOSER_KINDS", "Proposal", "Proposer", "OfflineProposer", "ProposerError", "make_proposer",
    "FunctionVariant", "Skill", "parse_skill", "Edit", "apply_edit", "read_knobs", "read_functions",
    "numeric_steps", "Diagnosis", "Finding", "diagnose", "changes_between",
]
