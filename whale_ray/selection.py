"""Which harness wins: the Pareto frontier, the accept rule, the default parent, and the D_val choice.

The archive stores candidates; every decision about them is made here, in pure functions over
evaluated candidates (anything with `id`, `order`, `weight_version` and the attributes named in
`OBJECTIVES`, such as `archive.Candidate`). The text a proposer model reads about the rule
(`rule_text`) is generated from the same `OBJECTIVES` and margin, so it cannot drift from the code.

    frontier   candidates no other candidate dominates, best first (`rank_key`)
    accept     the frontier's top under the current weights, unless the incumbent holds it off:
               with a positive noise margin the top replaces the incumbent only when its success
               rate is higher by more than the margin (a tie on success keeps the incumbent)
    incumbent  the accepted harness, when it was scored under the current weights (else none:
               scores under other weights are not comparable, so new weights have no incumbent)
    default_parent   the frontier's top under the newest weights, else the first usable seed
    improves_on_val  whether a (θ, h) pair replaces the best-so-far on D_val (a tie keeps the earlier)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Protocol, Sequence, TypeVar

# Scores are means of per-episode values; two means that agree to this much are equal, so a top
# exactly one margin above the incumbent (0.6 - 0.5 in binary) does not count as "more than".
EPS = 1e-12


@dataclass(frozen=True)
class Objective:
    name: str  # the candidate attribute (and scores.json key)
    goal: str  # "max" or "min"
    label: str  # how the proposer's prompt names it


# Rank order: success rate first, then fewer turns, then fewer prompt tokens; the earlier candidate last.
OBJECTIVES = (
    Objective("success_rate", "max", "success rate over D_harness"),
    Objective("mean_turns", "min", "mean turns"),
    Objective("mean_prompt_tokens", "min", "mean prompt tokens"),
)


class Scored(Protocol):
    """What selection reads of a candidate (`archive.Candidate` has it all)."""

    id: str
    parent: str | None
    status: str
    weight_version: int | None
    order: tuple  # creation order: the last tie-break


C = TypeVar("C", bound=Scored)


class SelectionError(ValueError):
    """Selection was asked to choose among nothing, or with an incumbent that cannot take part."""


def objectives(c: Any) -> tuple[float, ...]:
    return tuple(getattr(c, o.name) for o in OBJECTIVES)


def dominates(a: Any, b: Any) -> bool:
    """a is at least as good as b in every objective and strictly better in one."""
    at_least, better = True, False
    for o, x, y in zip(OBJECTIVES, objectives(a), objectives(b)):
        if o.goal == "min":
            x, y = -x, -y
        at_least &= x >= y
        better |= x > y
    return at_least and better


def rank_key(c: Any) -> tuple:
    """Best first: each objective in `OBJECTIVES` order, then the earlier candidate."""
    return (*(-v if o.goal == "max" else v for o, v in zip(OBJECTIVES, objectives(c))), c.order)


def evaluated(cands: Iterable[C], weight_version: int | None = None) -> list[C]:
    """The evaluated candidates, only those scored under `weight_version` when it is given."""
    return [c for c in cands if c.status == "evaluated"
            and (weight_version is None or c.weight_version == weight_version)]


def frontier(cands: Iterable[C], weight_version: int | None = None) -> list[C]:
    """The Pareto frontier over the evaluated candidates (under `weight_version`, when given), best first."""
    pool = evaluated(cands, weight_version)
    front = [c for c in pool if not any(dominates(o, c) for o in pool if o is not c)]
    return sorted(front, key=rank_key)


def latest_version(cands: Iterable[Scored]) -> int | None:
    """The newest weight version any candidate was evaluated under."""
    return max((c.weight_version for c in evaluated(cands) if c.weight_version is not None), default=None)


def top(cands: Iterable[C], weight_version: int | None = None) -> C:
    """The frontier's top; SelectionError when nothing was evaluated (under `weight_version`)."""
    front = frontier(cands, weight_version)
    if not front:
        where = f" under weight version {weight_version}" if weight_version is not None else ""
        raise SelectionError(f"no evaluated candidate{where}")
    return front[0]


def incumbent(accepted: C, weight_version: int) -> C | None:
    """The accepted harness as incumbent: only when its scores were measured under `weight_version`."""
    return accepted if accepted.status == "evaluated" and accepted.weight_version == weight_version else None


def accept(cands: Iterable[C], *, weight_version: int | None, noise_margin: float = 0.0,
           incumbent: C | None = None) -> C:
    """The harness to accept: the frontier's top under `weight_version`, unless a positive `noise_margin`
    and an `incumbent` (see `incumbent`) hold it off: the top must beat the incumbent's success rate by
    more than the margin."""
    if noise_margin < 0:
        raise SelectionError(f"noise_margin must be >= 0, got {noise_margin}")
    best = top(cands, weight_version)
    if incumbent is None or noise_margin <= 0:
        return best
    if incumbent.status != "evaluated":
        raise SelectionError(f"incumbent {incumbent.id!r} is {incumbent.status}, not evaluated")
    if weight_version is not None and incumbent.weight_version != weight_version:
        raise SelectionError(
            f"incumbent {incumbent.id!r} was evaluated under weight version {incumbent.weight_version}, "
            f"not {weight_version}: its scores are not comparable")
    if best.id == incumbent.id:
        return incumbent
    lead = getattr(best, OBJECTIVES[0].name) - getattr(incumbent, OBJECTIVES[0].name)
    return best if lead > noise_margin + EPS else incumbent


def default_parent(cands: Sequence[C]) -> C:
    """The parent a proposer starts from: the frontier's top under the newest weights; before any
    evaluation, the first seed (no parent) that is not invalid, else the first candidate that is not."""
    latest = latest_version(cands)
    if latest is not None:
        return top(cands, latest)
    usable = [c for c in cands if c.status != "invalid"] or list(cands)
    if not usable:
        raise SelectionError("the archive is empty: add the seed harness (h0) first")
    return ([c for c in usable if c.parent is None] or usable)[0]


def improves_on_val(val: float, best_val: float | None) -> bool:
    """Whether a pair scoring `val` on D_val replaces the best-so-far: only a strictly higher score
    does, so on a tie the pair selected first stays (θ*, h*)."""
    return best_val is None or val > best_val


def objectives_text() -> str:
    """The objectives in rank order with their direction, e.g. for a frontier table's heading."""
    return "; ".join(f"{o.label} {'up' if o.goal == 'max' else 'down'}" for o in OBJECTIVES)


def rule_text(noise_margin: float = 0.0) -> str:
    """How candidates are accepted, for the proposer's prompt (built from `OBJECTIVES` and the margin)."""
    first, *rest = OBJECTIVES
    ties = ", then ".join(("fewer " if o.goal == "min" else "higher ") + o.label for o in rest)
    text = (f"Candidates are ranked by {first.label} (ties: {ties}, then the earlier candidate), among "
            "candidates scored under the same weights; the top of the Pareto frontier is accepted")
    if noise_margin > 0:
        text += (f" when its {first.label} beats the accepted harness's by more than the noise margin "
                 f"({noise_margin:g}); a smaller lead or a tie keeps the accepted harness")
    return text + "."


__all__ = ["OBJECTIVES", "Objective", "SelectionError", "accept", "default_parent", "dominates", "evaluated",
           "frontier", "improves_on_val", "incumbent", "latest_version", "objectives", "objectives_text", "rank_key",
           "rule_text", "top"]
