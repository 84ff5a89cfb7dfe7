"""The arithmetic world's data: arithmetic questions in plain words, graded by level, and the warm-start
conversations of its embedded policy.

    level 1   one operation on small numbers          What is 7 plus 12?        What is 15 minus 6?
    level 2   two-digit numbers, or a times table      What is 34 plus 27?       What is 6 times 8?
    level 3   two operations, read left to right       What is 12 plus 7 minus 5?   What is 4 times 6 plus 9?

Every answer is a whole number from 0 up. `level` (and `steps`, the number of operations) are public task
fields, so traces and `whale calibrate` can be broken down by them. Everything is deterministic given the
seed (random.Random with string seeds, which do not depend on PYTHONHASHSEED).

The warm-start conversations teach the embedded tiny policy this world's chat as h0 lays it out (its
system prompts, worked examples and tool protocol, copied below), and what they ask conditions what it
does, as a prompt would with any instruct model:
  * TOOL_PROTOCOL in the system prompt -> one fenced python block printing the expression, the output back as
    a user message "Output: N", then the answer; otherwise one turn of working, "34 + 27 = 61. The answer
    is \\boxed{61}.", whose result is sometimes wrong at levels 2 and 3 (INLINE_ERROR_RATE);
  * the answer is boxed at BOXED_RATE[number of worked examples] (more examples, more boxes), at
    UNASKED_BOXED_RATE without examples or \\boxed in the system prompt, else "The answer is 61.".
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass

from domains.math_reasoning.generator import TOOL_PROTOCOL  # one statement of the tool protocol for both worlds
from whale_ray.records import Task

# --- the levels ------------------------------------------------------------------------------------------
LEVEL_WEIGHTS = {1: 0.4, 2: 0.35, 3: 0.25}
SMALL = (2, 20)  # operands of level 1 and of level 3's sums
TWO_DIGIT = (10, 99)  # operands of level 2's sums
TABLE = (2, 12)  # factors of level 2's products
SMALL_TABLE = (2, 9)  # factors of level 3's products

OP_WORDS = {"+": "plus", "-": "minus", "*": "times"}
QUESTION_FORMAT = "What is {words}?"

# --- the warm-start formats: h0.py and skill.md state the same prompts and protocol (tests check the copies) --
TOOL_CALL_FORMAT = "```python\nprint({expression})\n```"
OBSERVATION_FORMAT = "Output: {output}"
STEP_FORMAT = "{left} {op} {right} = {result}."
BOXED_ANSWER_FORMAT = "The answer is \\boxed{{{answer}}}."
PLAIN_ANSWER_FORMAT = "The answer is {answer}."
OP_SIGNS = {"+": "+", "-": "-", "*": "x"}

SYSTEM_PROMPT = "Answer the question. Put the final answer in \\boxed{}."  # h0's
EXAMPLES = (  # h0's worked examples, shown as earlier turns of the chat
    ("What is 2 plus 3?", "2 + 3 = 5. The answer is \\boxed{5}."),
    ("What is 7 times 4?", "7 x 4 = 28. The answer is \\boxed{28}."),
    ("What is 9 minus 4 plus 6?", "9 - 4 = 5. 5 + 6 = 11. The answer is \\boxed{11}."),
)
EXAMPLE_QUESTIONS = frozenset(question for question, _ in EXAMPLES)
# The system prompts of the warm-start data: h0's, then what skill.md's phrases make of it.
SYSTEM_PROMPTS = (SYSTEM_PROMPT, "Answer the question.", "Answer the question. Work it out step by step. Put the final "
                  "answer in \\boxed{}.")

TOOL_RATE = 0.25  # conversations whose system prompt offers python (TOOL_PROTOCOL appended)
EXAMPLE_COUNTS = (0, 1, 1, 2, 3)  # drawn per conversation: how many of EXAMPLES open it
BOXED_MENTION = "\\boxed"
BOXED_RATE = {0: 0.5, 1: 0.65, 2: 0.9, 3: 0.95}  # boxed answers by the number of worked examples; else plain
UNASKED_BOXED_RATE = 0.2  # no worked example and no \boxed in the system prompt
INLINE_ERROR_RATE = {1: 0.0, 2: 0.2, 3: 0.3}  # inline working with a wrong result, by level (the model's own
# arithmetic: what training improves, and the tool avoids)
WARMSTART_BUCKETS = 4  # a question belongs to the warm-start data iff crc32(question) % 4 == 0

SPLIT_ORDER = ("test", "val", "harness", "weight")  # generated first to last: test never depends on the others


@dataclass(frozen=True)
class Question:
    level: int
    numbers: tuple[int, ...]
    ops: tuple[str, ...]

    @property
    def expression(self) -> str:
        """Python source of the value, read left to right (level 3's products come first, so no brackets)."""
        parts = [str(self.numbers[0])]
        for op, n in zip(self.ops, self.numbers[1:]):
            parts += [op, str(n)]
        return " ".join(parts)

    @property
    def answer(self) -> int:
        value = self.numbers[0]
        for op, n in zip(self.ops, self.numbers[1:]):
            value = value + n if op == "+" else value - n if op == "-" else value * n
        return value

    @property
    def text(self) -> str:
        words = [str(self.numbers[0])]
        for op, n in zip(self.ops, self.numbers[1:]):
            words += [OP_WORDS[op], str(n)]
        return QUESTION_FORMAT.format(words=" ".join(words))


def _sum(rng: random.Random, lo: int, hi: int) -> tuple[tuple[int, int], str]:
    a, b = rng.randint(lo, hi), rng.randint(lo, hi)
    if rng.random() < 0.5:
        return (a, b), "+"
    return (max(a, b), min(a, b)), "-"


def draw_question(rng: random.Random, level: int | None = None) -> Question:
    """One random question; `level` (1..3) defaults to a draw from LEVEL_WEIGHTS."""
    if level is None:
        level = rng.choices(list(LEVEL_WEIGHTS), weights=list(LEVEL_WEIGHTS.values()))[0]
    if level == 1:
        (a, b), op = _sum(rng, *SMALL)
        return Question(1, (a, b), (op,))
    if level == 2:
        if rng.random() < 0.5:
            return Question(2, (rng.randint(*TABLE), rng.randint(*TABLE)), ("*",))
        (a, b), op = _sum(rng, *TWO_DIGIT)
        return Question(2, (a, b), (op,))
    if level != 3:
        raise ValueError(f"level must be 1, 2 or 3, got {level}")
    if rng.random() < 0.5:
        left, right = (rng.randint(*SMALL_TABLE), rng.randint(*SMALL_TABLE)), "*"
    else:
        left, right = _sum(rng, *SMALL)
    first = Question(3, left, (right,)).answer
    c = rng.randint(*SMALL)
    op = "+" if c > first or rng.random() < 0.5 else "-"  # the result stays >= 0
    return Question(3, (*left, c), (right, op))


def is_warmstart_question(question: str) -> bool:
    """The fixed partition that keeps warm-start questions out of every generated split."""
    return zlib.crc32(question.strip().encode()) % WARMSTART_BUCKETS == 0


def _unique(rng: random.Random, n: int, seen: set[str], *, warmstart: bool) -> list[Question]:
    out: list[Question] = []
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > 200 * n + 1000:
            raise RuntimeError(f"arithmetic generator: could not draw {n} distinct questions (got {len(out)})")
        q = draw_question(rng)
        if q.text in seen or is_warmstart_question(q.text) != warmstart:
            continue
        seen.add(q.text)
        out.append(q)
    return out


def to_task(q: Question, split: str, index: int) -> Task:
    return Task(id=f"arith-{split}-{index}", question=q.text, answer=str(q.answer),
                meta={"level": q.level, "steps": len(q.ops), "_expression": q.expression})


def generate_splits(sizes: dict[str, int], seed: int) -> dict[str, list[Task]]:
    """Disjoint splits {split: tasks}, sizes keyed by "weight", "harness", "val", "test"; drawn test first, each
    from its own seeded stream and distinct by question across all, so D_test depends only on seed and n_test."""
    seen = set(EXAMPLE_QUESTIONS)  # h0 shows their answers
    out: dict[str, list[Task]] = {}
    for split in SPLIT_ORDER:
        rng = random.Random(f"whale-arith:{seed}:{split}")
        out[split] = [to_task(q, split, i) for i, q in enumerate(_unique(rng, sizes.get(split, 0), seen,
                                                                            warmstart=False))]
    return out


# --- warm-start conversations ------------------------------------------------------------------------------


def working(q: Question, rng: random.Random) -> tuple[str, int]:
    """Inline working, one step per operation; at levels 2 and 3 a result is sometimes off by a little.
    Returns the text and the value it ends on."""
    steps, value = [], q.numbers[0]
    for op, right in zip(q.ops, q.numbers[1:]):
        result = value + right if op == "+" else value - right if op == "-" else value * right
        if rng.random() < INLINE_ERROR_RATE[q.level] / len(q.ops):
            result += rng.choice((-10, -2, -1, 1, 2, 10))
        steps.append(STEP_FORMAT.format(left=value, op=OP_SIGNS[op], right=right, result=result))
        value = result
    return " ".join(steps), value


def reply(q: Question, tool: bool, boxed: bool, rng: random.Random) -> list[dict[str, str]]:
    """The assistant's side of the chat on `q` (with the tool's output between, when offered)."""
    answer_format = BOXED_ANSWER_FORMAT if boxed else PLAIN_ANSWER_FORMAT
    if tool:
        return [{"role": "assistant", "content": TOOL_CALL_FORMAT.format(expression=q.expression)},
                {"role": "user", "content": OBSERVATION_FORMAT.format(output=q.answer)},
                {"role": "assistant", "content": answer_format.format(answer=q.answer)}]
    text, value = working(q, rng)
    return [{"role": "assistant", "content": f"{text} {answer_format.format(answer=value)}"}]


def conversation(q: Question, system_prompt: str, n_examples: int, tool: bool,
                 rng: random.Random) -> list[dict[str, str]]:
    """The chat h0's build_messages lays out (system prompt, worked examples, question), answered."""
    msgs = [{"role": "system", "content": system_prompt + (" " + TOOL_PROTOCOL if tool else "")}]
    for question, answer in EXAMPLES[:n_examples]:
        msgs += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    asked = n_examples > 0 or BOXED_MENTION in system_prompt
    boxed = rng.random() < (BOXED_RATE[n_examples] if asked else UNASKED_BOXED_RATE)
    return msgs + [{"role": "user", "content": q.text}] + reply(q, tool, boxed, rng)


def warmstart_conversations(n: int, seed: int) -> list[list[dict[str, str]]]:
    """`n` warm-start conversations; their questions never coincide with a generated split's or an example's."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = random.Random(f"whale-arith-warmstart:{seed}")
    out = []
    while len(out) < n:  # questions may repeat: the warm-start bucket holds fewer distinct ones than a build asks for
        q = draw_question(rng)
        if is_warmstart_question(q.text) and q.text not in EXAMPLE_QUESTIONS:
            out.append(conversation(q, rng.choice(SYSTEM_PROMPTS), rng.choice(EXAMPLE_COUNTS),
                                    rng.random() < TOOL_RATE, rng))
    return out
