"""h0 of the complementary math world: the model answers in one turn of inline reasoning, with no tool.

    user:       Ann has 12 apples. She buys 7 more. She gives away 5. How many apples does Ann have now?
    assistant:  12 + 7 = 19 . 19 - 5 = 14 . \\boxed{14}

The verifier accepts a response only when its LAST \\boxed{...} holds the right answer. h0's flaw is its
token budget: MAX_TOKENS = 30 holds the model's reasoning for a problem of one or two steps, never for
three or four (the reasoning writes every step), so those answers are cut off before their \\boxed{}.

Standard library only: this file runs inside the sandbox.
"""

import re  # noqa: F401  (the extract_answer variants of skill.md use it)

SYSTEM_PROMPT = "Solve the problem. Put the final answer in \\boxed{}."
MAX_TOKENS = 30  # per model call
TEMPERATURE = 1.0
TOP_K = 20


def build_messages(task):
    """The opening chat: the system prompt and the question."""
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": task["question"]},
    ]


def extract_answer(text):
    """The final response handed to the verifier. h0: the model's text, unchanged."""
    return text


def run(task, agent):
    completion = agent.generate(build_messages(task), max_tokens=MAX_TOKENS, temperature=TEMPERATURE, top_k=TOP_K)
    if agent.last_finish_reason == "length":
        agent.log("token_budget_exhausted", max_tokens=MAX_TOKENS)
    return extract_answer(completion)
