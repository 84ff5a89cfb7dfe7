"""h0, the base harness of the math domain: a plain baseline any instruct model can follow, deliberately weak.

One episode: the system prompt states the tool protocol and the answer format in words; while the model
writes a python block, run it and show it the output.

    system:     Solve the problem. You can run python: write a program in a ```python block that prints the
                result, and its output comes back as "Output: ...". Put the final answer in \\boxed{}.
    user:       Ann has 12 apples. She buys 7 more. ... How many apples does Ann have now?
    assistant:  ```python
                print(12 + 7)
                ```
    user:       Output: 19

The verifier accepts a response only when its LAST \\boxed{...} holds the right answer. h0 is weak on
purpose, in ways a harness change can fix: MAX_TURNS = 2 model calls (a model that runs one step per
python call needs one turn per step plus one to answer), MAX_TOKENS = 48 (a longer program or answer is
cut off), extract_answer passes the model's text through unchanged (a right "The answer is 14." scores 0),
one sample at temperature 1 and no voting.

Standard library only: this file runs inside the sandbox.
"""

import collections
import re

SYSTEM_PROMPT = ("Solve the problem. You can run python: write a program in a ```python block that prints the result, "
                 "and its output comes back as \"Output: ...\". Put the final answer in \\boxed{}.")
MAX_TURNS = 2  # model calls per episode
MAX_TOKENS = 48  # per model call
TEMPERATURE = 1.0
TOP_K = 20
N_VOTES = 1  # episodes per task; above 1, the majority answer wins
OFFER_TOOLS = True  # run the model's python blocks; when False a python block is taken as the answer


def build_messages(task):
    """The opening chat: the system prompt and the question."""
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": task["question"]},
    ]


def find_tool_call(text):
    """The code of the first ```python fenced block in `text`, or None."""
    match = re.search(r"```python\n(.*?)```", text, re.DOTALL)
    return match.group(1).strip() if match else None


def format_observation(output):
    """How a tool's output is shown to the model (as the system prompt says)."""
    return "Output: " + output.strip()


def extract_answer(text):
    """The final response handed to the verifier. h0: the model's text, unchanged."""
    return text


def call_python(agent, code):
    """Run `code` with the domain's python tool; a tool error becomes the observation."""
    try:
        output = agent.tool("python", code=code)
    except agent.ToolError as error:
        output = "Error: " + str(error)
    agent.log("tool_call", name="python", code=code, output=output)
    return output


def run_episode(task, agent):
    """One conversation; the answer, or None when the turn budget runs out mid tool use."""
    messages = build_messages(task)
    for turn in range(MAX_TURNS):
        completion = agent.generate(messages, max_tokens=MAX_TOKENS, temperature=TEMPERATURE, top_k=TOP_K)
        code = find_tool_call(completion)
        if code is None or not OFFER_TOOLS:
            return extract_answer(completion)
        if turn == MAX_TURNS - 1:
            break  # it still wants a tool, but this was the last turn
        messages.append({"role": "assistant", "content": completion})
        messages.append({"role": "user", "content": format_observation(call_python(agent, code))})
    agent.log("turn_budget_exhausted", max_turns=MAX_TURNS)
    return None


def vote_key(answer):
    """What two answers must share to count as the same vote: the last \\boxed{} content, else the text."""
    boxed = re.findall(r"\\boxed\{([^{}]*)\}", answer)
    return boxed[-1].strip() if boxed else answer.strip()


def majority(answers):
    """The first answer of the most common vote key; None answers do not vote."""
    counted = [a for a in answers if a is not None]
    if not counted:
        return None
    counts = collections.Counter(vote_key(a) for a in counted)
    best = max(counts.values())
    return next(a for a in counted if counts[vote_key(a)] == best)


def run(task, agent):
    if N_VOTES <= 1:
        return run_episode(task, agent)
    return majority([run_episode(task, agent) for _ in range(N_VOTES)])
