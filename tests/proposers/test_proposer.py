"""Harness checks, the skill text, the offline proposer's edits and diagnoses, and the Ray actor shell."""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path

import libcst as cst
import pytest

from whale_ray.archive import Archive
from whale_ray.harness import HarnessError, check_harness_source, harness_diff, load_harness_file, normalize_code
from whale_ray.proposers.base import Proposal, ProposerError
from whale_ray.proposers.edits import Edit, apply_edit, changes_between
from whale_ray.proposers.knobs import numeric_steps, read_knobs
from whale_ray.proposers.offline import OfflineProposer
from whale_ray.proposers.registry import make_proposer, proposer_options
from whale_ray.proposers.skill import parse_skill

H0 = r'''"""A small test harness in the h0 style."""
import json
import re

SYSTEM_PROMPT = "Solve the problem. You can run python."
USER_TEMPLATE_PROMPT = "Question: {question}\nThink step by step."
NOTES_PROMPT = """Rules:
- be careful
"""
MAX_TURNS = 2
MAX_TOKENS = 48
TEMPERATURE = 1.0
TOP_K = 20
N_VOTES = 1
OFFER_TOOLS = True  # offer the python tool


def build_messages(task):
    user = USER_TEMPLATE_PROMPT.format(question=task["question"])
    return [{"role": "system", "content": SYSTEM_PROMPT + "\n" + NOTES_PROMPT}, {"role": "user", "content": user}]


def find_tool_call(text):
    m = re.search(r"<python>(.*?)</python>", text, re.S)
    return m.group(1) if m else None


def format_observation(output):
    return "Output: " + output


def extract_answer(text):
    m = re.findall(r"\\boxed\{([^{}]*)\}", text or "")
    return "\\boxed{" + m[-1] + "}" if m else None


def run(task, agent):
    messages = build_messages(task)
    for _ in range(MAX_TURNS):
        out = agent.generate(messages, max_tokens=MAX_TOKENS, temperature=TEMPERATURE, top_k=TOP_K)
        code = find_tool_call(out) if OFFER_TOOLS else None
        if code is None:
            return extract_answer(out)
        messages += [{"role": "assistant", "content": out},
                     {"role": "user", "content": format_observation(agent.tool("python", code=code))}]
    agent.log("turn_budget_exhausted", turns=MAX_TURNS)
    return None
'''

SKILL = r'''# Skill: math harness

## What you must not change
- The verifier reads the last \boxed{} of the response.

## Prompt phrases
- Put the final answer in \boxed{}.
- Be concise.
- Answer directly; stop as soon as you know the final answer.
- If a tool call fails, read the error and fix the code.

## Function variants

### extract_answer: fall back to the last number when there is no \boxed{}
```python
def extract_answer(text):
    m = re.findall(r"\\boxed\{([^{}]*)\}", text or "")
    if m:
        return "\\boxed{" + m[-1] + "}"
    nums = re.findall(r"-?\d+(?:\.\d+)?", text or "")
    return "\\boxed{" + nums[-1] + "}" if nums else None
```

### format_observation: clip long tool output and flag errors so the model can fix its code
```python
import textwrap

OBS_LIMIT = 300


def _clip(text):
    return textwrap.shorten(text, OBS_LIMIT)


def format_observation(output):
    if "Error" in output:
        return "The code failed: " + _clip(output) + "\nFix the code and try again."
    return "Output: " + _clip(output)
```

### summarize_history: a function this harness does not have
```python
def summarize_history(messages):
    return messages[-4:]
```

### extract_answer: needs numpy (not allowed)
```python
import numpy

def extract_answer(text):
    return None
```

### build_messages: the block forgets to define it
```python
def something_else():
    pass
```
'''


# ------------------------------------------------------------------------------------------ helpers


def knob(code: str, name: str):
    return read_knobs(cst.parse_module(code))[name].value


def function_source(code: str, name: str) -> str:
    tree = ast.parse(code)
    return next(ast.unparse(s) for s in tree.body if isinstance(s, ast.FunctionDef) and s.name == name)


def trace(i: int, *, answer=None, events=(), finish="stop", completion="...", status="ok", reason="", messages=()):
    return json.dumps({
        "task": {"id": f"t{i}", "question": f"q{i}"},
        "calls": [{"messages": list(messages), "completion": completion, "finish_reason": finish}],
        "events": list(events), "answer": answer, "status": status, "reason": reason,
    })


