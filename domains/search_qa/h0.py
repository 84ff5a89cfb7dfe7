"""h0, the base harness of the search_qa domain: deliberately weak.

One episode in Search-R1's format: the model writes <search>query</search> to search, the harness
answers with the passages found, and the model ends with <answer>...</answer>.

    assistant:  <search>Oren Taltavi</search>
    user:       <information>Doc 1(Title: Oren Taltavi) Oren Taltavi was a painter born in ...</information>
    assistant:  <answer>Velmora</answer>

The verifier reads only the LAST <answer>...</answer> of the returned text. h0 is weak on purpose, as
in WHALE: the system prompt states the search protocol and the answer format and nothing more, the
model gets MAX_TURNS = 2 turns (a two-hop question needs two searches and an answer), each search
shows only the top N_PASSAGES = 1 passage cut to PASSAGE_TOKENS = 200 words, and extract_answer
passes the model's text through unchanged.

Standard library only: this file runs inside the sandbox.
"""

import re

SYSTEM_PROMPT = ("Answer the question. To search, write <search>query</search>; the results come back inside "
                 "<information></information>. Put the answer in <answer></answer>.")
MAX_TURNS = 2  # model calls per episode
N_PASSAGES = 1  # passages per search
PASSAGE_TOKENS = 200  # words kept of each passage
MAX_TOKENS = 64  # per model call
TEMPERATURE = 1.0
TOP_K = 20


def build_messages(task):
    """The opening chat: the system prompt and the question."""
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": task["question"]},
    ]


def find_search_query(text):
    """The query of the model's first action when that action is <search>...</search>, else None."""
    match = re.search(r"<(search|answer)>(.*?)</\1>", text, re.DOTALL)
    if match is None or match.group(1) != "search":
        return None
    return match.group(2).strip()


def truncate(passage, n_tokens):
    """The first `n_tokens` whitespace-separated words of a passage."""
    return " ".join(passage.split()[:n_tokens])


def format_observation(output):
    """How search results are shown to the model: one passage per line, inside <information> tags."""
    passages = [line for line in output.strip().split("\n") if line.strip()][:N_PASSAGES]
    return "<information>" + "\n".join(truncate(p, PASSAGE_TOKENS) for p in passages) + "</information>"


def extract_answer(text):
    """The final response handed to the verifier. h0: the model's text, unchanged."""
    return text


def call_search(agent, query):
    """Search with the domain's search tool; a tool error becomes the observation."""
    try:
        output = agent.tool("search", query=query, topk=N_PASSAGES)
    except agent.ToolError as error:
        output = "Error: " + str(error)
    agent.log("tool_call", name="search", query=query, output=output)
    return output


def run_episode(task, agent):
    """One conversation; the answer, or None when the turn budget runs out while the model still searches."""
    messages = build_messages(task)
    for turn in range(MAX_TURNS):
        completion = agent.generate(messages, max_tokens=MAX_TOKENS, temperature=TEMPERATURE, top_k=TOP_K)
        query = find_search_query(completion)
        if query is None:
            return extract_answer(completion)
        if turn == MAX_TURNS - 1:
            break  # it still wants to search, but this was the last turn
        messages.append({"role": "assistant", "content": completion})
        messages.append({"role": "user", "content": format_observation(call_search(agent, query))})
    agent.log("turn_budget_exhausted", max_turns=MAX_TURNS)
    return None


def run(task, agent):
    return run_episode(task, agent)
