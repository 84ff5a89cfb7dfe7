"""The offline generator: small multi-step arithmetic word problems, and the warm-start conversations.

This is the embedded default data of the math domain. The embedded policy is a ~1M-parameter
transformer trained for a couple of minutes on CPU, so the problems are small: operands 1..20, every
intermediate and final result in 1..99, one to four steps.

    Ann has 12 apples. She buys 7 more. She gives away 5. How many apples does Ann have now?

Everything is deterministic given the seed (random.Random with string seeds, which do not depend on
PYTHONHASHSEED).

The warm-start conversations give the tiny model the domain's formats, and the wording of the system
prompt conditions its behaviour (so that a harness's prompt matters):
  * a system prompt that mentions python -> one tool call per step, each a fenced block
    (TOOL_CALL_FORMAT), the observation comes back as a user message (OBSERVATION_FORMAT), and after
    the last step the assistant answers; in WHOLE_EXPRESSION_RATE of these conversations the assistant
    computes the whole expression in a single call instead;
  * no python -> one turn of inline reasoning, "12 + 7 = 19 . 19 - 5 = 14 . \\boxed{14}";
  * a system prompt that mentions \\boxed -> the answer is always BOXED_ANSWER_FORMAT, otherwise
    PLAIN_ANSWER_FORMAT ("The answer is 14.") in PLAIN_ANSWER_RATE of the conversations and
    BOXED_ANSWER_FORMAT in the rest.
The first system prompt is h0's, which states the tool protocol and the answer format in words (as any
instruct model needs them); the others are shorter prompts and phrase combinations a harness may write.
h0.py duplicates the few of these strings it needs (it runs in a sandbox with the standard library
only); tests/domains/test_math_domain.py checks that the copies agree.
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass

from whale_ray.records import Task

# --- formats shared by the warm-start data, h0 and the tests ------------------------------------
TOOL_CALL_FORMAT = "```python\n{code}\n```"
TOOL_CODE_FORMAT = "print({expression})"
OBSERVATION_FORMAT = "Output: {output}"
BOXED_ANSWER_FORMAT = "\\boxed{{{answer}}}"
PLAIN_ANSWER_FORMAT = "The answer is {answer}."
REASONING_STEP_FORMAT = "{left} {op} {right} = {result}"
REASONING_SEPARATOR = " . "

TOOL_MENTION = "python"  # a system prompt containing this word (any case) asks for tool calls
BOXED_MENTION = "\\boxed"  # a system prompt containing this asks for a boxed answer

# h0's statement of the tool protocol, and of the answer format.
TOOL_PROTOCOL = ("You can run python: write a program in a ```python block that prints the result, and its output "
                 "comes back as \"Output: ...\".")
BOXED_REQUEST = "Put the final answer in \\boxed{}."

# The system prompts of the warm-start data. The first is h0's.
SYSTEM_PROMPTS = (
    f"Solve the problem. {TOOL_PROTOCOL} {BOXED_REQUEST}",
    f"Solve the problem. {TOOL_PROTOCOL}",
    "Solve the problem. You can run python.",
    f"Solve the problem. You can run python. {BOXED_REQUEST}",
    "You are a math assistant. You can run python.",
    "Solve the problem.",
    f"Solve the problem. {BOXED_REQUEST}",
    f"Solve the problem step by step. {BOXED_REQUEST}",
)

WHOLE_EXPRESSION_RATE = 0.15  # tool conversations that compute everything in one call
PLAIN_ANSWER_RATE = 0.8  # without \boxed in the system prompt: "The answer is N." instead of \boxed{N}
WARMSTART_BUCKETS = 4  # a question belongs to the warm-start data iff crc32(question) % 4 == 0

# --- limits of the generated problems ------------------------------------------------------------
MIN_OPERAND, MAX_OPERAND = 1, 20
MAX_RESULT = 99
STEP_WEIGHTS = {1: 0.35, 2: 0.35, 3: 0.2, 4: 0.1}

# --- vocabulary -----------------------------------------------------------------------------------
NAMES = (
    ("Ann", "She"), ("Tom", "He"), ("Mia", "She"), ("Sam", "He"), ("Lily", "She"),
    ("Ben", "He"), ("Emma", "She"), ("Leo", "He"), ("Zoe", "She"), ("Max", "He"),
)
ITEMS = ("apples", "pens", "cards", "marbles", "books", "stickers", "coins", "shells", "eggs", "cookies")
FOOD = frozenset({"apples", "eggs", "cookies"})
CONTAINERS = ("box", "bag", "basket", "jar")

# Verb phrases per operation, for the "person has" frame ({p} is the pronoun, {n} the operand).
PERSON_ADD = ("{p} buys {n} more.", "{p} finds {n} more.", "{p} gets {n} more.", "{p} wins {n} more.")
PERSON_SUB = ("{p} gives away {n}.", "{p} loses {n}.", "{p} sells {n}.")
PERSON_EAT = "{p} eats {n}."
PERSON_MUL = {2: "{p} doubles them.", 3: "{p} triples them."}
# ... and for the "container" frame ({name} is who acts).
CONTAINER_ADD = ("{name} puts in {n} more.", "{name} adds {n} more.")
CONTAINER_SUB = ("{name} takes out {n}.", "{name} removes {n}.")
CONTAINER_MUL = {2: "The number of {items} doubles.", 3: "The number of {items} triples."}

SPLIT_ORDER = ("test", "val", "harness", "weight")  # generated first to last: test never depends on the others


@dataclass(frozen=True)
class Step:
    """One arithmetic step: left op right = result (left is the running value)."""

    left: int
    op: str  # "+", "-", "*"
    right: int
    result: int


@dataclass(frozen=True)
class Problem:
    question: str
    steps: tuple[Step, ...]
    expression: str  # a Python expression whose value is the answer, e.g. "(12 + 7) * 2 - 5"

    @property
    def answer(self) -> int:
        return self.steps[-1].result


def _draw_steps(rng: random.Random, n_steps: int) -> tuple[int, list[Step]]:
    start = rng.randint(MIN_OPERAND, MAX_OPERAND)
    value, steps = start, []
    for _ in range(n_steps):
        choices = [op for op, ok in (
            ("+", value + MIN_OPERAND <= MAX_RESULT),
            ("-", value > MIN_OPERAND),
            ("*", 0 < value and value * 2 <= MAX_RESULT),
        ) if ok]
        op = rng.choice(choices)
        if op == "+":
            right = rng.randint(MIN_OPERAND, min(MAX_OPERAND, MAX_RESULT - value))
            result = value + right
        elif op == "-":
            right = rng.randint(MIN_OPERAND, min(MAX_OPERAND, value - 1))  # leaves at least 1: few zero answers
            result = value - right
        else:
            right = 3 if value * 3 <= MAX_RESULT and rng.random() < 0.3 else 2
            result = value * right
        steps.append(Step(value, op, right, result))
        value = result
    return start, steps


def _expression(start: int, steps: list[Step]) -> str:
    expr, has_sum = str(start), False
    for s in steps:
        if s.op == "*":
            expr = f"({expr}) * {s.right}" if has_sum else f"{expr} * {s.right}"
        else:
            expr, has_sum = f"{expr} {s.op} {s.right}", True
    return expr


def _person_story(rng: random.Random, start: int, steps: list[Step]) -> str:
    name, pronoun = rng.choice(NAMES)
    items = rng.choice(ITEMS)
    parts = [f"{name} has {start} {items}."]
    for s in steps:
        if s.op == "+":
            phrase = rng.choice(PERSON_ADD)
        elif s.op == "-":
            phrase = rng.choice(PERSON_SUB + ((PERSON_EAT,) if items in FOOD else ()))
        else:
            phrase = PERSON_MUL[s.right]
        parts.append(phrase.format(p=pronoun, n=s.right))
    parts.append(f"How many {items} does {name} have now?")
    return " ".join(parts)


def _container_story(rng: random.Random, start: int, steps: list[Step]) -> str:
    name, _ = rng.choice(NAMES)
    items = rng.choice(ITEMS)
    container = rng.choice(CONTAINERS)
    parts = [f"A {container} has {start} {items}."]
    for s in steps:
        if s.op == "+":
            parts.append(rng.choice(CONTAINER_ADD).format(name=name, n=s.right))
        elif s.op == "-":
            parts.append(rng.choice(CONTAINER_SUB).format(name=name, n=s.right))
        else:
            parts.append(CONTAINER_MUL[s.right].format(items=items))
    parts.append(f"How many {items} are in the {container} now?")
    return " ".join(parts)


def draw_problem(rng: random.Random, n_steps: int | None = None) -> Problem:
    """One random problem; `n_steps` (1..4) defaults to a draw from STEP_WEIGHTS."""
    if n_steps is None:
        n_steps = rng.choices(list(STEP_WEIGHTS), weights=list(STEP_WEIGHTS.values()))[0]
    start, steps = _draw_steps(rng, n_steps)
    story = _person_story if rng.random() < 0.7 else _container_story
    return Problem(story(rng, start, steps), tuple(steps), _expression(start, steps))


def is_warmstart_question(question: str) -> bool:
    """The fixed partition that keeps warm-start questions out of every generated split."""
    return zlib.crc32(question.strip().encode()) % WARMSTART_BUCKETS == 0


def _unique_problems(rng: random.Random, n: int, seen: set[str], *, warmstart: bool) -> list[Problem]:
    out: list[Problem] = []
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > 200 * n + 1000:
            raise RuntimeError(f"generator: could not draw {n} distinct problems (got {len(out)})")
        p = draw_problem(rng)
        key = p.question.strip()
        if key in seen or is_warmstart_question(key) != warmstart:
            continue
        seen.add(key)
        out.append(p)
    return out


def to_task(p: Problem, split: str, index: int) -> Task:
    return Task(
        id=f"gen-{split}-{index}",
        question=p.question,
        answer=str(p.answer),
        meta={"steps": len(p.steps), "_expression": p.expression},
    )


def generate_splits(sizes: dict[str, int], seed: int) -> dict[str, list[Task]]:
    """Disjoint generated splits, {split: tasks}; sizes keyed by "weight", "harness", "val", "test".

    Splits are drawn test first, then val, harness, weight, each from its own seeded stream, and are
    deduplicated by question text across all of them, so D_test depends only on the seed and n_test.
    """
    seen: set[str] = set()
    out: dict[str, list[Task]] = {}
    for split in SPLIT_ORDER:
        rng = random.Random(f"whale-math:{seed}:{split}")
        problems = _unique_problems(rng, sizes.get(split, 0), seen, warmstart=False)
        out[split] = [to_task(p, split, i) for i, p in enumerate(problems)]
    return out


# --- warm-start conversations --------------------------------------------------------------------


def wants_tool(system_prompt: str) -> bool:
    return TOOL_MENTION in system_prompt.lower()


def wants_boxed(system_prompt: str) -> bool:
    return BOXED_MENTION in system_prompt


def tool_call(expression: str) -> str:
    return TOOL_CALL_FORMAT.format(code=TOOL_CODE_FORMAT.format(expression=expression))


def observation(output: int | str) -> str:
    return OBSERVATION_FORMAT.format(output=output)


def final_answer(answer: int | str, boxed: bool) -> str:
    return (BOXED_ANSWER_FORMAT if boxed else PLAIN_ANSWER_FORMAT).format(answer=answer)


def reasoning(steps: tuple[Step, ...], answer_text: str) -> str:
    lines = [REASONING_STEP_FORMAT.format(left=s.left, op=s.op, right=s.right, result=s.result) for s in steps]
    return REASONING_SEPARATOR.join(lines + [answer_text])


def conversation(p: Problem, system_prompt: str, *, whole_expression: bool, boxed: bool) -> list[dict[str, str]]:
    """The conversation that shows the behaviour `system_prompt` asks for on problem `p`."""
    msgs = [{"role": "system", "content": system_prompt}, {"role": "user", "content": p.question}]
    answer = final_answer(p.answer, boxed)
    if not wants_tool(system_prompt):
        msgs.append({"role": "assistant", "content": reasoning(p.steps, answer)})
        return msgs
    if whole_expression:
        calls = [(p.expression, p.answer)]
    else:
        calls = [(f"{s.left} {s.op} {s.right}", s.result) for s in p.steps]
    for expression, value in calls:
        msgs.append({"role": "assistant", "content": tool_call(expression)})
        msgs.append({"role": "user", "content": observation(value)})
    msgs.append({"role": "assistant", "content": answer})
    return msgs


def warmstart_conversations(n: int, seed: int) -> list[list[dict[str, str]]]:
    """`n` warm-start conversations; questions never coincide with a generated split's (see is_warmstart_question)."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = random.Random(f"whale-math-warmstart:{seed}")
    problems = _unique_problems(rng, n, set(), warmstart=True)
    out = []
    for p in problems:
        system_prompt = rng.choice(SYSTEM_PROMPTS)
        whole = wants_tool(system_prompt) and rng.random() < WHOLE_EXPRESSION_RATE  # same as per-step at 1 step
        boxed = wants_boxed(system_prompt) or rng.random() >= PLAIN_ANSWER_RATE
        out.append(conversation(p, system_prompt, whole_expression=whole, boxed=boxed))
    return out
