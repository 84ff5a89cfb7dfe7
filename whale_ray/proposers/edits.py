"""Edits of harness code with libcst (everything else kept byte for byte), and the edits that turn a
parent into a child (to learn which changes already failed).

  constant   change a top-level UPPERCASE int/float knob within sane bounds (`knobs.numeric_steps`)
  flip       flip a top-level UPPERCASE bool knob
  phrase     append to / remove from a *PROMPT* string constant a phrase of the skill text
  function   replace a top-level function with a skill variant: its imports are added after the
             harness's own when missing, its helpers replaced in place or inserted before the function,
             its constants added only when the harness lacks them (a variant never overrides a knob)
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass
from typing import Any, Iterable

import libcst as cst

from whale_ray.proposers.knobs import function_fingerprint, read_functions, read_knobs, top_assignments
from whale_ray.proposers.skill import FunctionVariant


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


def phrase_in(text: str, phrase: str) -> str:
    """The form of `phrase` as it appears in the prompt `text` (brace-escaped in format templates)."""
    return phrase.replace("{", "{{").replace("}", "}}") if _is_template(text) else phrase


def _append_phrase(text: str, phrase: str) -> str:
    p = phrase_in(text, phrase)
    if not text.strip():
        return p
    if text.endswith("\n"):
        return text + p + "\n"
    if "\n" in text.strip():
        return text + "\n" + p
    return text.rstrip(" ") + " " + p


def _remove_phrase(text: str, phrase: str) -> str:
    p = phrase_in(text, phrase)
    for form in (" " + p, "\n" + p, p + " ", p + "\n", p):
        if form in text:
            return text.replace(form, "", 1)
    return text


def _set_constant(module: cst.Module, name: str, literal: str) -> cst.Module:
    spots = [(i, j) for i, j, n, _ in top_assignments(module) if n == name]
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
                ia, ib = phrase_in(a, ph) in a, phrase_in(b, ph) in b
                if ib and not ia:
                    keys.add((name, f"add:{ph}"))
                elif ia and not ib:
                    keys.add((name, f"remove:{ph}"))
        else:
            keys.add((name, "up" if b > a else "down"))
    pf, cf = read_functions(pm), read_functions(cm)
    for name in set(pf) & set(cf):
        fa, fb = function_fingerprint(parent_code, name), function_fingerprint(child_code, name)
        if fa != fb and fb:
            keys.add((name, f"replace:{fb}"))
    return keys


__all__ = ["Edit", "apply_edit", "changes_between", "phrase_in"]