def row(i: int, reward: float, *, status="ok", turns=2, tokens=100, task=None):
    return {"task_id": task or f"t{i}", "reward": reward, "turns": turns, "prompt_tokens": tokens, "status": status}


def seeded(tmp_path: Path, code: str = H0) -> Archive:
    a = Archive(tmp_path / "archive")
    a.add_candidate(code, parent=None, hypothesis="seed", iteration=1, cycle=0, candidate_id="h0")
    return a


def propose(a: Archive, n: int = 3, seed: int = 0, iteration: int = 2, skill: str = SKILL) -> list[Proposal]:
    props = OfflineProposer().propose(a, n, iteration, skill_text=skill, seed=seed).proposals
    for p in props:
        check_harness_source(p.code, "proposal")
        assert p.hypothesis and p.parent
    return props


# --------------------------------------------------------------------------- check_harness_source


def test_check_accepts_a_valid_harness() -> None:
    check_harness_source(H0, "h0.py")
    check_harness_source("import collections.abc\nfrom os import path\ndef run(task, agent=None):\n    pass\n", "x.py")


@pytest.mark.parametrize(
    "source, message",
    [
        ("x = 1\n\ndef run(task, agent)\n    pass\n", r"harness x\.py: syntax error at line 3: "),
        ("def main(task, agent):\n    pass\n", r"defines no top-level function run\(task, agent\)"),
        ("class A:\n    def run(self, task, agent):\n        pass\n", r"defines no top-level function run"),
        ("def run(task):\n    pass\n", r"line 1: run must take exactly two positional parameters \(task, agent\); it takes task$"),
        ("def run(task, agent, extra):\n    pass\n", r"it takes task, agent, extra"),
        ("def run(task, agent, *rest):\n    pass\n", r"it takes task, agent, \*rest"),
        ("def run(task, *, agent):\n    pass\n", r"agent \(keyword-only\)"),
        ("async def run(task, agent):\n    pass\n", r"plain 'def', not 'async def'"),
        ("import numpy as np\ndef run(task, agent):\n    pass\n", r"line 1: imports 'numpy', which is not a standard-library module"),
        ("def run(task, agent):\n    from torch.nn import functional\n", r"line 2: imports from 'torch.nn'"),
        ("from . import tools\ndef run(task, agent):\n    pass\n", r"relative import"),
        ("def run(task, agent):\n    __import__('requests')\n", r"dynamically imports 'requests'"),
        ("   \n", r"is empty"),
    ],
)
def test_check_rejects(source: str, message: str) -> None:
    with pytest.raises(HarnessError, match=message):
        check_harness_source(source, "x.py")


def test_load_harness_file(tmp_path: Path) -> None:
    good = tmp_path / "h.py"
    good.write_text(H0)
    assert load_harness_file(good) == H0
    with pytest.raises(HarnessError, match="not found"):
        load_harness_file(tmp_path / "missing.py")
    (tmp_path / "h.txt").write_text(H0)
    with pytest.raises(HarnessError, match=r"not a \.py file"):
        load_harness_file(tmp_path / "h.txt")
    (tmp_path / "bin.py").write_bytes(b"def run(task, agent):\n    return '\xff'\n")
    with pytest.raises(HarnessError, match="not UTF-8"):
        load_harness_file(tmp_path / "bin.py")
    (tmp_path / "empty.py").write_text("\n\n")
    with pytest.raises(HarnessError, match="is empty"):
        load_harness_file(tmp_path / "empty.py")
    (tmp_path / "bad.py").write_text("def run(task, agent):\n  return (\n")
    with pytest.raises(HarnessError, match=r"bad\.py: syntax error at line"):
        load_harness_file(tmp_path / "bad.py")
    with pytest.raises(HarnessError, match="not a regular file"):
        load_harness_file(tmp_path)


def test_harness_diff_and_normalize() -> None:
    new = H0.replace("MAX_TURNS = 2", "MAX_TURNS = 3")
    d = harness_diff(H0, new, "h0/harness.py", "c001/harness.py")
    assert d.startswith("--- h0/harness.py\n+++ c001/harness.py\n") and "-MAX_TURNS = 2\n+MAX_TURNS = 3\n" in d
    assert harness_diff(H0, H0) == ""
    assert "No newline at end of file" in harness_diff("a = 1", "a = 2")
    assert normalize_code(H0) == normalize_code(H0.replace("  # offer the python tool", "") + "\n\n# a comment\n")
    assert normalize_code(H0) != normalize_code(new)


