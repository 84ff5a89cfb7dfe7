"""The filesystem archive: round trip, atomicity, re-evaluation, resume, views (summary, frontier.json)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import whale_ray.archive as archive_mod
from whale_ray import selection
from whale_ray.archive import Archive, ArchiveError

H0 = '''SYSTEM_PROMPT = "Solve it."
MAX_TURNS = 2


def run(task, agent):
    return agent.generate([{"role": "user", "content": task["question"]}])
'''


def variant(k: int) -> str:
    return H0.replace("MAX_TURNS = 2", f"MAX_TURNS = {k}")


def episodes(successes: int, n: int, turns: float = 2, tokens: float = 100, truncated: int = 0):
    """n rows and traces with `successes` rewards of 1, the first `truncated` ones turn-truncated."""
    rows, traces = [], []
    for i in range(n):
        trunc = i < truncated
        rows.append({"task_id": f"t{i}", "reward": 1.0 if i >= n - successes else 0.0, "turns": turns,
                     "prompt_tokens": tokens, "status": "ok"})
        traces.append(json.dumps({
            "task": {"id": f"t{i}", "question": "q"}, "calls": [], "answer": None, "status": "ok", "reason": "",
            "events": [{"type": "turn_budget_exhausted"}] if trunc else [],
        }))
    return rows, traces


def add(a: Archive, code: str, parent: str | None = "h0", iteration: int = 2, cycle: int = 0, **kw) -> str:
    return a.add_candidate(code, parent=parent, hypothesis="raise MAX_TURNS", iteration=iteration, cycle=cycle, **kw)


def scored(a: Archive, code: str, sr: float, turns: float, tokens: float, wv: int = 0, n: int = 10, parent="h0") -> str:
    cid = add(a, code, parent=parent)
    a.record_evaluation(cid, *episodes(round(sr * n), n, turns, tokens), weight_version=wv)
    return cid


@pytest.fixture
def arch(tmp_path: Path) -> Archive:
    a = Archive(tmp_path / "archive")
    a.add_candidate(H0, parent=None, hypothesis="the seed harness", iteration=1, cycle=0, candidate_id="h0")
    return a


def test_round_trip_on_disk(arch: Archive, tmp_path: Path) -> None:
    root = tmp_path / "archive"
    cid = add(arch, variant(3))
    assert cid == "c001"
    assert add(arch, variant(4)) == "c002"
    d = root / cid
    assert sorted(p.name for p in d.iterdir()) == ["diff.patch", "harness.py", "meta.json"]
    assert (d / "harness.py").read_text() == variant(3)
    diff = (d / "diff.patch").read_text()
    assert "-MAX_TURNS = 2" in diff and "+MAX_TURNS = 3" in diff and "h0/harness.py" in diff
    assert (root / "h0" / "diff.patch").read_text() == ""
    meta = json.loads((d / "meta.json").read_text())
    assert meta["id"] == "c001" and meta["parent"] == "h0" and meta["iteration"] == 2 and meta["cycle"] == 0
    assert meta["status"] == "proposed" and meta["weight_version"] is None and meta["created"]
    assert meta["hypothesis"] == "raise MAX_TURNS" and meta["reason"] == ""

    rows, traces = episodes(3, 4, turns=2, tokens=120, truncated=1)
    scores = arch.record_evaluation(cid, rows, traces, weight_version=7)
    assert scores["success_rate"] == 0.75 and scores["n"] == 4 and scores["truncation_rate"] == 0.25
    assert scores["mean_turns"] == 2 and scores["mean_prompt_tokens"] == 120

    again = Archive(root)  # a fresh process sees the same
    c = again.get(cid)
    assert c.code == variant(3) and c.status == "evaluated" and c.weight_version == 7
    assert c.success_rate == 0.75 and c.parent == "h0" and c.iteration == 2
    assert [r["task_id"] for r in c.scores["rows"]] == ["t0", "t1", "t2", "t3"]
    assert {"task_id", "reward", "turns", "prompt_tokens", "status", "truncated"} <= set(c.scores["rows"][0])
    assert c.scores["rows"][0]["truncated"] is True and c.scores["rows"][1]["truncated"] is False
    assert [t["task"]["id"] for t in c.traces()] == ["t0", "t1", "t2", "t3"]
    assert len((d / "traces.jsonl").read_text().splitlines()) == 4
    assert [x.id for x in again.candidates()] == ["h0", "c001", "c002"]
    assert [x.id for x in again.candidates("evaluated")] == ["c001"]
    assert "c001" in again and "c999" not in again and len(again) == 3


def test_ids_and_argument_errors(arch: Archive) -> None:
    with pytest.raises(ArchiveError, match="already exists"):
        arch.add_candidate(H0, parent=None, hypothesis="x", iteration=1, cycle=0, candidate_id="h0")
    with pytest.raises(ArchiveError, match="candidate id"):
        arch.add_candidate(H0, parent=None, hypothesis="x", iteration=1, cycle=0, candidate_id="../evil")
    with pytest.raises(ArchiveError, match="parent 'nope' does not exist"):
        add(arch, variant(3), parent="nope")
    with pytest.raises(ArchiveError, match="no candidate 'c404'"):
        arch.get("c404")
    cid = add(arch, variant(3))
    with pytest.raises(ArchiveError, match="2 rows but 1 traces"):
        arch.record_evaluation(cid, episodes(1, 2)[0], episodes(1, 1)[1], weight_version=0)
    rows, traces = episodes(1, 1)
    del rows[0]["turns"]
    with pytest.raises(ArchiveError, match="row 0 lacks turns"):
        arch.record_evaluation(cid, rows, traces, weight_version=0)
    rows, traces = episodes(1, 1)
    rows[0]["phase"] = "test"
    with pytest.raises(ArchiveError, match="never holds test data"):
        arch.record_evaluation(cid, rows, traces, weight_version=0)
    rows, traces = episodes(1, 1)
    rows[0]["status"] = "exploded"
    with pytest.raises(ArchiveError, match="unknown status"):
        arch.record_evaluation(cid, rows, traces, weight_version=0)
    arch.record_evaluation(cid, *episodes(1, 1), weight_version=0)
    with pytest.raises(ArchiveError, match="only a proposed candidate"):
        arch.record_evaluation(cid, *episodes(1, 1), weight_version=0)
    with pytest.raises(ArchiveError, match="already evaluated"):
        arch.mark_invalid(cid, "late")
    with pytest.raises(ValueError, match="unknown candidate status"):
        arch.candidates("done")


def test_read_only(arch: Archive, tmp_path: Path) -> None:
    ro = Archive(tmp_path / "archive", read_only=True)
    assert ro.get("h0").code == H0
    with pytest.raises(ArchiveError, match="read-only"):
        ro.add_candidate(H0, parent="h0", hypothesis="x", iteration=1, cycle=0)
    with pytest.raises(ArchiveError, match="not found"):
        Archive(tmp_path / "missing", read_only=True)


REPO = Path(__file__).resolve().parents[2]


def fail_rename_into(root: Path, call: str, target: str, fault: str) -> subprocess.CompletedProcess:
    """Runs `call` (Python over `archive`, an Archive of `root`) in a subprocess whose rename() into a file named
    `target` really fails: strace's syscall fault injection answers it ENOSPC ("disk full", fault "ENOSPC")
    or SIGKILLs the process at it ("power cut", fault "KILL"). Which rename that is comes from a dry run of
    the same call on a copy of `root` (renames are counted per process; no bytecode is written, so both runs
    make the same calls)."""
    strace = shutil.which("strace")
    if strace is None:
        pytest.skip("strace is missing (scripts/setup.sh installs it): it injects the disk-full and power-cut faults")
    script = ("import sys\nfrom tests.loop.test_archive import episodes, variant\n"
              f"from whale_ray.archive import Archive\narchive = Archive(sys.argv[1])\n{call}\n")
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": str(REPO)}
    dry = root.parent / f"dry-{target}"
    shutil.copytree(root, dry)
    trace = root.parent / f"renames-{target}.txt"
    subprocess.run([strace, "-f", "-qq", "-e", "signal=none", "-e", "trace=rename", "-o", str(trace), sys.executable,
                    "-c", script, str(dry)], env=env, cwd=REPO, check=True, capture_output=True, timeout=120)
    targets = [Path(m.group(1)).name for m in re.finditer(r'rename\("[^"]*", "([^"]*)"\)', trace.read_text())]
    k = targets.index(target) + 1
    action = {"ENOSPC": "error=ENOSPC", "KILL": "signal=KILL"}[fault]
    return subprocess.run([strace, "-f", "-qq", "-e", "signal=none", "-o", os.devnull, "-e", "trace=rename",
                           "-e", f"inject=rename:{action}:when={k}", sys.executable, "-c", script, str(root)],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=120)


def test_atomicity_unfinished_writes_are_not_evaluated(arch: Archive, tmp_path: Path) -> None:
    root = tmp_path / "archive"
    cid = add(arch, variant(3))
    # the disk fills up during record_evaluation, as scores.json is put in place
    out = fail_rename_into(root, f"archive.record_evaluation({cid!r}, *episodes(5, 10), weight_version=0)",
                           "scores.json", "ENOSPC")
    assert out.returncode != 0 and "No space left on device" in out.stderr, out.stderr[-2000:]
    assert (root / cid / "traces.jsonl").exists() and not (root / cid / "scores.json").exists()

    # leftovers of other crashes: temp files, a half-built candidate folder, a lying meta.json
    (root / cid / ".scores.json.tmp-123-abcd").write_text('{"success_rate": 1.0}')
    half = root / ".tmp-c009-deadbeef"
    half.mkdir()
    (half / "harness.py").write_text(H0)
    (half / "meta.json").write_text(json.dumps({"id": "c009", "status": "evaluated"}))
    (root / ".frontier.json.tmp-1-2").write_text("garbage")
    lying = add(Archive(root), variant(4))
    meta = json.loads((root / lying / "meta.json").read_text())
    (root / lying / "meta.json").write_text(json.dumps({**meta, "status": "evaluated", "weight_version": 0}))

    fresh = Archive(root)
    assert [c.id for c in fresh.candidates()] == ["h0", cid, lying]
    assert fresh.get(cid).status == "proposed" and fresh.get(cid).scores is None
    assert fresh.get(lying).status == "proposed"
    assert fresh.candidates("evaluated") == []
    assert [c.id for c in fresh.pending(2)] == [cid, lying]
    assert selection.frontier(fresh.candidates()) == []
    assert add(fresh, variant(5)) == "c003"  # the temp folder's id is not taken into account

    # the retry succeeds; the power goes out after scores.json but before meta.json: still evaluated
    fresh.record_evaluation(cid, *episodes(5, 10), weight_version=0)
    out = fail_rename_into(root, "archive.record_evaluation('c003', *episodes(6, 10), weight_version=0)",
                           "meta.json", "KILL")
    assert out.returncode == -9, out.stderr[-2000:]
    reopened = Archive(root)  # rebuilds the views from the folders
    c3 = reopened.get("c003")
    assert c3.status == "evaluated" and c3.weight_version == 0 and c3.success_rate == 0.6
    summary = [json.loads(x) for x in (root / "summary.jsonl").read_text().splitlines()]
    assert [s["id"] for s in summary] == [cid, "c003"]
    assert not [p for p in (root / cid).iterdir() if p.name.startswith(".") and "tmp" in p.name and p.name != ".scores.json.tmp-123-abcd"]


def test_atomic_write_leaves_no_temp_file(tmp_path: Path) -> None:
    target = tmp_path / "x.json"
    archive_mod.atomic_write_text(target, "one")
    archive_mod.atomic_write_text(target, "two")
    assert target.read_text() == "two"
    assert [p.name for p in tmp_path.iterdir()] == ["x.json"]


def test_frontier_json_is_selections_view(arch: Archive) -> None:
    """frontier.json is written with whale_ray.selection (tested at its edges in test_selection.py)."""
    a = scored(arch, variant(3), 0.5, 2, 100)
    scored(arch, variant(4), 0.5, 3, 100)  # dominated by a
    c = scored(arch, variant(5), 0.25, 1, 100, n=4)
    e = scored(arch, variant(7), 0.75, 4, 300, n=4)
    front = json.loads((arch.root / "frontier.json").read_text())
    assert [f["id"] for f in front["frontier"]] == [e, a, c] == [x.id for x in selection.frontier(arch.candidates())]
    assert front["best"] == e and front["objectives"] == {
        "success_rate": "max", "mean_turns": "min", "mean_prompt_tokens": "min"}


def test_reevaluation_and_views_per_weight_version(arch: Archive) -> None:
    arch.record_evaluation("h0", *episodes(8, 10), weight_version=0)
    # next cycle: the coordinator re-evaluates the incoming harness under the new weights
    re_eval = arch.add_reevaluation("h0", weight_version=1, cycle=1)
    c = arch.get(re_eval)
    assert c.code == H0 and c.parent == "h0" and c.iteration == 1 and c.cycle == 1
    assert c.hypothesis == "re-evaluate incoming harness under weights v1"
    assert (arch.root / re_eval / "diff.patch").read_text() == ""
    arch.record_evaluation(re_eval, *episodes(3, 10), weight_version=1)
    c = scored(arch, variant(3), 0.4, 2, 100, wv=1, parent=re_eval)
    assert arch.weight_versions() == [0, 1]
    front = json.loads((arch.root / "frontier.json").read_text())
    assert front["by_weight_version"]["1"]["best"] == c and front["by_weight_version"]["0"]["best"] == "h0"
    assert [f["id"] for f in front["by_weight_version"]["1"]["frontier"]] == [c]  # c dominates the re-evaluation
    assert front["best"] == "h0"  # archive-wide, across versions: a view, not what the loop accepts


def test_pending_for_resume(arch: Archive, tmp_path: Path) -> None:
    a = add(arch, variant(3), iteration=2)
    b = add(arch, variant(4), iteration=2)
    c = add(arch, variant(5), iteration=3)
    d = add(arch, variant(6), iteration=2, cycle=1)
    assert [x.id for x in arch.pending(2)] == [a, b, d]
    assert [x.id for x in arch.pending(2, cycle=0)] == [a, b]
    arch.record_evaluation(a, *episodes(1, 2), weight_version=0)
    arch.mark_invalid(b, "harness c002: syntax error at line 3: invalid syntax")
    restarted = Archive(tmp_path / "archive")  # the phase restarts after a crash
    assert [x.id for x in restarted.pending(2, cycle=0)] == []
    assert [x.id for x in restarted.pending(3)] == [c]
    assert restarted.get(b).status == "invalid" and "syntax error" in restarted.get(b).meta["reason"]


def test_summary_frontier_and_proposer_view(arch: Archive) -> None:
    root = arch.root
    arch.record_evaluation("h0", *episodes(2, 10, turns=2, tokens=100, truncated=6), weight_version=0)
    good = scored(arch, variant(3), 0.5, 3, 150)
    bad = add(arch, "def run(task):\n    pass\n")
    arch.mark_invalid(bad, "run must take exactly two positional parameters")
    proposed = add(arch, variant(9))
    summary = [json.loads(x) for x in (root / "summary.jsonl").read_text().splitlines()]
    assert [s["id"] for s in summary] == ["h0", good, bad]  # proposed ones are not summarised
    s0 = summary[0]
    assert s0["status"] == "evaluated" and s0["success_rate"] == 0.2 and s0["truncation_rate"] == 0.6
    assert s0["mean_turns"] == 2 and s0["mean_prompt_tokens"] == 100 and s0["n"] == 10 and s0["weight_version"] == 0
    assert summary[2]["status"] == "invalid" and "positional" in summary[2]["reason"] and "success_rate" not in summary[2]
    front = json.loads((root / "frontier.json").read_text())
    assert front["best"] == good
    assert [f["id"] for f in front["frontier"]] == [good, "h0"]  # h0 has fewer turns and tokens
    assert front["frontier"][0] == {"id": good, "weight_version": 0, "success_rate": 0.5,
                                    "mean_turns": 3, "mean_prompt_tokens": 150}

    view = arch.view_for_proposer()
    assert [v["id"] for v in view] == ["h0", good, bad]
    assert proposed not in [v["id"] for v in view]
    h0 = view[0]
    assert h0["code"] == H0 and h0["scores"]["success_rate"] == 0.2 and len(h0["traces"]) == 10
    assert h0["traces"][0]["events"] == [{"type": "turn_budget_exhausted"}]
    assert view[2]["scores"] is None and view[2]["reason"].startswith("run must")
    only = arch.view_for_proposer(traces=["h0"])
    assert only[0]["traces"] and only[1]["traces"] is None
    assert all(v["traces"] is None for v in arch.view_for_proposer(traces=False))
    assert not any(name.startswith(".") for name in os.listdir(root))
