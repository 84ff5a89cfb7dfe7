"""The complementary math world (domains/math_reasoning/complementary, docs/worlds.md) is built as it says:

  * h0's flaw: its token budget is shorter than the taught reasoning of exactly the problems of three or four
    steps, on every problem of the run's splits, in the embedded policy's tokenizer; an edited budget holds all;
  * through the real sandbox and verifier, a policy that writes the taught reasoning perfectly (the best any
    weights can do in the warm-start's format) still scores 0 on those problems under h0, and 1 under the
    edited harness: the flaw is in h0, and a harness change removes it;
  * the world has no tool: a harness cannot hand the arithmetic to python, it stays the model's skill.
"""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from domains.math_reasoning import generator
from tests.helpers import load_harness
from whale_ray.config import DataConfig
from whale_ray.domain import get_domain, split_sizes
from whale_ray.records import ModelCall, Task
from whale_ray.sandbox import SandboxLimits, run_episode

DOMAIN = get_domain("domains.math_reasoning.complementary")

EDITED_MAX_TOKENS = 64


def split_problems(seed: int = 0) -> list[generator.Problem]:
    """The problems of every generated split of a default run, drawn exactly as generate_splits draws them."""
    seen: set[str] = set()
    sizes = split_sizes(DataConfig())
    out = []
    for split in generator.SPLIT_ORDER:
        rng = random.Random(f"whale-math:{seed}:{split}")
        out += generator._unique_problems(rng, sizes.get(split, 0), seen, warmstart=False)
    return out


def taught(p: generator.Problem) -> str:
    """The reasoning the warm-start teaches for a prompt that asks for \\boxed{} and not for python."""
    return generator.reasoning(p.steps, generator.final_answer(p.answer, boxed=True))


@pytest.fixture(scope="module")
def tokenizer(tiny_policy):
    return AutoTokenizer.from_pretrained(tiny_policy)


def test_h0_budget_cuts_exactly_the_long_problems(tokenizer):
    h0 = load_harness(DOMAIN.folder)
    assert "Put the final answer in \\boxed{}" in h0["SYSTEM_PROMPT"] and "python" not in h0["SYSTEM_PROMPT"].lower()
    assert generator.wants_boxed(h0["SYSTEM_PROMPT"]) and not generator.wants_tool(h0["SYSTEM_PROMPT"])
    problems = split_problems()
    assert {len(p.steps) for p in problems} == {1, 2, 3, 4}
    for p in problems:
        n = len(tokenizer(taught(p))["input_ids"])
        assert (n > h0["MAX_TOKENS"]) == (len(p.steps) >= 3), (p.question, n)
        assert n < EDITED_MAX_TOKENS


def perfect_policy(tokenizer, by_question: dict[str, generator.Problem]):
    """A policy that writes the taught reasoning for every question, cut at the harness's max_tokens as an
    engine cuts it (finish reason "length" when the text and its end-of-sequence token do not fit)."""

    def generate(messages, sampling) -> ModelCall:
        ids = tokenizer(taught(by_question[messages[-1]["content"]]))["input_ids"]
        kept = ids[:sampling.max_tokens]
        return ModelCall(messages=messages, text=tokenizer.decode(kept), prompt_ids=[1], completion_ids=kept,
                         logprobs=[0.0] * len(kept), weight_version=0,
                         finish_reason="stop" if len(ids) < sampling.max_tokens else "length")

    return generate


@pytest.mark.usefixtures("bwrap")
def test_h0_flaw_and_the_edit_that_removes_it_in_the_sandbox(tokenizer):
    rng = random.Random("complementary-test")
    problems = [generator.draw_problem(rng, n_steps=n) for n in (1, 2, 3, 4) for _ in range(2)]
    generate = perfect_policy(tokenizer, {p.question: p for p in problems})
    h0 = DOMAIN.h0_path.read_text()
    edited = h0.replace("MAX_TOKENS = 30", f"MAX_TOKENS = {EDITED_MAX_TOKENS}")
    assert edited != h0
    for p in problems:
        task = Task(id="t", question=p.question, answer=str(p.answer), meta={"steps": len(p.steps)})
        rewards = []
        for source in (h0, edited):
            r = run_episode(source, task.public(), generate=generate, tools_path=None, host_tools={},
                            limits=SandboxLimits(wall_s=20), seed=1)
            assert r.status == "ok", (r.status, r.reason)
            rewards.append(DOMAIN.verify(task, r.answer))
        assert rewards == [0.0 if len(p.steps) >= 3 else 1.0, 1.0], (len(p.steps), rewards)


NO_TOOL = '''
def run(task, agent):
    try:
        return agent.tool("python", code="print(6 * 7)")
    except agent.ToolError as error:
        return "ToolError: " + str(error)
'''


@pytest.mark.usefixtures("bwrap")
def test_the_world_has_no_tool():
    assert not DOMAIN.sandbox_tools_path.exists() and DOMAIN.host_tools({}) == {}
    task = Task(id="t", question="Ann has 6 pens. She triples them. How many pens does Ann have now?", answer="18")
    def no_model(messages, sampling):
        raise AssertionError("this harness makes no model call")

    r = run_episode(NO_TOOL, task.public(), generate=no_model, tools_path=None, host_tools={},
                    limits=SandboxLimits(wall_s=20), seed=1)
    assert r.status == "ok" and r.answer.startswith("ToolError") and "42" not in r.answer, (r.status, r.answer)
