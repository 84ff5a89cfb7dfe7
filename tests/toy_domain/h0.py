"""h0 of the toy domain: one model call, the completion returned as it is. Standard library only."""

SYSTEM_PROMPT = "Count the letters. Put the count in <answer></answer>."
MAX_TOKENS = 16
TEMPERATURE = 1.0
TOP_K = 20


def build_messages(task):
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": task["question"]}]


def run(task, agent):
    return agent.generate(build_messages(task), max_tokens=MAX_TOKENS, temperature=TEMPERATURE, top_k=TOP_K)
