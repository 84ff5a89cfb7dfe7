"""Trace diagnosis: what goes wrong in one evaluated candidate's episodes, and which edits each
finding asks for. Turn-budget exhaustion -> more turns; completions cut at max tokens -> more tokens;
answers without the domain's marker -> an extraction variant or a format phrase; failing tools ->
tools off, a tool phrase or an observation variant; harness exceptions -> a variant of the function
in the traceback; timeouts -> fewer votes or tokens; low success with mixed outcomes -> more votes,
lower temperature."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

# The final-answer formats the diagnosis recognises ("returned an answer without the marker").
ANSWER_MARKERS = ("\\boxed{", "<answer>")

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


__all__ = ["ANSWER_MARKERS", "Diagnosis", "Finding", "diagnose"]
