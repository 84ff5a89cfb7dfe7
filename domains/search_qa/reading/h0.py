"""h0, the base harness of the reading world: a plain baseline any instruct model can follow.

The harness searches for the question itself before the model's first turn and shows what it found as plain
text; the model reads it and answers in one turn. The system prompt states the answer format in words and
N_EXAMPLES worked examples show it (as earlier user and assistant turns):

    system:     Answer the question from the text. Put the answer in <answer></answer>.
    user:       Text: Lena Dolan was a singer born in Sivel in 1902. In 1931 Dolan founded Rolo Foods.
                Question: Where was Lena Dolan born?
    assistant:  <answer>Sivel</answer>
    user:       Text: <the N_PASSAGES passages found for the question, one per line>
                Question: Where was the founder of Kesto Mills born?

The verifier reads only the LAST <answer>...</answer> of the returned text. h0 is weak on purpose: one search
with the question as its query (a two-hop question's second passage, about the entity the first one names, is
not among what it finds), N_PASSAGES = 3, MAX_TOKENS = 32, one sample at temperature 1 (no voting), and the
model's text handed to the verifier unchanged (an answer without the tags scores 0).

Standard library only: this file runs inside the sandbox.
"""

import re

SYSTEM_PROMPT = "Answer the question from the text. Put the answer in <answer></answer>."
EXAMPLES = (  # (text, question, answer): worked examples, shown as earlier turns; the first N_EXAMPLES are used
    ("Lena Dolan was a singer born in Sivel in 1902. In 1931 Dolan founded Rolo Foods.",
     "Where was Lena Dolan born?", "Sivel"),
    ("Rolo Foods is a food company based in Pesk. It was founded in 1931 by Lena Dolan.",
     "Who founded Rolo Foods?", "Lena Dolan"),
)
N_EXAMPLES = 2
N_PASSAGES = 3  # passages found for the question
MAX_TOKENS = 32  # per model call
TEMPERATURE = 1.0
TOP_K = 20

_DOC_PREFIX = re.compile(r"^Doc \d+\(Title: [^)]*\)\s*")


def search(agent, query, topk):
    """The passages found for `query`, one per line as the search tool returns them; a tool error becomes ""."""
    try:
        output = agent.tool("search", query=query, topk=topk)
    except agent.ToolError as error:
        output = ""
        agent.log("tool_error", name="search", error=str(error))
    agent.log("tool_call", name="search", query=query, output=output)
    return output


def find_text(task, agent):
    """What the model reads: the passages found for the question, their text only, one per line."""
    lines = [line.strip() for line in search(agent, task["question"], N_PASSAGES).split("\n") if line.strip()]
    return "\n".join(_DOC_PREFIX.sub("", line) for line in lines)


def format_turn(text, question):
    return "Text: " + text + "\nQuestion: " + question


def build_messages(task, text):
    """The opening chat: the system prompt, the worked examples, then the text found and the question."""
    messages = [{"role": "system", "content": SYSTEM_PROMPT}]
    for example_text, question, answer in EXAMPLES[:N_EXAMPLES]:
        messages.append({"role": "user", "content": format_turn(example_text, question)})
        messages.append({"role": "assistant", "content": "<answer>" + answer + "</answer>"})
    messages.append({"role": "user", "content": format_turn(text, task["question"])})
    return messages


def extract_answer(text):
    """The final response handed to the verifier. h0: the model's text, unchanged."""
    return text


def run_episode(task, agent):
    messages = build_messages(task, find_text(task, agent))
    completion = agent.generate(messages, max_tokens=MAX_TOKENS, temperature=TEMPERATURE, top_k=TOP_K)
    return extract_answer(completion)


def run(task, agent):
    return run_episode(task, agent)
