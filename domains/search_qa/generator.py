"""The offline generator: an invented world written as short passages, questions about it, and the
warm-start conversations of the embedded tiny policy.

The world (deterministic in the seed; names are invented so no model can know the facts):
  * countries; cities  "Velmora\\nVelmora is a port city in Norvessa."
  * people             "Oren Taltavi\\nOren Taltavi was a painter born in Velmora in 1874. In 1921 Taltavi founded Kesto Mills."
  * companies          "Kesto Mills\\nKesto Mills is a textile company based in Dravik. It was founded in 1921 by Oren Taltavi."
The passages are the corpus that the BM25 retriever indexes by default. Questions:
  * single-hop (group "generated-1hop"): "Where was Oren Taltavi born?", "Who founded Kesto Mills?", ...
  * two-hop (group "generated-2hop"): "Where was the founder of Kesto Mills born?", "In which country is
    Kesto Mills based?", ... : the first passage names a bridge entity whose passage holds the answer.

The warm-start conversations are written by a scripted teacher (`teacher_turn`) that plays the model's
part in the exact chat layout h0 produces:
    system:     a system prompt (draw_system_prompt)
    user:       the question
    assistant:  <search>Oren Taltavi</search>
    user:       <information>Doc 1(Title: Oren Taltavi) Oren Taltavi was a painter born in ...</information>
    assistant:  <answer>Velmora</answer>
h0's system prompt states the search protocol and the answer format in words (as any instruct model needs
them). The teacher mostly searches well and answers from what it read, but not always (GUESS_RATE,
ENTITY_QUERY_RATE, CONTINUE_RATE, ...), and the wording of the system prompt shifts those rates (the
*_MENTION strings), so that a harness's prompt, turn budget and passage count all matter. Every
conversation stays under MAX_CONVERSATION_CHARS: the tiny policy sees at most 512 tokens.

Warm-start worlds are other worlds than any evaluation world, and their entity names come from a
disjoint part of the name space (`is_warmstart_name`), so the policy cannot memorise a test fact.
Randomness is random.Random with string seeds (independent of PYTHONHASHSEED).
"""

from __future__ import annotations

import functools
import itertools
import random
import re
import zlib
from dataclasses import dataclass, field
from typing import Iterator

from whale_ray.domain import DataError
from whale_ray.records import Task

from .retrieval import BM25Retriever, Passage, format_passages

# --- formats shared by the warm-start data, h0 and the tests ------------------------------------
SEARCH_FORMAT = "<search>{query}</search>"
INFORMATION_FORMAT = "<information>{passages}</information>"
ANSWER_FORMAT = "<answer>{answer}</answer>"
PLAIN_ANSWER_FORMAT = "The answer is {answer}."

# h0's statement of the search tool's protocol; the shorter form is one a harness may write instead.
SEARCH_PROTOCOL = "To search, write <search>query</search>; the results come back inside <information></information>."
BASE_PROMPTS = (f"Answer the question. {SEARCH_PROTOCOL}", "Answer the question. Use <search>query</search> to search.")
ANSWER_PHRASE = "Put the answer in <answer></answer>."
ALWAYS_SEARCH_PHRASE = "Always search before answering."
SEARCH_AGAIN_PHRASE = "Search again if one search is not enough."
SEARCH_NAME_PHRASE = "Search for the name in the question."
OPTIONAL_PHRASES = (ALWAYS_SEARCH_PHRASE, SEARCH_AGAIN_PHRASE, SEARCH_NAME_PHRASE)

# What a system prompt must contain (case-insensitive) to shift the teacher's behaviour.
ANSWER_MENTION = "<answer>"
ALWAYS_SEARCH_MENTION = "always search"
SEARCH_AGAIN_MENTION = "search again"
SEARCH_NAME_MENTION = "name in the question"


H0_SYSTEM_PROMPT = f"{BASE_PROMPTS[0]} {ANSWER_PHRASE}"
H0_PROMPT_SHARE = 0.3  # of warm-start conversations; the others get a base prompt and a random set of phrases


def draw_system_prompt(rng: random.Random) -> str:
    """A warm-start system prompt: h0's, or a base prompt followed by any of the other phrases in any
    order (a proposer may append a phrase after the answer instruction, say)."""
    if rng.random() < H0_PROMPT_SHARE:
        return H0_SYSTEM_PROMPT
    phrases = [p for p in OPTIONAL_PHRASES + (ANSWER_PHRASE,) if rng.random() < 0.5]
    rng.shuffle(phrases)
    return " ".join([rng.choice(BASE_PROMPTS)] + phrases)


