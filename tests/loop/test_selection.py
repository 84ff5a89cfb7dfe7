"""The acceptance rule at its edges, on real archive candidates with scores that are exact in binary
(success rates k/4 and k/8, turns in halves), so each expected winner follows from the rule alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from whale_ray import selection
from whale_ray.archive import Archive
from whale_ray.proposers.prompts import LLM_TOOLS_NOTE, system_prompt
from whale_ray.selection import SelectionError

H0 = 'MAX_TURNS = 2\n\n\ndef run(task, agent):\n    return agent.generate([{"role": "user", "content": "q"}])\n'


class Pool:
    """An archive with a seed h0, and helpers that add candidates with chosen exact scores."""

    def __init__(self, root: Path) -> None:
        self.a = Archive(root)
        self.a.add_candidate(H0, parent=None, hypothesis="seed", iteration=1, cycle=0, candidate_id="h0")
        self.k = 0

    def add(self, parent: str = "h0") -> str:
        self.k += 1
        return self.a.add_candidate(H0.replace("= 2", f"= {self.k + 2}"), parent=parent, hypothesis="h",
                                    iteration=2, cycle=0)

    def score(self, cid: str, wins: int, n: int, turns: float = 2.0, tokens: int = 100, wv: int = 0) -> str:
        """n episodes, `wins` of them solved, whose turns (whole numbers per episode) average `turns`."""
        longer = round((turns - int(turns)) * n)
        assert longer == (turns - int(turns)) * n, "choose turns whose mean n whole numbers can make"
        rows = [{"task_id": f"t{i}", "reward": float(i < wins), "turns": int(turns) + (i < longer),
                 "prompt_tokens": tokens, "status": "ok"} for i in range(n)]
        self.a.record_evaluation(cid, rows, [json.dumps({"events": []})] * n, weight_version=wv)
        return cid

    def new(self, wins: int, n: int, turns: float = 2.0, tokens: int = 100, wv: int = 0, parent="h0") -> str:
        return self.score(self.add(parent), wins, n, turns, tokens, wv)

    def all(self):
        return self.a.candidates()

    def get(self, cid: str):
        return self.a.get(cid)


@pytest.fixture
def pool(tmp_path: Path) -> Pool:
    return Pool(tmp_path / "archive")


def ids(cands) -> list[str]:
    return [c.id for c in cands]


def test_frontier_keeps_exactly_the_undominated(pool: Pool) -> None:
    a = pool.new(2, 4, turns=2, tokens=100)  # 0.5
    b = pool.new(2, 4, turns=2, tokens=150)  # dominated by a: more tokens only
    c = pool.new(2, 4, turns=3, tokens=100)  # dominated by a: more turns only
    d = pool.new(1, 4, turns=1, tokens=100)  # 0.25 but the fewest turns
    e = pool.new(3, 4, turns=4, tokens=300)  # 0.75: the highest success
    f = pool.new(2, 4, turns=2, tokens=100)  # equal to a: neither dominates the other
    g = pool.new(1, 4, turns=1.5, tokens=100)  # dominated by d: more turns only
    assert (pool.get(g).mean_turns, pool.get(e).success_rate) == (1.5, 0.75)  # what the rows make, exactly
    cands = pool.all()
    assert ids(selection.frontier(cands)) == [e, a, f, d]  # best first; a before its equal f
    assert selection.dominates(pool.get(a), pool.get(b)) and selection.dominates(pool.get(a), pool.get(c))
    assert not selection.dominates(pool.get(a), pool.get(f)) and not selection.dominates(pool.get(f), pool.get(a))
    assert not selection.dominates(pool.get(e), pool.get(d)) and not selection.dominates(pool.get(d), pool.get(e))
    assert selection.dominates(pool.get(d), pool.get(g))
    assert "h0" not in ids(selection.frontier(cands))  # not evaluated, not ranked
    assert selection.accept(cands, weight_version=0).id == e


def test_rank_ties_fewer_turns_then_fewer_tokens_then_the_earlier(pool: Pool) -> None:
    x = pool.new(2, 4, turns=3, tokens=100)
    y = pool.new(2, 4, turns=2.5, tokens=200)  # the same success, half a turn fewer
    assert selection.accept(pool.all(), weight_version=0).id == y
    z = pool.new(4, 8, turns=2.5, tokens=150)  # 4/8 == 2/4, same turns, fewer tokens
    assert selection.accept(pool.all(), weight_version=0).id == z
    w = pool.new(2, 4, turns=2.5, tokens=150)  # identical objectives: the earlier candidate stays first
    assert selection.accept(pool.all(), weight_version=0).id == z and w in ids(selection.frontier(pool.all()))
    assert selection.accept(pool.all()[::-1], weight_version=0).id == z  # creation order, not list order
    v = pool.new(5, 8, turns=9, tokens=900)  # 0.625 beats any number of turns and tokens
    front = ids(selection.frontier(pool.all()))
    assert front[0] == v and y not in front and x in front  # x keeps the frontier with the fewest tokens


def test_noise_margin_at_its_edge(pool: Pool) -> None:
    inc = pool.new(2, 4)  # 0.5
    top = pool.new(3, 4)  # 0.75: leads by exactly 0.25
    cands, incumbent = pool.all(), pool.get(inc)
    assert selection.accept(cands, weight_version=0, noise_margin=0.25, incumbent=incumbent).id == inc  # not "more"
    assert selection.accept(cands, weight_version=0, noise_margin=0.125, incumbent=incumbent).id == top
    assert selection.accept(cands, weight_version=0, noise_margin=0.0, incumbent=incumbent).id == top
    assert selection.accept(cands, weight_version=0, noise_margin=0.25).id == top  # no incumbent: the plain top
    # eighths: 5/8 leads 4/8 by exactly 0.125
    inc8 = pool.get(pool.new(4, 8))
    lead8 = pool.new(5, 8)
    only = [inc8, pool.get(lead8)]
    assert selection.accept(only, weight_version=0, noise_margin=0.125, incumbent=inc8).id == inc8.id
    assert selection.accept(only, weight_version=0, noise_margin=0.0625, incumbent=inc8).id == lead8
    # the incumbent at the top is kept whatever the margin
    assert selection.accept(cands, weight_version=0, noise_margin=0.25, incumbent=pool.get(top)).id == top


def test_a_lead_equal_to_the_margin_up_to_rounding_is_not_more(pool: Pool) -> None:
    inc = pool.get(pool.new(7, 10))  # 0.7
    top = pool.new(8, 10)  # 0.8; 0.8 - 0.7 is 0.10000000000000009 in binary
    assert 0.8 - 0.7 > 0.1
    assert selection.accept([inc, pool.get(top)], weight_version=0, noise_margin=0.1, incumbent=inc).id == inc.id


def test_ties_on_success_with_and_without_a_margin(pool: Pool) -> None:
    inc = pool.get(pool.new(2, 4, turns=3))
    leaner = pool.new(2, 4, turns=2)  # the same success in fewer turns: the frontier's top
    cands = [inc, pool.get(leaner)]
    assert selection.accept(cands, weight_version=0, incumbent=inc).id == leaner  # no margin: turns decide
    assert selection.accept(cands, weight_version=0, noise_margin=0.125, incumbent=inc).id == inc.id  # a tie keeps it
    assert selection.accept(cands, weight_version=0, noise_margin=0.125).id == leaner  # nothing to keep


def test_the_incumbent_under_new_weights(pool: Pool) -> None:
    pool.score("h0", 4, 4, wv=0)  # 1.0 under v0
    h0 = pool.get("h0")
    assert selection.incumbent(h0, 0) is h0
    assert selection.incumbent(h0, 1) is None  # scored under other weights: no incumbent under v1
    assert selection.incumbent(pool.get(pool.add()), 0) is None  # not evaluated
    # iteration 1 under v1: the re-evaluation of h0 is the only candidate scored under v1
    re_eval = pool.score(pool.a.add_reevaluation("h0", weight_version=1, cycle=1), 2, 4, wv=1)
    assert selection.accept(pool.all(), weight_version=1, noise_margin=0.25, incumbent=None).id == re_eval
    assert selection.accept(pool.all(), weight_version=None).id == "h0"  # archive-wide h0's 1.0 would win
    inc = selection.incumbent(pool.get(re_eval), 1)
    assert inc is not None and inc.id == re_eval
    c = pool.new(3, 4, wv=1, parent=re_eval)  # leads the re-evaluation by exactly 0.25
    assert selection.accept(pool.all(), weight_version=1, noise_margin=0.25, incumbent=inc).id == re_eval
    assert selection.accept(pool.all(), weight_version=1, noise_margin=0.125, incumbent=inc).id == c
    assert ids(selection.frontier(pool.all(), 1)) == [c]  # c dominates the re-evaluation
    with pytest.raises(SelectionError, match="not comparable"):
        selection.accept(pool.all(), weight_version=1, noise_margin=0.125, incumbent=h0)


def test_accept_refuses_what_it_cannot_choose_from(pool: Pool) -> None:
    with pytest.raises(SelectionError, match="no evaluated candidate"):
        selection.accept(pool.all(), weight_version=None)
    pool.new(2, 4, wv=0)
    with pytest.raises(SelectionError, match="under weight version 5"):
        selection.accept(pool.all(), weight_version=5)
    with pytest.raises(SelectionError, match="is proposed, not evaluated"):
        selection.accept(pool.all(), weight_version=0, noise_margin=0.125, incumbent=pool.get(pool.add()))
    with pytest.raises(SelectionError, match="noise_margin must be >= 0"):
        selection.accept(pool.all(), weight_version=0, noise_margin=-0.125)


def test_d_val_ties_keep_the_earlier_pair() -> None:
    assert selection.improves_on_val(0.5, None)  # the first pair is the best so far
    assert not selection.improves_on_val(0.5, 0.5)  # a tie keeps (θ*, h*) chosen earlier
    assert selection.improves_on_val(0.625, 0.5)
    assert not selection.improves_on_val(0.375, 0.5)


def test_default_parent(pool: Pool) -> None:
    assert selection.default_parent(pool.all()).id == "h0"  # nothing evaluated: the seed
    pool.a.mark_invalid("h0", "syntax error")
    child = pool.add()
    assert selection.default_parent(pool.all()).id == child  # never an invalid seed while another is usable
    best_v0 = pool.new(4, 4, wv=0, parent=child)
    later = pool.new(1, 4, wv=1, parent=child)
    assert selection.default_parent(pool.all()).id == later  # the newest weights' top, not the old 1.0
    assert selection.default_parent([pool.get(best_v0)]).id == best_v0
    with pytest.raises(SelectionError, match="empty"):
        selection.default_parent([])


def test_the_prompt_states_the_rule_the_code_applies() -> None:
    text = selection.rule_text(0.25)
    labels = [o.label for o in selection.OBJECTIVES]
    assert [text.index(label) for label in labels] == sorted(text.index(label) for label in labels)  # rank order
    assert text.startswith("Candidates are ranked by success rate over D_harness (ties: fewer mean turns, then "
                           "fewer mean prompt tokens, then the earlier candidate)")
    assert "noise margin (0.25)" in text and "a tie keeps the accepted harness" in text
    assert "margin" not in selection.rule_text(0.0)
    prompt = " ".join(system_prompt("skill", tools_note=LLM_TOOLS_NOTE.format(n=1), noise_margin=0.25).split())
    assert text in prompt  # the same sentence, only re-wrapped
    assert " ".join(system_prompt("skill", tools_note="").split()).count(selection.rule_text(0.0)) == 1
