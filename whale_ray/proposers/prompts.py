"""What a proposer model is told: the Meta-Harness task, the archive layout, the domain's skill text,
and an overview of the archive (the iteration history and the frontier)."""

from __future__ import annotations

import textwrap

from whale_ray import selection
from whale_ray.archive import Archive, ArchiveError
from whale_ray.proposers.archive_tools import default_parent, frontier_text, history_text, latest_version

ARCHIVE_LAYOUT = """\
{root}/                  the archive (read-only for you)
  <id>/                  one folder per candidate harness: h0 is the seed, c001, c002... came later
    harness.py           the candidate's complete code
    meta.json            parent, iteration, cycle, hypothesis, status (proposed | invalid | evaluated), reason
    diff.patch           unified diff against its parent
    scores.json          after evaluation: aggregates (success_rate, mean_turns, mean_prompt_tokens,
                         truncation_rate, status_counts) and "rows": one per episode {{task_id, reward,
                         turns, prompt_tokens, status, truncated}}
    traces.jsonl         after evaluation: one raw JSON trace per episode, same order as the rows:
                         {{"task": the public task, "calls": [{{"messages": the exact chat sent to the model,
                         "completion": its reply, "finish_reason"}}], "events": what the harness logged,
                         "answer": the returned response, "status", "reason"}}
  summary.jsonl          one line per evaluated or invalid candidate
  frontier.json          the Pareto frontier, overall and per weight version"""

SYSTEM_PROMPT = """\
You are the proposer of a Meta-Harness search (WHALE). A harness is the complete Python program that
drives a language-model agent through one task: prompts, tool offering and parsing, observation
formatting, error handling, turn and token budgets, stop conditions, answer extraction, sampling and
voting. The model's weights are fixed while you work; only the harness changes. Your job is to write
better harnesses.

Every candidate so far is in a filesystem archive with its code, its per-example scores on the search
set (D_harness) and the full raw trace of every episode. Scores are comparable only within one weight
version (θ version): the weights are retrained between harness phases, and a strategy that failed under
old weights may pay off under new ones.

How to work:
1. Start from the overview below. Read the code of the frontier's top candidates and their parents.
2. Read raw traces, failing episodes above all (reward 0): what did the model see, what did it reply,
   where did the harness lose the answer (turn budget exhausted, completion cut at the token limit,
   answer in the wrong format, a tool error, an exception)? Compare with successful episodes and with
   the traces of earlier candidates to see what each change did. Look at invalid candidates' reasons so
   you do not repeat their mistakes.
3. Form one hypothesis per candidate, grounded in what the traces show, and write the candidate as a
   complete harness file. Prefer a focused change whose effect the scores can attribute; several
   candidates may explore different hypotheses or different parents.
4. {rule}
   More turns, tokens and votes cost time; spend them only where the traces say they pay.

Rules: a candidate must define `run(task, agent)` exactly as the domain's contract says and import only
the Python standard library; it is checked on submission, then smoke-tested in a sandbox and evaluated.
Never try to reach the verifier, gold answers or test data, and never hard-code answers: you only see
D_harness, candidates are scanned for test data and rejected when they contain any, and the final
report is on a held-out test set.

{tools_note}

The archive layout:
{layout}

# The domain's skill text (contract, what may change, what must not)

{skill}
"""

LLM_TOOLS_NOTE = """\
You work through tools: list_files, read_file, grep, diff, show_frontier and list_candidates read the
archive (paths are relative to its root); write_candidate submits one new candidate (the complete file
plus its hypothesis, optionally its parent id). Only candidates accepted by write_candidate count. Write
exactly {n} candidate(s) this session, then stop calling tools and reply with a short summary."""


def system_prompt(skill_text: str, *, tools_note: str, root: str = ".", noise_margin: float = 0.0) -> str:
    """The task text; how candidates are accepted comes from `selection.rule_text`, the rule's own code."""
    rule = textwrap.fill(selection.rule_text(noise_margin), width=100, initial_indent="4. ",
                         subsequent_indent="   ")[3:]
    return SYSTEM_PROMPT.format(tools_note=tools_note, layout=ARCHIVE_LAYOUT.format(root=root), rule=rule,
                                skill=(skill_text or "(this domain has no skill text)").strip())


def overview(archive: Archive, n: int, iteration: int) -> str:
    """The opening user message: the task of this session, the history and the frontier."""
    latest = latest_version(archive)
    try:
        parent = default_parent(archive)
    except ArchiveError:  # an empty archive: the proposer reports it
        parent = "-"
    return "\n".join([
        f"Harness iteration {iteration}. Write {n} new candidate harness(es).",
        f"The newest weight version with scores is {latest if latest is not None else '(none yet)'}; "
        f"the default parent for a new candidate is {parent}.",
        "",
        "## Iteration history (every candidate, in creation order)",
        history_text(archive),
        "",
        "## Frontier",
        frontier_text(archive, k=5),
    ])


__all__ = ["system_prompt", "overview", "LLM_TOOLS_NOTE", "ARCHIVE_LAYOUT"]