# --- the teacher's habits (without / with the prompt mention that changes them) -------------------
GUESS_RATE = (0.1, 0.0)  # answer at once without searching / with ALWAYS_SEARCH_MENTION
ENTITY_QUERY_RATE = (0.7, 0.95)  # search the entity's name, not the whole question / SEARCH_NAME_MENTION
CONTINUE_RATE = (0.5, 0.9)  # two-hop: search the bridge entity rather than answer after hop one / SEARCH_AGAIN
RESEARCH_RATE = (0.4, 0.9)  # the first search missed: search the entity's name / SEARCH_AGAIN_MENTION
TAGGED_RATE = (0.4, 0.9)  # final answer in <answer> tags, else PLAIN_ANSWER_FORMAT / ANSWER_MENTION
WARMSTART_TOPK = {1: 0.6, 2: 0.25, 3: 0.15}  # passages per search in the warm-start conversations
WARMSTART_MAX_TURNS = 4
MAX_CONVERSATION_CHARS = 1200  # ~400 tokens of the tiny policy's tokenizer

# --- the world -----------------------------------------------------------------------------------
N_COUNTRIES, N_CITIES, N_PEOPLE, N_COMPANIES = 12, 60, 300, 120
TWO_HOP_SHARE = 0.5  # of every generated split
SPLIT_ORDER = ("test", "val", "harness", "weight")  # drawn first to last: D_test depends only on seed, n_test
WARMSTART_NAME_BUCKETS = 4  # a name belongs to warm-start worlds iff crc32(name) % 4 == 0

OCCUPATIONS = ("painter", "chemist", "sailor", "architect", "poet", "banker", "engineer", "farmer", "composer",
               "surgeon", "weaver", "astronomer", "lawyer", "baker", "printer", "geologist")
CITY_KINDS = ("port", "mountain", "river", "market", "border", "mining")
COMPANY_KINDS = (("Mills", "textile"), ("Works", "steel"), ("Press", "publishing"), ("Foundry", "metal"),
                 ("Shipyards", "shipbuilding"), ("Motors", "car"), ("Brewery", "brewing"), ("Labs", "chemical"))
_ONSETS = ("b", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "gr", "kr", "st",
           "tr", "th")
_VOWELS = ("a", "e", "i", "o", "u", "a", "e", "o")
_CODAS = ("", "", "", "", "n", "r", "l", "s", "m", "k")


@dataclass(frozen=True)
class Question:
    text: str
    answers: tuple[str, ...]
    hops: int
    answer_type: str  # "city", "year", "occupation", "person", "country"
    entity: str  # the name in the question: the first search
    hop1_title: str  # the passage that answers a one-hop question / names the bridge of a two-hop one
    answer_title: str  # the passage holding the answer
    bridge: str | None = None  # two-hop: the entity named in hop1_title's passage

    @property
    def group(self) -> str:
        return f"generated-{self.hops}hop"


@dataclass
class World:
    passages: list[Passage]
    questions: list[Question]
    values: dict[str, dict[str, list[str]]] = field(default_factory=dict)  # title -> answer type -> values
    all_values: dict[str, list[str]] = field(default_factory=dict)  # answer type -> every value in the world

    def __post_init__(self) -> None:
        self.by_question = {q.text: q for q in self.questions}


def is_warmstart_name(name: str) -> bool:
    """The fixed partition of the name space between warm-start worlds and evaluation worlds."""
    return zlib.crc32(name.encode()) % WARMSTART_NAME_BUCKETS == 0