# ------------------------------------------------------------------------------------- skill text


def test_parse_skill_sections() -> None:
    skill = parse_skill(SKILL)
    assert skill.phrases == [
        r"Put the final answer in \boxed{}.", "Be concise.",
        "Answer directly; stop as soon as you know the final answer.",
        "If a tool call fails, read the error and fix the code.",
    ]  # bullets of other sections are not phrases
    assert [v.name for v in skill.variants] == ["extract_answer", "format_observation", "summarize_history"]
    assert skill.variants[0].hypothesis == r"fall back to the last number when there is no \boxed{}"
    assert "def extract_answer(text):" in skill.variants[0].code
    assert len(skill.warnings) == 2
    assert any("non-standard-library" in w for w in skill.warnings)
    assert any("does not define a top-level function build_messages" in w for w in skill.warnings)
    assert parse_skill("") .phrases == [] and parse_skill("no sections at all").variants == []


# ------------------------------------------------------------------------------------- edit kinds


def test_edit_constant_int_and_float() -> None:
    module = cst.parse_module(H0)
    code = apply_edit(module, Edit("constant", "MAX_TURNS", 2, 3)).code
    check_harness_source(code, "edited")
    assert knob(code, "MAX_TURNS") == 3 and "MAX_TURNS = 3\n" in code
    assert harness_diff(H0, code).count("\n-") == 1  # only that line changed; comments kept
    code = apply_edit(module, Edit("constant", "TEMPERATURE", 1.0, 0.8)).code
    assert knob(code, "TEMPERATURE") == 0.8 and isinstance(knob(code, "TEMPERATURE"), float)
    assert Edit("constant", "TEMPERATURE", 1.0, 0.8).describe() == "Lower TEMPERATURE from 1.0 to 0.8"


def test_numeric_steps_stay_in_bounds() -> None:
    assert numeric_steps("MAX_TURNS", 2) == {"up": 3, "down": 1}
    assert numeric_steps("MAX_TURNS", 16) == {"down": 10}
    assert numeric_steps("MAX_TURNS", 1) == {"up": 2}
    assert numeric_steps("MAX_TOKENS", 48) == {"up": 96, "down": 24}
    assert "up" not in numeric_steps("MAX_TOKENS", 4096)
    assert numeric_steps("N_VOTES", 1) == {"up": 3}
    assert numeric_steps("TEMPERATURE", 1.0) == {"up": 1.2, "down": 0.8}
    assert numeric_steps("TEMPERATURE", 0.0) == {"up": 0.2}
    assert numeric_steps("TOP_K", 20) == {"up": 40, "down": 10}
    assert numeric_steps("TOP_P", 1.0) == {"down": 0.95}
    assert numeric_steps("OBS_CHARS", 400) == {"up": 800, "down": 200}
    assert numeric_steps("OFFSET", -3) == {}


def test_edit_flip_bool_keeps_comment() -> None:
    code = apply_edit(cst.parse_module(H0), Edit("flip", "OFFER_TOOLS", True, False)).code
    assert knob(code, "OFFER_TOOLS") is False
    assert "OFFER_TOOLS = False  # offer the python tool\n" in code


def test_edit_prompt_phrases() -> None:
    module = cst.parse_module(H0)
    phrase = r"Put the final answer in \boxed{}."
    code = apply_edit(module, Edit("phrase_add", "SYSTEM_PROMPT", None, phrase)).code
    check_harness_source(code, "edited")
    assert knob(code, "SYSTEM_PROMPT") == "Solve the problem. You can run python. " + phrase
    back = apply_edit(cst.parse_module(code), Edit("phrase_remove", "SYSTEM_PROMPT", None, phrase)).code
    assert knob(back, "SYSTEM_PROMPT") == "Solve the problem. You can run python."
    assert normalize_code(back) == normalize_code(H0)
    lead = apply_edit(module, Edit("phrase_remove", "SYSTEM_PROMPT", None, "Solve the problem.")).code
    assert knob(lead, "SYSTEM_PROMPT") == "You can run python."

    # a str.format template: the phrase's braces are escaped, so formatting still works
    code = apply_edit(module, Edit("phrase_add", "USER_TEMPLATE_PROMPT", None, phrase)).code
    template = knob(code, "USER_TEMPLATE_PROMPT")
    assert template.format(question="1+1?") == "Question: 1+1?\nThink step by step.\n" + phrase

    # a triple-quoted multi-line prompt stays triple-quoted; the phrase goes on its own line
    code = apply_edit(module, Edit("phrase_add", "NOTES_PROMPT", None, "Be concise.")).code
    assert knob(code, "NOTES_PROMPT") == "Rules:\n- be careful\nBe concise.\n"
    assert 'NOTES_PROMPT = """Rules:' in code


