"""h0, the base harness of the arithmetic world: a plain baseline any instruct model can follow.

One episode is one chat: the system prompt states the answer format in words, N_EXAMPLES worked examples
show it (as earlier user and assistant turns), then the question.

    system:     Answer the question. Put the final answer in \\boxed{}.
    user:       What is 2 plus 3?
    assistant:  2 + 3 = 5. The answer is \\boxed{5}.
    user:       What is 34 plus 27?
    assistant:  34 + 27 = 61. The answer is \\boxed{61}.

The verifier accepts a response only when its LAST \\boxed{...} holds the right answer. h0 is weak on
purpose: one worked example, the model's text handed to the verifier unchanged (a right answer without a
box scores 0), MAX_TOKENS = 32, one sample at temperature 1 (no voting), and the python tool not offered.
With OFFER_TOOLS the system prompt states the tool protocol in words (TOOL_PROTOCOL): a ```python block that
prints the result is run, and its output comes back as a user message "Output: ...".

Standard library only: this file runs inside the sandbox.
"""

import collections
import re

SYSTEM_PROMPT = "Answer the question. Put the final answer in \\boxed{}."
TOOL_PROTOCOL = ("You can run python: write a program in a ```python block that prints the result, and its output "
               "comes back as \"Output: ...\".")
EXAMPLES = (  # worked examples, shown as earlier turns of the chat; the first N_EXAMPLES are used
    ("What is 2 plus 3?", "2 + 3 = 5. The answer is \\boxed{5}."),
    ("What is 7 times 4?", "7 x 4 = 28. The answer is \\boxed{28}."),
    ("What is 9 minus 4 plus 6?", "9 - 4 = 5. 5 + 6 = 11. The answer is \\boxed{11}."),
)
N_EXAMPLES = 1
MAX_TURNS = 2  # model calls per episode: with the tool, one call and the answer
MAX_TOKENS = 32  # per model call
TEMPERATURE = 1.0
TOP_K = 20
N_VOTES = 1  # episodes per task; above 1, the majority answer wins
OFFER_TOOLS = False  # state the tool protocol in the prompt and run the model's python blocks


def build_messages(task):
    """The opening chat: the system prompt, the worked examples, the question."""
    system = SYSTEM_PROMPT + (" " + TOOL_PROTOCOL if OFFER_TOOLS else "")
    messages = [{"role": "system", "content": system}]
    for question, answer in EXAMPLES[:N_EXAMPLES]:
        messages.append({"role": "user", "content": question})
        messages.append({"role": "assistant", "content": answer})
    messages.append({"role": "user", "content": task["question"]})
    return messages


def find_tool_call(text):
    """The code of the first ```python fenced block in `text`, or None."""
    match = re.search(r"```python\n(.*?)```", text, re.DOTALL)
    return match.group(1).strip() if match else None


def format_observation(output):
    """How a tool's output is shown to the model (as the tool prompt says)."""
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
        code = find_tool_call(completion) if OFFER_TOOLS else None
        if code is None:
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