class _Names:
    """Distinct invented names of one world, from one side of the warm-start partition."""

    def __init__(self, rng: random.Random, warmstart: bool):
        self.rng, self.warmstart, self.used = rng, warmstart, set()

    def word(self, syllables: int) -> str:
        r = self.rng
        return "".join(r.choice(_ONSETS) + r.choice(_VOWELS) + r.choice(_CODAS) for _ in range(syllables)).capitalize()

    def draw(self, syllables: tuple[int, ...], template: str = "{}") -> str:
        """`template` filled with a new word; the whole name must fall on this world's side of the partition."""
        for _ in range(10_000):
            word = self.word(self.rng.choice(syllables))
            name = template.format(word)
            if is_warmstart_name(name) == self.warmstart and word.lower() not in self.used:
                self.used.add(word.lower())
                return name
        raise RuntimeError("generator: ran out of distinct names")  # pragma: no cover - the space is huge


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def build_world(seed: int | str, *, warmstart: bool = False, sizes: tuple[int, int, int, int] | None = None) -> World:
    """One world: (countries, cities, people, companies) = `sizes`; evaluation names unless `warmstart`."""
    n_countries, n_cities, n_people, n_companies = sizes or (N_COUNTRIES, N_CITIES, N_PEOPLE, N_COMPANIES)
    rng = random.Random(f"whale-search-world:{'warmstart' if warmstart else 'eval'}:{seed}")
    names = _Names(rng, warmstart)
    # First names repeat across people, as in life; only full names must be distinct.
    first_names = [names.word(2) for _ in range(40)]
    names.used.update(f.lower() for f in first_names)
    countries = [names.draw((2, 3)) for _ in range(n_countries)]
    cities = [(names.draw((2,)), rng.choice(countries), rng.choice(CITY_KINDS)) for _ in range(n_cities)]
    people = []
    for _ in range(n_people):
        name = names.draw((2,), rng.choice(first_names) + " {}")
        people.append({"name": name, "surname": name.split()[-1],
                       "job": rng.choice(OCCUPATIONS), "city": rng.choice(cities)[0], "year": rng.randint(1800, 1960)})
    companies = []
    for founder in rng.sample(people, n_companies):
        suffix, industry = rng.choice(COMPANY_KINDS)
        name = names.draw((2,), "{} " + suffix)
        year = founder["year"] + rng.randint(25, 50)
        founder["company"], founder["founded"] = name, year
        # based elsewhere than the founder's birthplace, so the company's passage never answers a two-hop question
        city = rng.choice([c for c, _, _ in cities if c != founder["city"]])
        companies.append({"name": name, "industry": industry, "city": city, "year": year,
                          "founder": founder})

    country_of = {c: country for c, country, _ in cities}
    passages: list[Passage] = []
    values: dict[str, dict[str, list[str]]] = {}
    for i, (city, country, kind) in enumerate(cities):
        passages.append(Passage(f"city-{i}", city, f"{city} is {_article(kind)} {kind} city in {country}."))
        values[city] = {"city": [city], "country": [country]}
    for i, p in enumerate(people):
        text = f"{p['name']} was {_article(p['job'])} {p['job']} born in {p['city']} in {p['year']}."
        if "company" in p:
            text += f" In {p['founded']} {p['surname']} founded {p['company']}."
        passages.append(Passage(f"person-{i}", p["name"], text))
        values[p["name"]] = {"person": [p["name"]], "occupation": [p["job"]], "city": [p["city"]],
                             "year": [str(p["year"])] + ([str(p["founded"])] if "company" in p else [])}
    for i, c in enumerate(companies):
        f = c["founder"]
        text = (f"{c['name']} is {_article(c['industry'])} {c['industry']} company based in {c['city']}. "
                f"It was founded in {c['year']} by {f['name']}.")
        passages.append(Passage(f"company-{i}", c["name"], text))
        values[c["name"]] = {"city": [c["city"]], "year": [str(c["year"])], "person": [f["name"]]}

    def person_answers(p: dict) -> tuple[str, ...]:
        return (p["name"], p["surname"])

    qs: list[Question] = []
    for p in people:
        n = p["name"]
        qs += [Question(f"Where was {n} born?", (p["city"],), 1, "city", n, n, n),
               Question(f"In what year was {n} born?", (str(p["year"]),), 1, "year", n, n, n),
               Question(f"What was the occupation of {n}?", (p["job"],), 1, "occupation", n, n, n),
               Question(f"In which country was {n} born?", (country_of[p["city"]],), 2, "country", n, n, p["city"],
                        p["city"])]
    for c in companies:
        n, f = c["name"], c["founder"]
        qs += [Question(f"Who founded {n}?", person_answers(f), 1, "person", n, n, n),
               Question(f"In what year was {n} founded?", (str(c["year"]),), 1, "year", n, n, n),
               Question(f"Where is {n} based?", (c["city"],), 1, "city", n, n, n),
               Question(f"Where was the founder of {n} born?", (f["city"],), 2, "city", n, n, f["name"], f["name"]),
               Question(f"In what year was the founder of {n} born?", (str(f["year"]),), 2, "year", n, n, f["name"],
                        f["name"]),
               Question(f"What was the occupation of the founder of {n}?", (f["job"],), 2, "occupation", n, n,
                        f["name"], f["name"]),
               Question(f"In which country is {n} based?", (country_of[c["city"]],), 2, "country", n, n, c["city"],
                        c["city"])]
    for city, country, _ in cities:
        qs.append(Question(f"In which country is {city}?", (country,), 1, "country", city, city, city))

    all_values: dict[str, list[str]] = {
        "city": [c for c, _, _ in cities], "country": countries, "occupation": list(OCCUPATIONS),
        "person": [p["name"] for p in people], "year": sorted({v for d in values.values() for v in d.get("year", [])}),
    }
    return World(passages, qs, values, all_values)