def test_edit_function_variant_with_import_and_helpers() -> None:
    skill = parse_skill(SKILL)
    ext, obs = skill.variants[0], skill.variants[1]
    code = apply_edit(cst.parse_module(H0), Edit("function", "extract_answer", None, ext)).code
    check_harness_source(code, "edited")
    assert "nums = re.findall" in function_source(code, "extract_answer")
    assert function_source(code, "run") == function_source(H0, "run")
    assert Edit("function", "extract_answer", None, ext).describe().startswith("Replace extract_answer() with")

    code = apply_edit(cst.parse_module(H0), Edit("function", "format_observation", None, obs)).code
    check_harness_source(code, "edited")
    tree = ast.parse(code)
    names = [s.name for s in tree.body if isinstance(s, ast.FunctionDef)]
    assert names.index("_clip") == names.index("format_observation") - 1
    assert "import textwrap" in code and code.index("import textwrap") < code.index("SYSTEM_PROMPT")
    assert knob(code, "OBS_LIMIT") == 300
    assert "_clip(output)" in function_source(code, "format_observation")
    assert changes_between(H0, code) == {("format_observation", f"replace:{obs.fingerprint}")}


def test_every_edit_kind_is_proposed_with_a_hypothesis(tmp_path: Path) -> None:
    a = seeded(tmp_path)  # not evaluated yet: exploration over every available edit
    props = propose(a, n=30)
    assert len(props) == 30
    assert len({normalize_code(p.code) for p in props}) == 30
    hyps = [p.hypothesis for p in props]
    assert any(h.startswith(("Raise", "Lower")) for h in hyps)
    assert any(h.startswith("Set OFFER_TOOLS to False") for h in hyps)
    assert any(h.startswith("Append the phrase") for h in hyps)
    assert any(h.startswith("Replace extract_answer()") for h in hyps)
    assert any(h.startswith("Replace format_observation()") for h in hyps)
    assert all("h0 has no evaluation yet" in h for h in hyps)
    for p in props:  # the hypothesis says what changed
        if p.hypothesis.startswith("Raise MAX_TOKENS from 48 to 96"):
            assert knob(p.code, "MAX_TOKENS") == 96
        if p.hypothesis.startswith("Set OFFER_TOOLS to False"):
            assert knob(p.code, "OFFER_TOOLS") is False
    assert all("summarize_history" not in p.code for p in props)  # not applicable to this harness


# ----------------------------------------------------------------------------------------- diagnoses


def test_truncation_raises_max_turns(tmp_path: Path) -> None:
    a = seeded(tmp_path)
    rows, traces = [], []
    for i in range(20):
        if i < 12:
            traces.append(trace(i, events=[{"type": "turn_budget_exhausted", "turns": 2}]))
            rows.append(row(i, 0.0))
        else:
            traces.append(trace(i, answer=r"\boxed{4}", completion=r"so \boxed{4}"))
            rows.append(row(i, 1.0 if i < 15 else 0.0))
    a.record_evaluation("h0", rows, traces, weight_version=0)
    first = propose(a)[0]
    assert first.parent == "h0"
    assert knob(first.code, "MAX_TURNS") == 3
    assert first.hypothesis.startswith("Raise MAX_TURNS from 2 to 3 because 12 of 20 episodes (60%) of h0 ended with turn_budget_exhausted")
    assert "success 15%" in first.hypothesis


