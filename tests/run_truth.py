"""Independent truth about a finished run, for the end-to-end tests.

Selection and report are recomputed from the rollout files (rollouts/val-v{version:05d}-{harness}.parquet holds
each D_val evaluation, rollouts/test-... each D_test report); rollout counts are recomputed from the config's
budgets (E, I, split sizes, samples, candidates per iteration, the schedule), never from state.json's own
record of its files. Nothing here imports the loop: a run is its directory and its config.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pyarrow.parquet as pq

from whale_ray.archive import Archive
from whale_ray.config import WhaleConfig
from whale_ray.domain import get_domain

# A seed harness for tests that need rewards to vary: the math h0 whose extract_answer is a coin flipped by the
# model. It works the generated word problem out itself ("has 7 ... gets 5 more ... doubles them") and hands the
# verifier that answer, boxed, when the model's last completion has an even number of characters, and the
# model's last integer otherwise. So about half the episodes succeed, which ones depends on what the weights
# sample, and different (theta, h) pairs get different D_val and D_test means; weight steps have examples.
GUESSING_EXTRACT = '''def work_out(question):
    """The answer of a generated word problem, from its sentences (None for other text)."""
    value = None
    for sentence in question.split(". "):
        numbers = [int(n) for n in re.findall(r"\\d+", sentence)]
        if value is None:
            value = numbers[0] if numbers else None
        elif "doubles" in sentence or "triples" in sentence:
            value *= 2 if "doubles" in sentence else 3
        elif numbers and re.search(r"gives away|loses|sells|takes out|removes", sentence):
            value -= numbers[0]
        elif numbers:
            value += numbers[0]
    return value


QUESTION = {}


def extract_answer(text):
    """A coin flipped by the model: the worked-out answer when len(text) is even, else the model's last integer."""
    numbers = re.findall(r"-?\\d+", text)
    if len(text) % 2 == 0 and QUESTION.get("value") is not None:
        return "\\\\boxed{" + str(QUESTION["value"]) + "}"
    return "\\\\boxed{" + numbers[-1] + "}" if numbers else text
'''

GUESSING_BUILD = '''def build_messages(task):
    """The opening chat: the system prompt and the question."""
    QUESTION["value"] = work_out(task["question"])