@functools.lru_cache(maxsize=4)
def eval_world(seed: int) -> World:
    """The evaluation world of a run's seed: its passages are the corpus, its questions the splits."""
    return build_world(seed)


def corpus(seed: int) -> list[Passage]:
    return list(eval_world(seed).passages)


# --- splits --------------------------------------------------------------------------------------


def to_task(q: Question, split: str, index: int) -> Task:
    return Task(id=f"gen-{split}-{index}", question=q.text, answer=q.answers[0],
                meta={"group": q.group, "_golden_answers": list(q.answers)})


def generate_splits(sizes: dict[str, int], seed: int) -> dict[str, list[Task]]:
    """Disjoint splits {split: tasks} of the seed's world, TWO_HOP_SHARE of each two-hop; sizes keyed by
    "weight", "harness", "val", "test". Each split takes the next questions of two seeded shuffles."""
    world = eval_world(seed)
    pools = {hops: [q for q in world.questions if q.hops == hops] for hops in (1, 2)}
    for hops, pool in pools.items():
        random.Random(f"whale-search-splits:{seed}:{hops}").shuffle(pool)
    out: dict[str, list[Task]] = {}
    for split in SPLIT_ORDER:
        n = sizes.get(split, 0)
        n2 = round(n * TWO_HOP_SHARE)
        picked = []
        for hops, k in ((1, n - n2), (2, n2)):
            if len(pools[hops]) < k:
                raise DataError(f"the generated world of seed {seed} has {len(pools[hops])} {hops}-hop questions left "
                                f"for D_{split}, which needs {k}; lower data.n_* (the world has {len(world.questions)} "
                                "questions)")
            picked += pools[hops][:k]
            del pools[hops][:k]
        random.Random(f"whale-search-order:{seed}:{split}").shuffle(picked)
        out[split] = [to_task(q, split, i) for i, q in enumerate(picked)]
    return out


# --- the teacher and the warm-start conversations ----------------------------------------------


def search_turn(query: str) -> str:
    return SEARCH_FORMAT.format(query=query)


def information(passages: list[Passage]) -> str:
    return INFORMATION_FORMAT.format(passages=format_passages(passages))


def answer_turn(answer: str, tagged: bool) -> str:
    return (ANSWER_FORMAT if tagged else PLAIN_ANSWER_FORMAT).format(answer=answer)


def _rate(rates: tuple[float, float], system_prompt: str, mention: str) -> float:
    return rates[mention in system_prompt.lower()]


_QUERY = re.compile(r"<search>(.*?)</search>", re.DOTALL)
_TITLE = re.compile(r"Doc \d+\(Title: ([^)\n]*)\)")


