"""The `offline` proposer: trace-informed edits of harness code, without a model or an API.

It starts from `selection.default_parent` (and now and then another member of the frontier), reads
the parents' scores and traces to diagnose what goes wrong (`diagnosis`), and applies one or two
edits to the parent's code with libcst (`edits`; comments and layout survive):

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

    skill.py      the skill text's phrases and function variants
    knobs.py      a harness's knobs and functions, and the sane next values of a numeric knob
    edits.py      the edits, applied with libcst, and the edits between a parent and its child
    diagnosis.py  the findings in a candidate's traces, and the edits each asks for
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import libcst as cst

from whale_ray import selection
from whale_ray.archive import Archive, Candidate
from whale_ray.harness import check_harness_source, normalize_code
from whale_ray.proposers.base import Proposal, Proposer, ProposerError
from whale_ray.proposers.diagnosis import ANSWER_MARKERS, Diagnosis, diagnose
from whale_ray.proposers.edits import Edit, apply_edit, changes_between, phrase_in
from whale_ray.proposers.knobs import function_fingerprint, numeric_steps, read_functions, read_knobs
from whale_ray.proposers.session import Limits, SessionLog
from whale_ray.proposers.skill import Skill, parse_skill


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


class OfflineProposer(Proposer):
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
        self.notes: list[str] = []  # what the session diagnosed and skipped: its log's notes

    # ------------------------------------------------------------------ parents
    def _parents(self, archive: Archive, cands: list[Candidate], n: int, rng: random.Random) -> list[str]:
        """n parent slots: the default parent, and now and then another member of its frontier."""
        try:
            best = selection.default_parent(cands)
        except selection.SelectionError:
            raise ProposerError(f"archive {archive.root} is empty: add the seed harness (h0) first") from None
        latest = selection.latest_version(cands)
        if latest is None:
            self.notes.append(f"no evaluated candidate yet; proposing from {best.id} without a diagnosis")
            return [best.id] * n
        others = [c.id for c in selection.frontier(cands, latest) if c.id != best.id]
        if not others:
            others = [c.id for c in selection.frontier(cands) if c.id != best.id]
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
                    if phrase_in(v, ph) in v:
                        edits.append(Edit("phrase_remove", name, v, ph))
                    else:
                        edits.append(Edit("phrase_add", name, v, ph))
        for var in skill.variants:
            if var.name in fns and function_fingerprint(code, var.name) != var.fingerprint:
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
    def _session(self, archive: Archive, n: int, iteration: int, *, skill_text: str, seed: int, limits: Limits,
                 log_path: Path | None, log: SessionLog) -> list[Proposal]:
        """A deterministic function of the archive contents, the skill text, the seed and the iteration
        (`limits` and `log_path` do not apply: it spends no tokens and is done in moments)."""
        self.notes = log.notes
        if n <= 0:
            log.stop_reason = "nothing to propose (n = 0)"
            return []
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
        slots = self._parents(archive, all_cands, n, rng)
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
        log.stop_reason = "done"
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


__all__ = ["OfflineProposer"]
