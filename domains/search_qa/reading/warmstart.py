"""The warm-start conversations of the embedded tiny policy for the reading world: a scripted reader in the
exact chat layout of h0 (h0.build_messages), over warm-start worlds (never an evaluation world's names).

The reader answers from the text it is shown: right when the passage holding the answer is there (READ_RATE),
else a value of the right kind from the passages, else a guess; it writes the <answer> tags more often when the
system prompt asks for them and when worked examples show them (TAGGED_RATE). The layouts vary as a harness may
vary them (the worked examples shown, the passages found, a second search with the first passage's text), so
that what a harness shows the model changes what it answers.
"""

from __future__ import annotations

import random

from domains.search_qa.generator import MAX_CONVERSATION_CHARS, WorldSearch, conversation_chars, warmstart_questions
from domains.search_qa.retrieval import Passage

from . import h0

SYSTEM_PROMPTS = (h0.SYSTEM_PROMPT, "Answer the question from the text.", "Answer the question.")
ANSWER_MENTION = "<answer>"
EXAMPLE_COUNTS = (0, 1, 2, 2)
PASSAGE_COUNTS = {1: 1, 2: 1, 3: 3, 5: 1}  # passages found for the question: weights
SECOND_SEARCH_RATE = 0.3  # also the passages found with the first passage's text
READ_RATE = 0.85
TAGGED_RATE = {(False, False): 0.3, (False, True): 0.7, (True, False): 0.6, (True, True): 0.95}  # (asked, shown)


def reply(world, question, shown: list[Passage], tags_asked: bool, examples: int, rng: random.Random) -> str:
    q = world.by_question[question]
    titles = list(dict.fromkeys(p.title for p in shown))  # in order: a set's order changes with PYTHONHASHSEED
    if q.answer_title in titles and rng.random() < READ_RATE:
        answer = q.answers[0]
    else:
        near = [v for t in titles for v in world.values.get(t, {}).get(q.answer_type, []) if v not in q.answers]
        answer = rng.choice(near) if near else rng.choice(world.all_values[q.answer_type])
    if rng.random() < TAGGED_RATE[(tags_asked, examples > 0)]:
        return "<answer>" + answer + "</answer>"
    return "The answer is " + answer + "."


def conversation(world, search: WorldSearch, question: str, rng: random.Random) -> list[dict[str, str]]:
    system = rng.choice(SYSTEM_PROMPTS)
    examples = rng.choice(EXAMPLE_COUNTS)
    topk = rng.choices(list(PASSAGE_COUNTS), weights=list(PASSAGE_COUNTS.values()))[0]
    shown = list(search(question, topk))
    if shown and rng.random() < SECOND_SEARCH_RATE:
        shown += [p for p in search(shown[0].text, topk) if p not in shown]
    text = "\n".join(p.text for p in shown)
    messages = [{"role": "system", "content": system}]
    for example_text, example_question, answer in h0.EXAMPLES[:examples]:
        messages.append({"role": "user", "content": h0.format_turn(example_text, example_question)})
        messages.append({"role": "assistant", "content": "<answer>" + answer + "</answer>"})
    messages.append({"role": "user", "content": h0.format_turn(text, question)})
    messages.append({"role": "assistant",
                     "content": reply(world, question, shown, ANSWER_MENTION in system, examples, rng)})
    return messages


def conversations(n: int, seed: int) -> list[list[dict[str, str]]]:
    """`n` reader conversations over warm-start worlds."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = random.Random(f"whale-reading-warmstart:{seed}")
    out: list[list[dict[str, str]]] = []
    if n:
        for world, search, q in warmstart_questions(f"reading:{seed}:", rng):
            chat = conversation(world, search, q.text, rng)
            if conversation_chars(chat) <= MAX_CONVERSATION_CHARS:
                out.append(chat)
                if len(out) == n:
                    break
    return out