def test_unboxed_answers_pick_the_extraction_variant(tmp_path: Path) -> None:
    a = seeded(tmp_path)
    rows, traces = [], []
    for i in range(20):
        if i < 10:
            traces.append(trace(i, answer="The answer is 42", completion="The answer is 42"))
            rows.append(row(i, 0.0))
        else:
            traces.append(trace(i, answer=r"\boxed{7}"))
            rows.append(row(i, 1.0 if i < 14 else 0.0))
    a.record_evaluation("h0", rows, traces, weight_version=0)
    first = propose(a)[0]
    assert "nums = re.findall" in function_source(first.code, "extract_answer")
    assert first.hypothesis.startswith("Replace extract_answer() with the skill variant")
    assert "10 of 20 episodes (50%)" in first.hypothesis and r"without \boxed{}" in first.hypothesis


def test_length_cuts_raise_max_tokens(tmp_path: Path) -> None:
    a = seeded(tmp_path)
    traces = [trace(i, answer=r"\boxed{1}", finish="length" if i % 2 else "stop") for i in range(20)]
    a.record_evaluation("h0", [row(i, 1.0 if i < 4 else 0.0) for i in range(20)], traces, weight_version=0)
    first = propose(a)[0]
    assert knob(first.code, "MAX_TOKENS") == 96
    assert "finish_reason 'length' on 10 of 20 calls" in first.hypothesis


def test_failing_tools_turn_tools_off_or_fix_the_observation(tmp_path: Path) -> None:
    a = seeded(tmp_path)
    rows, traces = [], []
    for i in range(10):
        err = i < 8
        events = [{"type": "tool_call", "name": "python", "code": "print(x)"},
                  {"type": "observation", "text": "Traceback ...\nNameError: name 'x' is not defined" if err else "4"}]
        traces.append(trace(i, answer=r"\boxed{4}", events=events))
        rows.append(row(i, 0.0 if err else 1.0))
    a.record_evaluation("h0", rows, traces, weight_version=0)
    props = propose(a, n=3)
    assert knob(props[0].code, "OFFER_TOOLS") is False
    assert "8 of 10 episodes of h0 that used a tool saw it fail" in props[0].hypothesis
    later = " ".join(p.hypothesis for p in props[1:])
    assert "format_observation" in later or "If a tool call fails" in later


def test_harness_exceptions_pick_a_variant_of_the_raising_function(tmp_path: Path) -> None:
    a = seeded(tmp_path)
    tb = 'Traceback (most recent call last):\n  File "harness.py", line 40, in run\n  File "harness.py", line 33, in extract_answer\nTypeError: boom'
    traces = [trace(i, status="harness_exception", reason=tb) if i < 5 else trace(i, answer=r"\boxed{1}") for i in range(10)]
    rows = [row(i, 0.0, status="harness_exception") if i < 5 else row(i, 1.0) for i in range(10)]
    a.record_evaluation("h0", rows, traces, weight_version=0)
    first = propose(a)[0]
    assert "nums = re.findall" in function_source(first.code, "extract_answer")
    assert "harness_exception (raised in extract_answer x5)" in first.hypothesis


def test_noisy_low_success_asks_for_votes_or_cooler_sampling(tmp_path: Path) -> None:
    a = seeded(tmp_path)
    rows, traces = [], []
    for i in range(20):  # two rollouts per task, mixed outcomes on most tasks
        task = f"t{i // 2}"
        ok = i % 2 == 0 and i < 12
        rows.append(row(i, 1.0 if ok else 0.0, task=task))
        traces.append(trace(i, answer=r"\boxed{3}"))
    a.record_evaluation("h0", rows, traces, weight_version=0)
    props = propose(a, n=2)
    changed = {(k, knob(props[0].code, k)) for k in ("N_VOTES", "TEMPERATURE")}
    assert ("N_VOTES", 3) in changed or ("TEMPERATURE", 0.8) in changed
    assert "6 of 10 tasks it ran more than once had mixed outcomes" in props[0].hypothesis