'''


def guessing_math_harness(h0_source: str) -> str:
    old = r"def extract_answer\(text\):\n(    .*\n|\n)*?    return text\n"
    out, n = re.subn(old, lambda _: GUESSING_EXTRACT, h0_source)
    old_build = 'def build_messages(task):\n    """The opening chat: the system prompt and the question."""\n'
    assert n == 1 and out.count(old_build) == 1, "the math h0 no longer has the functions this helper replaces"
    return out.replace(old_build, GUESSING_BUILD)


def rewards(path: Path) -> list[float]:
    return pq.read_table(path, columns=["reward"]).column("reward").to_pylist()


def mean_reward(path: Path) -> float:
    r = rewards(path)
    return sum(r) / len(r)


def rollout_names(run_dir: Path, prefix: str) -> list[str]:
    return sorted(p.stem for p in (Path(run_dir) / "rollouts").glob(f"{prefix}-*.parquet"))


def eval_file(run_dir: Path, split: str, version: int, harness: str) -> Path:
    return Path(run_dir) / "rollouts" / f"{split}-v{version:05d}-{harness}.parquet"


# ------------------------------------------------------------------------------------------ selection
def check_selection(run_dir: Path, state: dict) -> tuple[int, str]:
    """Every history row's val, best-so-far and test_mean8 against the rollout files; returns (theta*, h*).

    Row i evaluates the pair (weight_version, accepted_harness) on D_val. The best so far is the pair with the
    highest val mean among rows 0..i, the earlier pair on ties; the reported test mean is the mean reward of
    that pair's D_test file. D_test files exist only for pairs that were the best at some row."""
    pairs: list[tuple[int, str]] = []  # in order of first evaluation
    vals: dict[tuple[int, str], float] = {}
    bests: set[tuple[int, str]] = set()
    best = None
    for row in state["history"]:
        pair = (row["weight_version"], row["accepted_harness"])
        if pair not in vals:
            pairs.append(pair)
            vals[pair] = mean_reward(eval_file(run_dir, "val", *pair))
        assert row["val"] == vals[pair], (row["cycle"], pair)
        best = max(pairs, key=lambda p: (vals[p], -pairs.index(p)))
        bests.add(best)
        test = eval_file(run_dir, "test", *best)
        assert row["best"] == f"v{best[0]}+{best[1]}", (row["cycle"], row["best"], best, vals)
        assert row["best_val"] == vals[best]
        assert row["test_mean8"] == mean_reward(test), (row["cycle"], best)
        truncated = pq.read_table(test, columns=["truncated"]).column("truncated").to_pylist()
        assert row["test_metrics"]["truncation_rate"] == sum(truncated) / len(truncated)
    assert best is not None
    assert state["best"]["weight_version"] == best[0] and state["best"]["harness_id"] == best[1]
    assert state["best"]["val"] == vals[best]
    # the weights it names are its version's, whole on disk (a checkpoint written beside a phase is on record first)
    assert state["best"]["checkpoint"] == (f"checkpoints/v{best[0]:05d}" if best[0] else None)
    assert best[0] == 0 or (run_dir / state["best"]["checkpoint"]).is_dir()
    # D_val is evaluated for the rows' pairs only, D_test only to report a best pair
    assert rollout_names(run_dir, "val") == sorted(eval_file(run_dir, "val", *p).stem for p in pairs)
    assert rollout_names(run_dir, "test") == sorted(eval_file(run_dir, "test", *p).stem for p in bests)
    return best


# --------------------------------------------------------------------------------------------- ledger
def phase_kinds(cfg: WhaleConfig) -> list[list[str]]:
    """The schedule, written out from the conditions' definitions (MISSION.md), not from whale_ray.schedules."""
    n = cfg.cycles
    return {
        "rsft_only": [["weight"]] * n,
        "mh_only": [["harness"]] * n,
        "whale": [["weight", "harness"]] * n,
        "adaptive_whale": [["weight", "harness"]] * n,
        "stagewise": [["weight"]] * n + [["harness"]] * n,
    }[cfg.condition]


def check_ledger(cfg: WhaleConfig, run_dir: Path, state: dict) -> None:
    """The ledger's rollout counts against what the config's budgets make them; each file counted once."""
    run_dir = Path(run_dir)
    schedule = phase_kinds(cfg)
    adaptive = cfg.condition == "adaptive_whale"
    n_weight, k, per_step = cfg.data.n_weight, cfg.weight.samples_per_prompt, cfg.weight.prompts_per_step
    ledger = state["ledger"]
    done = [p.split(":") for p in state["phases_done"]]
    assert [(int(c), kind) for c, kind, _ in done] == [
        (c + 1, kind) for c, kinds in enumerate(schedule) for kind in kinds]

    # weight phases: E * |D_weight| prompts (at least one), prompts_per_step per step, k samples per prompt
    expected_files: dict[str, int] = {}
    for c, kinds in enumerate(schedule):
        if "weight" not in kinds:
            continue
        units = int(next(u for cc, kind, u in done if int(cc) == c + 1 and kind == "weight"))
        if adaptive:
            a = cfg.adaptive
            lo, hi = math.ceil(a.weight_min_epochs * n_weight / per_step), math.ceil(
                max(1, round(a.weight_max_epochs * n_weight)) / per_step)
            assert lo <= units <= hi, (c, units, lo, hi)
            budget = min(units * per_step, max(1, round(a.weight_max_epochs * n_weight)))
        else:
            budget = max(1, round(cfg.E * n_weight))
            assert units == math.ceil(budget / per_step)
        for s in range(units):
            expected_files[f"weight-c{c:02d}-s{s:04d}"] = min(per_step, budget - s * per_step) * k
    names = rollout_names(run_dir, "weight")
    assert names == sorted(expected_files)
    order = []
    for name in names:
        table = pq.read_table(run_dir / "rollouts" / f"{name}.parquet", columns=["task_id", "sample"])
        assert table.num_rows == expected_files[name], name
        rows = list(zip(table.column("task_id").to_pylist(), table.column("sample").to_pylist()))
        tasks = list(dict.fromkeys(t for t, _ in rows))
        assert sorted(rows) == sorted((t, s) for t in tasks for s in range(k)), name  # k samples of each prompt
        order += tasks
    for start in range(0, len(order), n_weight):  # a reshuffled walk: no prompt twice within one pass
        window = order[start:start + n_weight]
        assert len(set(window)) == len(window), window
    assert ledger["weight_rollouts"] == sum(expected_files.values())

    # harness phases: I iterations each; iteration 1 scores the incoming harness (when not yet scored under the
    # current weights), the others score up to M proposals; a candidate costs one smoke rollout, and
    # n_harness * rollouts_per_example more when it passes
    n_harness_phases = sum("harness" in kinds for kinds in schedule)
    units = [int(u) for _, kind, u in done if kind == "harness"]
    if adaptive:
        a = cfg.adaptive
        assert all(a.harness_min_iterations <= u <= a.harness_max_iterations for u in units), units
    else:
        assert units == [cfg.I] * n_harness_phases
    assert ledger["harness_iterations"] == sum(units)
    m = cfg.harness_phase.candidates_per_iteration
    per_candidate = cfg.data.n_harness * cfg.harness_phase.rollouts_per_example
    archive = Archive(run_dir / "archive")
    expected = 0
    for cand in archive.candidates():
        if cand.status == "evaluated":
            expected += 1 + per_candidate
            (path,) = (run_dir / "rollouts").glob(f"harness-c*-{cand.id}.parquet")
            assert pq.ParquetFile(path).metadata.num_rows == per_candidate, path
        elif cand.status == "invalid" and cand.meta.get("reason", "").startswith("smoke test"):
            expected += 1
    proposals: dict[int, int] = {}
    for cand in archive.candidates():
        if cand.parent is not None and "re-evaluate" not in cand.hypothesis:
            proposals[cand.iteration] = proposals.get(cand.iteration, 0) + 1
    assert all(n <= m for n in proposals.values()), proposals
    if cfg.harness_phase.proposer == "offline" and not adaptive:  # the offline proposer always finds M edits
        assert sorted(proposals.values()) == [m] * (n_harness_phases * (cfg.I - 1))
    assert ledger["harness_rollouts"] == expected

    # evaluations: |D_val| * val_samples per distinct pair of the history, |D_test| * test_samples per best pair
    val_pairs = {(r["weight_version"], r["accepted_harness"]) for r in state["history"]}
    best_pairs = {r["best"] for r in state["history"]}
    assert ledger["eval_rollouts"] == (len(val_pairs) * cfg.data.n_val * cfg.eval.val_samples
                                       + len(best_pairs) * cfg.data.n_test * cfg.eval.test_samples)
    assert state["weight_version"] == ledger["weight_steps"]
    # a weight step trains iff an accepted episode (reward 1) made a model call that generated tokens (a chess h0
    # may solve a mate in one from the legal-move tool without calling the model): then the version moves by one
    def trains(name: str) -> bool:
        table = pq.read_table(run_dir / "rollouts" / f"{name}.parquet", columns=["reward", "calls"])
        return any(r == 1.0 and any(c["completion_ids"] for c in calls)
                   for r, calls in zip(table.column("reward").to_pylist(), table.column("calls").to_pylist()))

    trained = sum(trains(n) for n in names)
    assert ledger["weight_steps"] == trained


# ------------------------------------------------------------------------------------------- staleness
def check_staleness(run_dir: Path, max_staleness: int) -> list[dict]:
    """Every weight step's train/ record against its trained calls; returns the records in step order.

    A call's lag is the step's version less the version the PolicyServer generated it with, and the record's
    `staleness` is their histogram. On-policy every lag is 0. With max_staleness 1 a step's rollouts ran while the
    step before it (in its phase) trained, so after a step that trained every lag is 1, and otherwise 0."""
    records = [json.loads(p.read_text()) for p in sorted((Path(run_dir) / "train").glob("*.json"))]
    for before, r in zip([None, *records], records):
        lag = [r["version_before"] - e["weight_version"] for e in r["examples"]]
        assert r["staleness"] == {str(k): lag.count(k) for k in sorted(set(lag))}, r["rollout_file"]
        behind = max_staleness and r["step"] > 0 and before["version_after"] > before["version_before"]
        assert set(lag) <= ({1} if behind else {0}), (r["rollout_file"], lag)
    return records


# ------------------------------------------------------------------------------------ D_test isolation
def _mentions(pattern: re.Pattern, text: str) -> list[str]:
    return sorted(set(pattern.findall(text)))


def d_test_patterns(cfg: WhaleConfig) -> tuple[re.Pattern, dict]:
    """A pattern matching any D_test id (as a whole token) or question, and the splits (the trusted side's)."""
    splits = get_domain(cfg.domain).load_splits(cfg.data, cfg.seed)
    words = [rf"(?<![\w-]){re.escape(t.id)}(?![\w-])" for t in splits.test]
    words += [re.escape(t.question) for t in splits.test]
    words += [re.escape(json.dumps(t.question)[1:-1]) for t in splits.test]  # as escaped inside JSON text
    return re.compile("|".join(words)), splits


def check_no_test_data(cfg: WhaleConfig, texts: dict[str, str]) -> None:
    """None of `texts` (name -> text) holds a D_test id or question, nor a D_test answer that no other split
    or the texts' own D_harness traces could hold by chance (one of 5+ characters, in no other task)."""
    pattern, splits = d_test_patterns(cfg)
    others = " ".join(f"{t.question} {t.answer}" for t in (*splits.weight, *splits.harness, *splits.val))
    answers = {t.answer for t in splits.test if len(t.answer) >= 5 and t.answer not in others}
    for name, text in texts.items():
        assert not _mentions(pattern, text), (name, _mentions(pattern, text)[:5])
        if not name.endswith("traces.jsonl"):  # traces hold tool outputs (retrieved passages...) of D_harness
            assert not [a for a in answers if a in text], name


def check_test_isolation(cfg: WhaleConfig, run_dir: Path) -> None:
    """D_test reaches nothing but its own reports: not archive/, not proposer/, and of what entered the sandbox
    (the task fields a trace records) no episode outside the test phase held a D_test task, and none at all
    held more than a task's public fields."""
    run_dir = Path(run_dir)
    texts = {str(p.relative_to(run_dir)): p.read_text(errors="replace")
             for folder in ("archive", "proposer") for p in sorted((run_dir / folder).rglob("*")) if p.is_file()}
    _, splits = d_test_patterns(cfg)
    by_split = {name: {t.id: t for t in getattr(splits, name)} for name in ("weight", "harness", "val", "test")}
    for path in sorted((run_dir / "rollouts").glob("*.parquet")):
        split = {"validate": "harness"}.get(path.stem.split("-", 1)[0], path.stem.split("-", 1)[0])
        table = pq.read_table(path, columns=["task_id", "trace"])
        for task_id, trace in zip(table.column("task_id").to_pylist(), table.column("trace").to_pylist()):
            seen = json.loads(trace)["task"]
            assert task_id in by_split[split], f"{path.name}: task {task_id} is not one of D_{split}"
            assert seen == by_split[split][task_id].public(), (path.name, task_id)  # this split's task, public part
            assert "answer" not in seen
            if split != "test":
                texts[f"{path.name}:{task_id}"] = trace
    check_no_test_data(cfg, texts)
