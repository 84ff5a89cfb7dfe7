"""Training data comes from the verifier only: after real weight steps, each step's record
(<run_dir>/train/c{cycle:02d}-s{step:04d}.json) lists exactly the model calls that the domain's verifier accepts,
recomputed here from the step's rollout file, and tool outputs reach the model only in later prompts, never
in the completions it is trained on."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from actors.coordinator import Coordinator
from tests.helpers import load_harness, small_config
from tests.run_truth import guessing_math_harness
from whale_ray.domain import get_domain


def conversations(calls: list[dict]) -> list[list[int]]:
    """The call indices of each conversation of an episode: a call continues the previous one when its messages
    start with the previous call's messages and that call's completion; anything else starts a new chat."""
    out: list[list[int]] = []
    for i, call in enumerate(calls):
        if i:
            prev = calls[i - 1]
            history = prev["messages"] + [{"role": "assistant", "content": prev["completion"]}]
            if call["messages"][:len(history)] == history:
                out[-1].append(i)
                continue
        out.append([i])
    return out


def answering(calls: list[dict], domain) -> list[list[int]]:
    """The conversations whose last completion states an answer in the domain's format (math: a box)."""
    marker = domain.answer_format
    return [c for c in conversations(calls) if marker is not None and marker.open in calls[c[-1]]["completion"]]


def expected_examples(row: dict, task, verify, domain) -> list[tuple[str, int, int]]:
    """(task_id, sample, call) of every call that should train, by the rule docs/contracts.md states: the episode
    is accepted (reward 1, status ok); if at most one of its chats states an answer it is one attempt and every
    call trains, else only the chats whose stated answer the verifier accepts on its own."""
    if row["reward"] != 1 or row["status"] != "ok":
        return []
    calls = json.loads(row["trace"])["calls"]
    stating = answering(calls, domain)
    if len(stating) <= 1:
        keep = range(len(calls))
    else:
        keep = [i for conv in stating if verify(task, calls[conv[-1]]["completion"]) == 1 for i in conv]
    return [(row["task_id"], row["sample"], i) for i in keep if row["calls"][i]["completion_ids"]]


def contains(haystack: list[int], needle: list[int]) -> bool:
    return any(haystack[i:i + len(needle)] == needle for i in range(len(haystack) - len(needle) + 1))


@pytest.fixture(scope="module", params=[1, 3], ids=["one-chat", "three-votes"])
def study(request, tmp_path_factory, ray_cluster, tiny_policy):
    """An RSFT study on math with a seed harness whose answers are sometimes right; with three votes an episode
    holds three independent chats and returns the majority answer."""
    votes = request.param
    folder = tmp_path_factory.mktemp(f"votes{votes}")
    source = guessing_math_harness(get_domain("math_reasoning").h0_path.read_text())
    source = source.replace("N_VOTES = 1 ", f"N_VOTES = {votes} ")
    (folder / "seed.py").write_text(source)
    cfg = small_config(folder / "run", condition="rsft_only", cycles=1, E=1.0, harness=str(folder / "seed.py"),
                       weight__samples_per_prompt=4, data__n_val=2, data__n_test=2, eval__test_samples=1)
    Coordinator(cfg, tiny_policy).run()
    return cfg, load_harness(folder, source), tiny_policy


def weight_files(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "rollouts").glob("weight-*.parquet"))


@pytest.mark.slow
def test_each_step_trains_exactly_the_verifier_accepted_calls(study):
    cfg, harness, _ = study
    run_dir = Path(cfg.run_dir)
    domain = get_domain(cfg.domain)
    splits = domain.load_splits(cfg.data, cfg.seed)
    tasks = {t.id: t for t in splits.weight}
    verify = domain.make_verifier(cfg)
    files = weight_files(run_dir)
    records = sorted((run_dir / "train").glob("*.json"))
    assert [p.stem for p in records] == [p.stem.removeprefix("weight-") for p in files]
    version, trained_steps, split_episodes = 0, 0, 0
    for path, file in zip(records, files):
        record = json.loads(path.read_text())
        cycle, step = (int(part[1:]) for part in file.stem.removeprefix("weight-").split("-"))
        assert (record["cycle"], record["step"], record["rollout_file"]) == (cycle, step, file.stem)
        rows = pq.read_table(file).to_pylist()
        want = [e for row in rows for e in expected_examples(row, tasks[row["task_id"]], verify, domain)]
        got = [(e["task_id"], e["sample"], e["call"]) for e in record["examples"]]
        assert sorted(got) == sorted(want), file.name
        # what the learner saw is that list: its example and token counts are those calls' completions
        calls = {(r["task_id"], r["sample"], i): c for r in rows for i, c in enumerate(r["calls"])}
        assert record["metrics"]["n_examples"] == len(want)
        if want:
            assert record["metrics"]["n_tokens"] == sum(len(calls[e]["completion_ids"]) for e in want)
        assert record["version_before"] == version
        assert record["version_after"] == version + (1 if want else 0)
        version = record["version_after"]
        trained_steps += bool(want)
        accepted = [r for r in rows if r["reward"] == 1 and r["status"] == "ok"]
        split_episodes += sum(len(conversations(json.loads(r["trace"])["calls"])) > 1 for r in accepted)
    state = json.loads((run_dir / "state.json").read_text())
    assert state["weight_version"] == version == state["ledger"]["weight_steps"]
    assert trained_steps > 0  # not vacuous: some steps trained
    # ...and with votes, accepted episodes held several chats. This harness extracts its answers itself (the model
    # seldom boxes), so those episodes are one attempt each; the branch where several chats state answers and
    # the losing ones must not train is checked on scripted calls in tests/loop/test_loop.py.
    if harness["N_VOTES"] > 1:
        assert split_episodes > 0


@pytest.mark.slow
def test_tool_outputs_appear_in_later_prompts_never_in_completions(study):
    from transformers import AutoTokenizer

    cfg, _, model = study
    tokenizer = AutoTokenizer.from_pretrained(model)
    observed = 0
    for file in weight_files(Path(cfg.run_dir)):
        for row in pq.read_table(file).to_pylist():
            trace = json.loads(row["trace"])
            completions = [c["completion_ids"] for c in row["calls"]]
            for conv in conversations(trace["calls"]):
                for before, after in zip(conv, conv[1:]):
                    # what the harness added after the model's turn: the tool's output as the model sees it
                    shown = trace["calls"][after]["messages"][len(trace["calls"][before]["messages"]) + 1:]
                    for message in shown:
                        ids = tokenizer.encode(message["content"], add_special_tokens=False)
                        assert contains(row["calls"][after]["prompt_ids"], ids), (file.name, message)
                        assert len(ids) < 3 or not any(contains(c, ids) for c in completions), (file.name, message)
                        observed += 1
    assert observed > 0  # not vacuous: tool outputs were shown to the model