def test_no_duplicates_and_learning_from_failed_children(tmp_path: Path) -> None:
    a = seeded(tmp_path)
    trunc = [trace(i, events=[{"type": "turn_budget_exhausted"}]) for i in range(6)] + [
        trace(i, answer=r"\boxed{2}") for i in range(6, 10)]
    a.record_evaluation("h0", [row(i, 1.0 if i >= 7 else 0.0) for i in range(10)], trunc, weight_version=0)
    # the obvious fix was tried already and did not help
    tried = H0.replace("MAX_TURNS = 2", "MAX_TURNS = 3")
    c1 = a.add_candidate(tried, parent="h0", hypothesis="raise MAX_TURNS", iteration=2, cycle=0)
    a.record_evaluation(c1, [row(i, 1.0 if i >= 8 else 0.0) for i in range(10)], trunc, weight_version=0)
    # a proposed (unevaluated) and an invalid candidate also count as taken
    taken = H0.replace("MAX_TOKENS = 48", "MAX_TOKENS = 96")
    a.add_candidate(taken, parent="h0", hypothesis="x", iteration=3, cycle=0)
    bad = a.add_candidate(H0.replace("TOP_K = 20", "TOP_K = 10"), parent="h0", hypothesis="y", iteration=3, cycle=0)
    a.mark_invalid(bad, "smoke test failed")

    props = propose(a, n=12, iteration=3)
    assert len(props) == 12
    archive_codes = {normalize_code(c.code) for c in a.candidates()}
    norms = [normalize_code(p.code) for p in props]
    assert len(set(norms)) == len(norms) and not set(norms) & archive_codes
    assert props[0].parent == "h0"
    assert knob(props[0].code, "MAX_TURNS") == 2  # the failed direction is tried last, not first
    assert all(p.parent in ("h0", c1) for p in props)


def test_dedupe_scope_under_new_weights(tmp_path: Path) -> None:
    a = seeded(tmp_path)
    trunc = [trace(i, events=[{"type": "turn_budget_exhausted"}]) for i in range(10)]
    a.record_evaluation("h0", [row(i, float(i == 0)) for i in range(10)], trunc, weight_version=0)
    tried = a.add_candidate(H0.replace("MAX_TURNS = 2", "MAX_TURNS = 3"), parent="h0", hypothesis="t", iteration=2, cycle=0)
    a.record_evaluation(tried, [row(i, 0.0) for i in range(10)], trunc, weight_version=0)
    # next cycle: the incoming harness is re-evaluated under weights v1 and still truncates
    again = a.add_candidate(H0, parent="h0", hypothesis="re-evaluate incoming harness under weights v1", iteration=1, cycle=1)
    a.record_evaluation(again, [row(i, float(i < 2)) for i in range(10)], trunc, weight_version=1)
    single = {"second_edit_prob": 0.0}  # one edit per candidate, to compare codes exactly
    strict = OfflineProposer(**single).propose(a, 1, 2, skill_text=SKILL, seed=0).proposals[0]
    assert strict.parent == again and knob(strict.code, "MAX_TURNS") == 2  # MAX_TURNS = 3 is taken
    per_version = OfflineProposer(dedupe="weight_version", **single).propose(a, 1, 2, skill_text=SKILL,
                                                                             seed=0).proposals[0]
    assert per_version.parent == again and per_version.code == a.get(tried).code  # worth a retry under v1
    with pytest.raises(ValueError, match="dedupe scope"):
        OfflineProposer(dedupe="never")


def test_deterministic_given_seed_and_archive(tmp_path: Path) -> None:
    a = seeded(tmp_path / "one")
    traces = [trace(i, answer=r"\boxed{1}", finish="length" if i < 5 else "stop") for i in range(10)]
    a.record_evaluation("h0", [row(i, float(i % 3 == 0)) for i in range(10)], traces, weight_version=0)
    c = a.add_candidate(H0.replace("N_VOTES = 1", "N_VOTES = 3"), parent="h0", hypothesis="votes", iteration=2, cycle=0)
    a.record_evaluation(c, [row(i, float(i % 2 == 0), turns=3) for i in range(10)], traces, weight_version=0)
    first = [p.to_dict() for p in propose(a, n=6, seed=7)]
    assert first == [p.to_dict() for p in propose(a, n=6, seed=7)]
    shutil.copytree(tmp_path / "one" / "archive", tmp_path / "two")  # the same contents elsewhere, later
    assert first == [p.to_dict() for p in propose(Archive(tmp_path / "two", read_only=True), n=6, seed=7)]
    runs = {json.dumps([p.to_dict() for p in propose(a, n=6, seed=s)]) for s in range(6)}
    assert len(runs) > 1  # the seed matters
    assert Proposal.from_dict(first[0]).to_dict() == first[0]