def teacher_turn(world: World, messages: list[dict[str, str]], rng: random.Random) -> str:
    """The next assistant message of the warm-start teacher for a chat in h0's layout (system, question,
    then assistant/user turns). The teacher knows the world but reads only what the chat shows it."""
    system, q = messages[0]["content"], world.by_question[messages[1]["content"]]
    searches = [m.group(1).strip() for msg in messages[2:] if msg["role"] == "assistant"
                for m in [_QUERY.search(msg["content"])] if m]
    observations = [msg["content"] for msg in messages[2:] if msg["role"] == "user"]
    seen = {t.strip() for o in observations for t in _TITLE.findall(o)}
    last_seen = [t.strip() for t in _TITLE.findall(observations[-1])] if observations else []
    tagged = rng.random() < _rate(TAGGED_RATE, system, ANSWER_MENTION)

    def wrong_answer() -> str:
        # what a careless reader does: a value of the right kind from the last passages, else a guess
        near = [v for t in last_seen for v in world.values.get(t, {}).get(q.answer_type, []) if v not in q.answers]
        return rng.choice(near) if near else rng.choice(world.all_values[q.answer_type])

    if not searches:
        if rng.random() < _rate(GUESS_RATE, system, ALWAYS_SEARCH_MENTION):
            return answer_turn(rng.choice(world.all_values[q.answer_type]), tagged)
        entity_query = rng.random() < _rate(ENTITY_QUERY_RATE, system, SEARCH_NAME_MENTION)
        return search_turn(q.entity if entity_query else q.text)
    if q.answer_title in seen:
        return answer_turn(q.answers[0], tagged)
    if q.hops == 2 and q.hop1_title in seen:
        if q.bridge not in searches and rng.random() < _rate(CONTINUE_RATE, system, SEARCH_AGAIN_MENTION):
            return search_turn(q.bridge)
        return answer_turn(wrong_answer(), tagged)
    if q.entity not in searches and rng.random() < _rate(RESEARCH_RATE, system, SEARCH_AGAIN_MENTION):
        return search_turn(q.entity)
    return answer_turn(wrong_answer(), tagged)


class WorldSearch:
    """BM25 over a world's passages with a cache (the same queries come back again and again)."""

    def __init__(self, world: World):
        self._bm25 = BM25Retriever(world.passages)
        self._cache: dict[tuple[str, int], list[Passage]] = {}

    def __call__(self, query: str, topk: int) -> list[Passage]:
        key = (query, topk)
        if key not in self._cache:
            self._cache[key] = self._bm25.search([query], topk)[0]
        return self._cache[key]


def simulate(world: World, search: WorldSearch, question: str, system_prompt: str, rng: random.Random, *,
             topk: int, max_turns: int) -> list[dict[str, str]]:
    """The chat of one teacher episode under a harness of h0's shape with `topk` passages, `max_turns` turns."""
    messages = [{"role": "system", "content": system_prompt}, {"role": "user", "content": question}]
    for _ in range(max_turns):
        completion = teacher_turn(world, messages, rng)
        messages.append({"role": "assistant", "content": completion})
        query = _QUERY.search(completion)
        if query is None:
            break
        messages.append({"role": "user", "content": information(search(query.group(1).strip(), topk))})
    if messages[-1]["role"] == "user":  # the budget ended after an observation: end on the model's turn
        messages.pop()
    return messages


def conversation_chars(messages: list[dict[str, str]]) -> int:
    return sum(len(m["content"]) for m in messages)


def warmstart_questions(world_prefix: str, rng: random.Random) -> Iterator[tuple[World, WorldSearch, Question]]:
    """Every question of warm-start world `{world_prefix}0`, then `1`, ..., each world's in an order drawn from
    `rng`, with the world and a search over it; worlds are built as they are reached."""
    for world_index in itertools.count():
        world = build_world(f"{world_prefix}{world_index}", warmstart=True)
        search = WorldSearch(world)
        questions = list(world.questions)
        rng.shuffle(questions)
        for q in questions:
            yield world, search, q


def warmstart_conversations(n: int, seed: int) -> list[list[dict[str, str]]]:
    """`n` teacher conversations over warm-start worlds (never an evaluation world's names)."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = random.Random(f"whale-search-warmstart:{seed}")
    out: list[list[dict[str, str]]] = []
    if n:
        for world, search, q in warmstart_questions(f"{seed}:", rng):
            prompt = draw_system_prompt(rng)
            topk = rng.choices(list(WARMSTART_TOPK), weights=list(WARMSTART_TOPK.values()))[0]
            chat = simulate(world, search, q.text, prompt, rng, topk=topk, max_turns=WARMSTART_MAX_TURNS)
            if conversation_chars(chat) > MAX_CONVERSATION_CHARS:
                chat = simulate(world, search, q.text, prompt, rng, topk=1, max_turns=WARMSTART_MAX_TURNS)
            if conversation_chars(chat) <= MAX_CONVERSATION_CHARS:
                out.append(chat)
                if len(out) == n:
                    break
    return out
