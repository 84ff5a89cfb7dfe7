"""A domain's skill text as the offline proposer reads it: the "## Prompt phrases" bullets and the
"## Function variants" ("### <function_name>: <hypothesis>" + one ```python block each)."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field

from whale_ray.harness import STDLIB_MODULES
from whale_ray.proposers.knobs import function_fingerprint


@dataclass(frozen=True)
class FunctionVariant:
    name: str  # the top-level function it replaces
    hypothesis: str  # the heading's one-line hypothesis
    code: str  # the ```python block: imports, optional helpers, and the function

    @property
    def fingerprint(self) -> str:
        return function_fingerprint(self.code, self.name) or ""


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


__all__ = ["FunctionVariant", "Skill", "parse_skill"]