def test_other_frontier_members_are_parents_sometimes(tmp_path: Path) -> None:
    a = seeded(tmp_path)
    a.record_evaluation("h0", [row(i, float(i < 5), turns=1) for i in range(10)], [trace(i) for i in range(10)], weight_version=0)
    c = a.add_candidate(H0.replace("MAX_TURNS = 2", "MAX_TURNS = 4"), parent="h0", hypothesis="t", iteration=2, cycle=0)
    a.record_evaluation(c, [row(i, float(i < 6), turns=3) for i in range(10)], [trace(i) for i in range(10)], weight_version=0)
    parents = [p.parent for s in range(5) for p in propose(a, n=6, seed=s)]
    assert parents.count(c) > parents.count("h0") > 0  # c is the best; h0 is on the frontier (fewer turns)


def test_degrades_on_harnesses_without_conventions(tmp_path: Path) -> None:
    bare = "def run(task, agent):\n    return agent.generate([{'role': 'user', 'content': task['question']}])\n"
    prop = OfflineProposer()
    session = prop.propose(seeded(tmp_path / "a", bare), 3, 2, skill_text=SKILL, seed=0)
    assert session.proposals == [] and session.log["stop_reason"] == "done"
    assert any("no further distinct valid edit" in n for n in session.log["notes"])

    odd = (
        "LIMITS = (1, 2)\nNAME = 'x'\nSYSTEM_PROMPT = f'{NAME} solves'\nMAX_TURNS = 2\n\n"
        "def run(task, agent):\n    return None\n"
    )
    props = propose(seeded(tmp_path / "b", odd), n=5, skill="")
    assert sorted(knob(p.code, "MAX_TURNS") for p in props) == [1, 3]  # the only editable knob
    assert all("f'{NAME} solves'" in p.code for p in props)

    with pytest.raises(ProposerError, match="empty"):
        OfflineProposer().propose(Archive(tmp_path / "empty"), 2, 2, skill_text=SKILL, seed=0)


def test_make_proposer() -> None:
    assert isinstance(make_proposer("offline"), OfflineProposer)
    with pytest.raises(ValueError, match="unknown proposer kind 'oracle'; choose one of offline, llm, agent-cli"):
        make_proposer("oracle")


def test_offline_dedupe_scope_comes_from_the_config() -> None:
    from whale_ray.config import load_config

    cfg = load_config(None, {"harness_phase.offline_dedupe": "weight_version"})
    assert make_proposer("offline", **proposer_options(cfg.harness_phase)).dedupe == "weight_version"
    assert make_proposer("offline", **proposer_options(load_config().harness_phase)).dedupe == "archive"


# --------------------------------------------------------------------------------------- the actor


def test_harness_proposer_actor_on_local_ray(tmp_path: Path, ray_cluster) -> None:
    ray = ray_cluster
    from actors.harness_proposer import HarnessProposer

    a = seeded(tmp_path)
    traces = [trace(i, events=[{"type": "turn_budget_exhausted"}]) for i in range(10)]
    a.record_evaluation("h0", [row(i, 0.0) for i in range(10)], traces, weight_version=0)
    expected = [p.to_dict() for p in propose(a, n=2, seed=3)]

    actor = HarnessProposer.remote("offline", SKILL, 3)
    result = ray.get(actor.session.remote(str(a.root), 2, 2, {"max_tokens": 10}, None), timeout=120)
    got = result["proposals"]
    assert got == expected
    assert set(got[0]) == {"code", "parent", "hypothesis"}
    assert knob(got[0]["code"], "MAX_TURNS") == 3
    log = result["session"]  # the same log shape as the model-backed kinds
    assert log["kind"] == "offline" and log["stop_reason"] == "done" and log["proposals"] == got
    assert log["usage"]["sessions"] == 1 and log["usage"]["prompt_tokens"] == 0  # no model, no tokens
    assert log["limits"]["max_tokens"] == 10
    assert ray.get(actor.usage.remote())["proposals"] == 2
    assert any("truncation" in n for n in ray.get(actor.notes.remote()))

    broken = HarnessProposer.remote("oracle", SKILL, 0)
    with pytest.raises(Exception, match="unknown proposer kind 'oracle'"):
        ray.get(broken.session.remote(str(a.root), 1, 2), timeout=120)
    for handle in (actor, broken):
        ray.kill(handle)

