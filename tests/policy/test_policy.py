"""The embedded tiny policy (build, cache, tokenizer, chat template) and the transformers engine.

Everything here builds its own small checkpoint (60 warm-start steps on a stand-in arithmetic corpus) in a
temporary directory, so the tests never read or write the user's cache. The engines run on CPU unless
WHALE_TEST_DEVICE names another device (e.g. cuda).
"""

from __future__ import annotations

import dataclasses
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from whale_ray.domain import Domain
from whale_ray.policy import tiny
from whale_ray.policy.checkpoint import CheckpointError, load_policy
from whale_ray.policy.engine import GenerationRequest, StopMatcher, check_request, decode_completion, sample_rows
from whale_ray.policy.engine_registry import make_engine
from whale_ray.policy.tiny import build_embedded_policy, read_build_info
from whale_ray.policy.transformers_engine import TransformersEngine
from whale_ray.records import SamplingParams

SYSTEM = "Solve the problem. Give the final answer as \\boxed{N}."
STEPS = 60
DEVICE = os.environ.get("WHALE_TEST_DEVICE", "cpu")


class StandInDomain(Domain):
    """Arithmetic conversations in the shape of a math domain: direct answers, and one tool round-trip."""

    name = "standin"
    folder = Path(".")

    def load_splits(self, data, seed):  # pragma: no cover - not used here
        raise NotImplementedError

    def verify(self, task, response):  # pragma: no cover - not used here
        return 0.0

    def warmstart_conversations(self, n, seed):
        rng = random.Random(seed)
        out = []
        for _ in range(n):
            a, b, op = rng.randint(0, 99), rng.randint(0, 99), rng.choice("+-*")
            val = eval(f"{a}{op}{b}")
            q = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"What is {a} {op} {b}?"}]
            if rng.random() < 0.5:
                out.append(q + [{"role": "assistant", "content": f"{a} {op} {b} = {val}.\n\\boxed{{{val}}}"}])
            else:
                out.append(q + [
                    {"role": "assistant", "content": f"```python\nprint({a} {op} {b})\n```"},
                    {"role": "tool", "content": f"{val}\n"},
                    {"role": "assistant", "content": f"The result is {val}.\n\\boxed{{{val}}}"},
                ])
        return out


def ask(q: str, **sampling) -> GenerationRequest:
    return GenerationRequest(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}], SamplingParams(**sampling)
    )


@pytest.fixture(scope="session")
def built(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    t0 = time.perf_counter()
    path = build_embedded_policy(StandInDomain(), cache_dir=cache, warmstart_steps=STEPS, seed=0, progress=False)
    return path, cache, time.perf_counter() - t0


@pytest.fixture(scope="session")
def engine(built):
    return TransformersEngine(built[0], device=DEVICE, max_batch=64, seed=0)


@pytest.fixture()
def counted(engine):
    calls = []
    handle = engine.model.register_forward_hook(lambda *a: calls.append(1))
    yield engine, calls
    handle.remove()


# -- the build ----------------------------------------------------------------------------------------------


def test_build_is_cached_and_loadable(built):
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3ForCausalLM

    path, cache, first_s = built
    weights = (path / "model.safetensors").stat()
    again = build_embedded_policy(StandInDomain(), cache_dir=cache, warmstart_steps=STEPS, seed=0, progress=False)
    assert again == path and (path / "model.safetensors").stat() == weights  # served from the cache, not rebuilt
    assert path.name.startswith("tiny-standin-") and not list(cache.glob(".*.tmp-*"))

    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    assert isinstance(model, Qwen3ForCausalLM) and model.config.tie_word_embeddings
    assert 300_000 < sum(p.numel() for p in model.parameters()) < 3_000_000
    assert (path / "model.safetensors").is_file() and (path / "generation_config.json").is_file()
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert model.generation_config.eos_token_id == [tok.convert_tokens_to_ids("<|im_end|>"), tok.pad_token_id]
    assert model.config.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    info = read_build_info(path)
    assert info["steps"] == STEPS and info["loss_end"] < info["loss_start"]
    assert info["key"]["domain"] == "standin" and info["key"]["seed"] == 0


def test_build_key_depends_on_steps_seed_and_data(tmp_path):
    class Changed(StandInDomain):
        def warmstart_conversations(self, n, seed):
            return [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}] for _ in range(n)]

    a = build_embedded_policy(StandInDomain(), cache_dir=tmp_path, warmstart_steps=0, progress=False)
    assert build_embedded_policy(StandInDomain(), cache_dir=tmp_path, warmstart_steps=0, seed=1, progress=False) != a
    assert build_embedded_policy(StandInDomain(), cache_dir=tmp_path, warmstart_steps=1, progress=False) != a
    assert build_embedded_policy(Changed(), cache_dir=tmp_path, warmstart_steps=0, progress=False) != a


def build_in_subprocess(cache: Path) -> tuple[subprocess.Popen, threading.Event]:
    """A long build of the stand-in policy in its own process, and an event set once its warm-start is training
    (tqdm's bar on stderr)."""
    # Ctrl-C's default handler, even where this test runs in the background (whose children start with SIGINT ignored)
    code = ("import signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
            "from tests.policy.test_policy import StandInDomain; from whale_ray.policy import tiny; from whale_ray.policy.tiny import build_embedded_policy; "
            f"build_embedded_policy(StandInDomain(), cache_dir={str(cache)!r}, warmstart_steps=100_000, "
            "config=tiny.TinyConfig(max_conversations=400, tokenizer_conversations=400))")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    training = threading.Event()

    def watch() -> None:
        for chunk in iter(lambda: proc.stderr.read(64), b""):
            if b"it/s" in chunk or b"s/it" in chunk:
                training.set()

    threading.Thread(target=watch, daemon=True).start()
    return proc, training


def test_build_is_atomic(tmp_path):
    stale = tmp_path / ".tiny-standin-0000.tmp-old"  # what a killed build of another key leaves: not ours
    stale.mkdir()
    # interrupted mid-training (Ctrl-C): nothing of it is left
    proc, training = build_in_subprocess(tmp_path)
    while not training.wait(0.1):
        assert proc.poll() is None, "the build ended before it trained"
    proc.send_signal(signal.SIGINT)
    assert proc.wait() != 0
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("tiny-")]  # no half cache
    assert [p.name for p in tmp_path.glob(".*.tmp-*")] == [stale.name]
    # SIGKILLed mid-training: no half cache under the final name either, only its build dir (swept below)
    proc, training = build_in_subprocess(tmp_path)
    while not training.wait(0.1):
        assert proc.poll() is None, "the build ended before it trained"
    proc.kill()
    proc.wait()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("tiny-")]

    # a build dir left by a SIGKILLed build of the same key is swept by the next build
    path = build_embedded_policy(StandInDomain(), cache_dir=tmp_path, warmstart_steps=0, progress=False)
    (tmp_path / f".{path.name}.tmp-dead").mkdir()
    import shutil

    shutil.rmtree(path)
    assert build_embedded_policy(StandInDomain(), cache_dir=tmp_path, warmstart_steps=0, progress=False) == path
    assert not (tmp_path / f".{path.name}.tmp-dead").exists() and (path / "config.json").is_file()


def test_bad_warmstart_data_is_refused(tmp_path):
    class Broken(StandInDomain):
        def warmstart_conversations(self, n, seed):
            return [[{"role": "user", "content": "no answer here"}]] * n

    with pytest.raises(ValueError, match="needs at least one assistant turn"):
        build_embedded_policy(Broken(), cache_dir=tmp_path, warmstart_steps=0, progress=False)
    with pytest.raises(ValueError, match="warmstart_steps"):
        build_embedded_policy(StandInDomain(), cache_dir=tmp_path, warmstart_steps=-1, progress=False)


# -- tokenizer and chat template -------------------------------------------------------------------------------


def test_tokenizer_round_trips_any_text(engine):
    tok = engine.tokenizer
    for text in ["héllo wörld — 你好, мир! 🐋🧪 ∑x² ≠ ∞", "  tabs\tand\n\nnewlines  ", "Ünïcödé ß ﬁ \u200b\x00",
                 "never seen: Zygote quantum ×÷ 3.14159e-7", "", "<b>&amp;</b> \\boxed{42}"]:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids, clean_up_tokenization_spaces=False) == text
    assert len(tok("12345", add_special_tokens=False)["input_ids"]) == 5  # digits one by one
    assert 256 < len(tok) <= 1024
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert tok("a<|im_end|>", add_special_tokens=False)["input_ids"][-1] == im_end


def test_chat_template_prefix_property(engine):
    tok = engine.tokenizer
    convs = StandInDomain().warmstart_conversations(30, seed=5)
    convs.append([{"role": "user", "content": "x"}, {"role": "assistant", "content": " leading space\n"},
                  {"role": "user", "content": "y"}, {"role": "assistant", "content": "ünï 12"}])
    checked = 0
    for conv in convs:
        for i, m in enumerate(conv):
            if m["role"] != "assistant":
                continue
            prompt = tok.apply_chat_template(conv[:i], tokenize=False, add_generation_prompt=True)
            assert prompt == tiny._render_chat(conv[:i], True) and prompt.endswith("<|im_start|>assistant\n")
            full = tok.apply_chat_template(conv[: i + 1], tokenize=False)
            assert full == prompt + m["content"] + "<|im_end|>\n"
            p_ids = tok(prompt, add_special_tokens=False)["input_ids"]
            t_ids = tok(m["content"] + "<|im_end|>", add_special_tokens=False)["input_ids"]
            full_ids = tok(full, add_special_tokens=False)["input_ids"]
            assert full_ids[: len(p_ids) + len(t_ids)] == p_ids + t_ids
            checked += 1
    assert checked > 40

    # the SFT sequences: every target span continues exactly the inference-time prompt of its turn
    examples, dropped = tiny.encode_sft_examples(tok, convs, max_len=512)
    assert dropped == 0 and len(examples) == len(convs)  # turns of a conversation share one sequence
    for (ids, labels), conv in zip(examples, convs):
        turns = [i for i, m in enumerate(conv) if m["role"] == "assistant"]
        starts = [j for j in range(len(labels)) if labels[j] != -100 and (j == 0 or labels[j - 1] == -100)]
        assert len(starts) == len(turns)
        for start, i in zip(starts, turns):
            p_ids = tok(tiny._render_chat(conv[:i], True), add_special_tokens=False)["input_ids"]
            t_ids = tok(conv[i]["content"] + "<|im_end|>", add_special_tokens=False)["input_ids"]
            assert ids[:start] == p_ids and ids[start : start + len(t_ids)] == t_ids == labels[start : start + len(t_ids)]
        assert labels[-1] == tok.convert_tokens_to_ids("<|im_end|>")
        assert all(labels[j] in (-100, ids[j]) for j in range(len(ids)))


# -- the engine ------------------------------------------------------------------------------------------------


def test_one_forward_per_decode_step(counted):
    engine, calls = counted
    reqs = [ask(f"What is {i} + {i + 7}?", max_tokens=12, temperature=1.0, seed=i) for i in range(9)]
    outs = engine.generate(reqs)
    assert len(outs) == 9
    assert len(calls) == max(len(o.completion_ids) for o in outs) <= 12
    for o in outs:
        assert len(o.logprobs) == len(o.completion_ids) > 0 and o.finish_reason in ("stop", "length")
        assert all(lp <= 0 for lp in o.logprobs)


def test_chunks_beyond_max_batch(built):
    small = TransformersEngine(built[0], device=DEVICE, max_batch=4)
    calls = []
    small.model.register_forward_hook(lambda m, a, kw, out: calls.append(kw["input_ids"].shape[0]), with_kwargs=True)
    reqs = [ask(f"What is {i} * 3?", max_tokens=3, seed=i) for i in range(10)]
    outs = small.generate(reqs)
    assert len(outs) == 10 and len(calls) <= 3 * 3  # three groups of <= 3 steps
    assert max(calls) == 4  # max_batch bounds the running batch, prefills and decode steps alike
    assert [o.completion_ids for o in outs] == [small.generate([r])[0].completion_ids for r in reqs]


def _teacher_forced(engine, out, temperature, top_k, top_p):
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    ids = torch.tensor([out.prompt_ids + out.completion_ids], device=engine.device)
    with torch.no_grad():
        logits = engine.model(input_ids=ids).logits[0, len(out.prompt_ids) - 1 : -1].float()
    if temperature > 0:
        logits = TemperatureLogitsWarper(temperature)(None, logits)
        if top_k > 0:
            logits = TopKLogitsWarper(top_k)(None, logits)
        if top_p < 1:
            logits = TopPLogitsWarper(top_p)(None, logits)
    logp = logits.log_softmax(-1)
    return logp.gather(1, torch.tensor(out.completion_ids, device=engine.device)[:, None]).squeeze(1).cpu()


def test_logprobs_match_teacher_forcing(engine):
    settings = [(1.0, 20, 1.0), (0.7, 0, 0.9), (1.3, 5, 0.8), (0.0, 20, 1.0), (1.0, 0, 1.0)]
    reqs = [ask(f"What is {3 * i} - {i}?" + " Please." * i, max_tokens=24, temperature=t, top_k=k, top_p=p, seed=i)
            for i, (t, k, p) in enumerate(settings)]
    outs = engine.generate(reqs)
    for out, (t, k, p) in zip(outs, settings):
        ref = _teacher_forced(engine, out, t, k, p)
        assert torch.isfinite(ref).all()  # every sampled token was allowed by top-k / top-p
        assert torch.allclose(torch.tensor(out.logprobs), ref, atol=1e-4), (t, k, p)


def test_eos_is_kept_and_stop(engine):
    outs = engine.generate([ask(f"What is {i} + 5?", max_tokens=64, temperature=0.0) for i in range(6)])
    stopped = [o for o in outs if o.finish_reason == "stop"]
    assert stopped, [o.text for o in outs]
    eos = engine.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert eos in engine.eos_ids
    for o in stopped:
        assert o.completion_ids[-1] in engine.eos_ids and not set(engine.eos_ids) & set(o.completion_ids[:-1])
        assert "<|im_end|>" not in o.text and "<|endoftext|>" not in o.text
        assert o.text == engine.tokenizer.decode(o.completion_ids, skip_special_tokens=True)
    prompt = engine.tokenizer.apply_chat_template(ask("What is 0 + 5?").messages, tokenize=False, add_generation_prompt=True)
    assert outs[0].prompt_ids == engine.tokenizer(prompt, add_special_tokens=False)["input_ids"]


def test_max_tokens_gives_length(engine):
    outs = engine.generate([ask("What is 12 + 30?", max_tokens=2, seed=s) for s in range(4)])
    for o in outs:
        assert len(o.completion_ids) == 2 and o.finish_reason == "length"


def test_per_request_max_tokens_in_one_batch(counted):
    engine, calls = counted
    budgets = [1, 4, 9, 16, 2]
    outs = engine.generate([ask(f"What is {b} * 7?", max_tokens=b, temperature=1.0, seed=b) for b in budgets])
    for b, o in zip(budgets, outs):
        assert len(o.completion_ids) <= b
        assert (o.finish_reason == "length") == (len(o.completion_ids) == b and o.completion_ids[-1] not in engine.eos_ids)
    assert len(calls) == max(len(o.completion_ids) for o in outs)


def test_stop_strings(engine):
    base = engine.generate([ask(f"What is {i} + 8?", max_tokens=40, temperature=0.0) for i in range(4)])
    reqs, expect = [], []
    for i, b in enumerate(base):
        text = b.text
        assert len(text) >= 6, text
        stop = text[3:5]
        reqs.append(ask(f"What is {i} + 8?", max_tokens=40, temperature=0.0, stop=("@@never@@", stop)))
        expect.append((b, stop))
    outs = engine.generate(reqs)
    tok = engine.tokenizer
    for o, (b, stop) in zip(outs, expect):
        assert o.finish_reason == "stop"
        assert o.text == b.text[: b.text.find(stop)]
        ids = o.completion_ids
        assert ids == b.completion_ids[: len(ids)]  # same path, cut early
        assert stop in tok.decode(ids, skip_special_tokens=True)  # the last token completes the stop string
        assert stop not in tok.decode(ids[:-1], skip_special_tokens=True)
        assert len(o.logprobs) == len(ids)
    # a stop string completed by the last token the budget allows still counts as a stop
    b, stop = expect[0]
    n = len(outs[0].completion_ids)
    at_budget = engine.generate([ask("What is 0 + 8?", max_tokens=n, temperature=0.0, stop=(stop,))])[0]
    assert at_budget.finish_reason == "stop" and at_budget.text == outs[0].text


def _first_stop_by_full_decodes(tok, ids, stops):
    """The rule StopMatcher must reproduce: decode the whole completion after every token."""
    for k in range(1, len(ids) + 1):
        text = decode_completion(tok, ids[:k])
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            return k, text[: min(hits)]
    return None


def _as_the_vllm_engine_matches(tok, ids, stops):
    """StopMatcher driven the way VLLMEngine drives it: `maybe` then `find` per token, `find` once at the end."""
    m = StopMatcher(tok, stops)
    for k in range(1, len(ids) + 1):
        if m.maybe(ids[:k]) and (hit := m.find(ids[:k])):
            return hit
    return m.find(ids)


@settings(max_examples=150, deadline=None)
@given(text=st.text(alphabet=st.sampled_from("ab cé€🐋\n<|>") | st.characters(codec="utf-8"), max_size=60),
       specials=st.lists(st.integers(0, 30), max_size=4), a=st.integers(0, 60), width=st.integers(1, 6),
       extra=st.text(max_size=4))
def test_stop_matcher_cuts_where_full_decodes_cut(engine, text, specials, a, width, extra):
    tok = engine.tokenizer
    ids = tok(text, add_special_tokens=False)["input_ids"]
    for pos in specials:  # special tokens print nothing: a stop string can span them
        ids.insert(min(pos, len(ids)), tok.all_special_ids[pos % len(tok.all_special_ids)])
    assert decode_completion(tok, ids) == tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    stops = tuple(s for s in (text[a : a + width], extra) if s)
    if stops:
        assert _as_the_vllm_engine_matches(tok, ids, stops) == _first_stop_by_full_decodes(tok, ids, stops)


def test_stop_matcher_finds_a_stop_longer_than_its_tail(engine):
    tok = engine.tokenizer
    pad = tok.all_special_ids[0]
    x, y = (tok(c, add_special_tokens=False)["input_ids"] for c in ("x", "y"))
    ids = x + [pad] * 40 + y + tok(" and more text after it", add_special_tokens=False)["input_ids"]
    m = StopMatcher(tok, ("xy",))
    assert m.tail < 40 and not any(m.maybe(ids[:k]) for k in range(1, len(ids) + 1))  # the tail never sees it
    assert m.find(ids) == _first_stop_by_full_decodes(tok, ids, ("xy",)) == (len(x) + 40 + len(y), "")


def test_seeded_requests_are_deterministic(built, engine):
    req = ask("What is 41 + 17?", max_tokens=20, temperature=1.0, top_k=0, seed=123)
    a = engine.generate([req])[0]
    b = engine.generate([req])[0]
    assert a == b
    # the same request in a batch with other (longer, left-padded) prompts samples the same tokens
    mixed = engine.generate([ask("What is 5 * 5? " + "Think. " * 9, max_tokens=30, seed=1), req, ask("Hi", max_tokens=3)])
    assert mixed[1].completion_ids == a.completion_ids
    assert torch.allclose(torch.tensor(mixed[1].logprobs), torch.tensor(a.logprobs), atol=1e-4)
    # unseeded requests draw from the engine's seed: reproducible across engines, varied across calls
    unseeded = [ask("What is 41 + 17?", max_tokens=20, top_k=0) for _ in range(4)]
    e1, e2 = (TransformersEngine(built[0], device=DEVICE, seed=7) for _ in range(2))
    first = [o.completion_ids for o in e1.generate(unseeded)]
    assert first == [o.completion_ids for o in e2.generate(unseeded)]
    assert len({tuple(c) for c in first + [o.completion_ids for o in e1.generate(unseeded)]}) > 1


def test_load_weights_changes_version_and_outputs(built):
    eng = TransformersEngine(built[0], device=DEVICE)
    assert eng.version == 0
    req = ask("What is 6 + 7?", max_tokens=10, temperature=0.0)
    before = eng.generate([req])[0]
    original = eng.state_dict()
    assert all(v.device.type == "cpu" for v in original.values())
    zeros = {k: torch.zeros_like(v) for k, v in original.items()}
    eng.load_weights(zeros, version=1)
    assert eng.version == 1
    assert original["model.embed_tokens.weight"].abs().sum() > 0  # the snapshot was a copy
    after = eng.generate([req])[0]
    assert after.completion_ids != before.completion_ids
    no_head = {k: v for k, v in original.items() if k != "lm_head.weight"}  # tied: may be left out
    eng.load_weights(no_head, version=2)
    again = eng.generate([req])[0]
    assert eng.version == again.weight_version == 2 and dataclasses.replace(again, weight_version=0) == before

    with pytest.raises(ValueError, match="not in the model"):
        eng.load_weights({**original, "bogus.weight": torch.zeros(1)}, version=3)
    with pytest.raises(ValueError, match="shape mismatch"):
        eng.load_weights({**original, "model.norm.weight": torch.zeros(3)}, version=3)
    with pytest.raises(ValueError, match="missing keys"):
        eng.load_weights({k: v for k, v in original.items() if k != "model.norm.weight"}, version=3)
    assert eng.version == 2 and eng.generate([req])[0] == again  # refused loads changed nothing


def test_load_weights_waits_for_generate(built):
    eng = TransformersEngine(built[0], device=DEVICE)
    zeros = {k: torch.zeros_like(v) for k, v in eng.state_dict().items()}
    req = ask("What is 1 + 1?", max_tokens=30, temperature=0.0)
    reference = eng.generate([req])[0]
    results = []
    t = threading.Thread(target=lambda: results.append(eng.generate([req] * 16)))
    t.start()
    time.sleep(0.005)
    eng.load_weights(zeros, version=5)
    t.join()
    # a generate runs on one set of weights from start to end: all rows agree with one of the two versions
    zeroed = eng.generate([req])[0]
    ids = [o.completion_ids for o in results[0]]
    assert ids in ([reference.completion_ids] * 16, [zeroed.completion_ids] * 16)
    assert zeroed.completion_ids != reference.completion_ids
    assert eng.version == 5


def test_load_weights_mid_batch_cannot_relabel_it(built):
    """A load_weights that lands while a batch runs: the batch finishes on the old weights and says so, even
    when the load completes before the server has handled the batch's result (the event loop is held until
    the new version is in, the window where reading engine.version after generate used to relabel calls)."""
    import asyncio

    from whale_ray.policy.serving import PolicyService

    service = PolicyService(str(built[0]), max_batch=16, batch_wait_ms=20, device=DEVICE)
    eng = service.engine
    zeros = {k: torch.zeros_like(v) for k, v in eng.state_dict().items()}
    reqs = [ask(f"What is {i} + {2 * i}?" + " Hm." * i, max_tokens=4 + 3 * i, temperature=1.0, seed=100 + i)
            for i in range(6)]
    old = [eng.generate([r])[0] for r in reqs]

    async def mid_batch_load():
        loop = asyncio.get_running_loop()
        loader: list[threading.Thread] = []

        def hold_loop_until_loaded():
            deadline = time.monotonic() + 120
            while eng.version != 7 and time.monotonic() < deadline:
                time.sleep(0.001)

        def on_forward(*_):
            if not loader:  # the batch's first forward: the load waits on the engine lock, then lands
                loader.append(threading.Thread(target=eng.load_weights, args=(zeros, 7)))
                loader[0].start()
                loop.call_soon_threadsafe(hold_loop_until_loaded)

        handle = eng.model.register_forward_hook(on_forward)
        try:
            calls = await asyncio.gather(*(service.generate(r.messages, r.sampling) for r in reqs))
        finally:
            handle.remove()
        loader[0].join()
        after = await service.generate(reqs[0].messages, reqs[0].sampling)
        return calls, after

    calls, after = asyncio.run(mid_batch_load())
    assert eng.version == 7
    # each call names the weights that generated it: those admitted before the load finished on the old
    # weights (the first one at least: the load started at its first forward); any that came after waited
    zeroed = eng.generate(reqs)
    assert calls[0].weight_version == 0
    for call, req, ref, new in zip(calls, reqs, old, zeroed):
        assert call.weight_version in (0, 7) and call.messages is req.messages and call.prompt_ids == ref.prompt_ids
        assert call.completion_ids == (ref if call.weight_version == 0 else new).completion_ids
    assert after.weight_version == 7 and after.completion_ids == zeroed[0].completion_ids != old[0].completion_ids


def test_callers_coming_back_one_by_one_share_one_pass(built):
    """Twelve callers whose replies reach them one after another (1 ms apart, as an HTTP endpoint's do) come
    back as one batch: the batcher waits for the last pass's size (at most half a pass) rather than starting
    a pass with the first ones in its 8 ms window and leaving the rest a whole pass behind."""
    import asyncio

    from whale_ray.policy.serving import PolicyService

    service = PolicyService(str(built[0]), max_batch=16, batch_wait_ms=8, device=DEVICE, batching="pass")
    reqs = [ask(f"What is {i} + 3?", max_tokens=48, temperature=1.0, seed=i) for i in range(12)]

    async def caller(i: int) -> None:
        for _ in range(4):
            await service.generate(reqs[i].messages, reqs[i].sampling)
            await asyncio.sleep(0.001 * i)  # the i-th reply arrives i ms after the pass

    async def callers() -> None:
        await asyncio.gather(*(caller(i) for i in range(12)))
    asyncio.run(callers())
    stats = service.batcher.stats
    assert list(stats.sizes) == [12] * 4, (list(stats.sizes), stats.busy_s)


# -- continuous batching ---------------------------------------------------------------------------------


def _forwards(eng):
    """The (rows, input width) of each forward pass, recorded from the engine's thread."""
    seen: list[tuple[int, int]] = []
    handle = eng.model.register_forward_hook(lambda m, a, kw, out: seen.append(tuple(kw["input_ids"].shape)),
                                             with_kwargs=True)
    return seen, handle


def _wait_for(cond, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.001)


def test_requests_join_a_running_batch(built):
    """Requests submitted while others decode join them at the next step (one prefill of the newcomers, then
    decode steps over everyone), each resolves as it finishes, and a seeded request samples the same tokens,
    log-probs (to float rounding: see below), top log-probs and streamed tokens as when it runs alone."""
    eng = TransformersEngine(built[0], device=DEVICE, max_batch=16)
    seeded = ask("What is 41 + 17?", max_tokens=20, temperature=1.0, top_k=0, seed=123, top_logprobs=3)
    greedy = ask("What is 6 + 7?", max_tokens=24, temperature=0.0)
    t0 = time.perf_counter()
    alone = [eng.generate([r])[0] for r in (seeded, greedy)]
    seen, handle = _forwards(eng)
    long = eng.submit_many([ask("What is 5 * 5? " + "Think. " * i, max_tokens=60, temperature=1.0, seed=i)
                            for i in range(5)])
    _wait_for(lambda: len(seen) >= 3, "the long requests' third step")
    streamed: list[tuple[int, int]] = []
    joiners = [dataclasses.replace(seeded, on_token=lambda t, v: streamed.append((t, v))), greedy]
    joined = [f.result() for f in eng.submit_many(joiners)]
    running_when_done = sum(not f.done() for f in long)
    [f.result() for f in long]
    handle.remove()
    prefills = [i for i, (rows, width) in enumerate(seen) if width > 1]
    assert len(prefills) == 2 and seen[prefills[1]][0] == 2  # the long ones' prefill, then the two joiners'
    assert any(rows > 2 for rows, _ in seen[prefills[1] + 1:])  # ... who then decode together with the rest
    for a, j in zip(alone, joined):
        assert j.completion_ids == a.completion_ids and j.prompt_ids == a.prompt_ids
        assert (j.finish_reason, j.text, j.weight_version) == (a.finish_reason, a.text, a.weight_version)
        # float32 on CPU: the same row computed in a batch of another shape (more rows, more padding columns)
        # comes out within rounding, not bit for bit
        assert torch.allclose(torch.tensor(j.logprobs), torch.tensor(a.logprobs), atol=1e-5)
    assert [[i for i, _ in alts] for alts in joined[0].top_logprobs] == [[i for i, _ in alts] for alts in alone[0].top_logprobs]
    assert len(joined[0].top_logprobs) == len(joined[0].completion_ids) and not joined[1].top_logprobs
    assert streamed == [(t, 0) for t in joined[0].completion_ids]
    # every request's time in the engine is counted once it finishes: from reaching it to joining a batch, to its end
    timing, elapsed = eng.timing, time.perf_counter() - t0
    assert timing["finished"] == 9 and 0 <= timing["wait_s"] < timing["latency_s"] <= 9 * elapsed, timing
    print(f"long requests still running when the joiners were done: {running_when_done} of 5")


def test_load_weights_with_requests_in_flight(built):
    """The requests in flight finish on the old weights and say so; a request that arrives while the load waits
    for them waits too, and runs on the new weights."""
    eng = TransformersEngine(built[0], device=DEVICE, max_batch=16)
    zeros = {k: torch.zeros_like(v) for k, v in eng.state_dict().items()}
    reqs = [ask(f"What is {i} + 9?", max_tokens=16, temperature=0.0) for i in range(4)]
    late = ask("What is 2 + 2?", max_tokens=8, temperature=0.0)
    old = eng.generate(reqs)
    started, go = threading.Event(), threading.Event()

    def hold(*_):
        started.set()
        go.wait(120)
    handle = eng.model.register_forward_hook(hold)
    in_flight = eng.submit_many(reqs)
    assert started.wait(120)  # the engine is in the batch's first forward, held there until `go`
    loader = threading.Thread(target=eng.load_weights, args=(zeros, 3))
    loader.start()
    _wait_for(lambda: not eng._commands.empty(), "the load to be queued")
    waiting = eng.submit(late)
    go.set()
    outs = [f.result() for f in in_flight]
    loader.join()
    handle.remove()
    assert [(o.completion_ids, o.weight_version) for o in outs] == [(o.completion_ids, 0) for o in old]
    after = waiting.result()
    assert eng.version == after.weight_version == 3
    assert after.completion_ids == eng.generate([late])[0].completion_ids


def test_a_bad_request_or_a_failed_step_fails_alone(built):
    eng = TransformersEngine(built[0], device=DEVICE, max_batch=8)
    good = ask("What is 3 + 3?", max_tokens=10, temperature=0.0)
    ref = eng.generate([good])[0]
    with pytest.raises(ValueError, match="max_tokens"):  # refused at once; the others of the call are not sent
        eng.submit_many([good, ask("q", max_tokens=0)])
    # an engine error mid-generation fails the requests then live, and the engine goes on serving
    fail = [True]

    def boom(*_):
        if fail[0] and len(eng._batch.rows) >= 2:
            fail[0] = False
            raise RuntimeError("injected")
    handle = eng.model.register_forward_hook(boom)
    live = eng.submit_many([good, ask("What is 1 + 2?", max_tokens=10)])
    for f in live:
        with pytest.raises(RuntimeError, match="generation failed: RuntimeError: injected"):
            f.result()
    handle.remove()
    assert eng.generate([good])[0] == ref
    eng.close()
    with pytest.raises(RuntimeError, match="closed"):
        eng.submit(good)


def test_prompt_longer_than_context(engine):
    out = engine.generate([ask("1 " * 600, max_tokens=5), ask("What is 2 + 2?", max_tokens=3, seed=0)])
    assert out[0].completion_ids == [] and out[0].finish_reason == "length" and len(out[0].prompt_ids) >= 512
    assert len(out[1].completion_ids) > 0


def test_a_request_carrying_its_prompt_ids_runs_on_them(engine):
    """The endpoint's replica hands the engine the ids it counted: the engine runs on them as given (the messages are
    not tokenised again), and the output is that of the same prompt tokenised by the engine."""
    from whale_ray.policy.engine import encode_prompts

    plain = ask("What is 2 + 3?", max_tokens=8, temperature=0)
    ids = encode_prompts(engine.tokenizer, [plain])[0]
    carried = dataclasses.replace(ask("something else entirely", max_tokens=8, temperature=0), prompt_ids=list(ids))
    a, b = engine.generate([plain, carried])
    assert b.prompt_ids == a.prompt_ids == ids and b.completion_ids == a.completion_ids and b.text == a.text
    for bad in ([], [1, -2], "12", [1.5]):
        with pytest.raises(ValueError, match="prompt_ids must be a non-empty list of token ids"):
            engine.generate([dataclasses.replace(plain, prompt_ids=bad)])


def test_bad_requests_are_refused(engine):
    for sampling, msg in [({"max_tokens": 0}, "max_tokens"), ({"temperature": -1}, "temperature"),
                          ({"top_p": 0}, "top_p"), ({"top_k": -2}, "top_k"), ({"stop": "x"}, "stop"),
                          ({"seed": 1.5}, "seed")]:
        with pytest.raises(ValueError, match=msg):
            check_request(ask("q", **sampling))
    with pytest.raises(ValueError, match="messages"):
        engine.generate([GenerationRequest([], SamplingParams())])
    with pytest.raises(ValueError, match="content"):
        check_request(GenerationRequest([{"role": "user"}]))
    assert engine.generate([]) == []
    # harmless oddities are served, not refused: one request must not fail a whole batch
    odd = engine.generate([ask("q", max_tokens=3, stop=("",), seed=1), ask("q", max_tokens=3, temperature=float("inf"))])
    assert len(odd[0].completion_ids) == 3 and all(len(o.logprobs) == len(o.completion_ids) for o in odd)


def test_sample_rows_respects_top_k_and_greedy():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]] * 3)
    tok, lp = sample_rows(
        logits, torch.tensor([0.0, 1.0, 1.0]), torch.tensor([0, 1, 2]), torch.tensor([1.0, 1.0, 1.0]),
        torch.tensor([0.99, 0.99, 0.999]),
    )
    assert tok.tolist() == [1, 1, 3]
    assert abs(lp[0] - torch.log_softmax(logits[0], -1)[1]) < 1e-6 and abs(lp[1]) < 1e-6


SETTINGS = [(1.0, 0, 1.0), (0.6, 0, 1.0), (1.7, 3, 1.0), (1.0, 0, 0.7), (0.8, 5, 0.85), (2.5, 0, 0.6)]


def test_sample_rows_frequencies_match_the_warped_distribution():
    """Counts of sampled tokens against Hugging Face's warpers (an independent implementation), every setting
    a block of rows of one call. Seeded uniforms: the result is fixed; the p-value floor (1e-6) leaves room
    for a changed random stream yet fails a sampler that is wrong by a percent of probability mass."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    logits = torch.tensor([0.5, -1.0, 2.0, 0.0, 1.2, -2.5, 0.9, -0.3, 1.9, -0.8])  # unsorted, one near-tie
    n = 30_000
    rows = len(SETTINGS) * n
    col = lambda i: torch.tensor([s[i] for s in SETTINGS]).repeat_interleave(n)  # noqa: E731
    u = torch.rand(rows, generator=torch.Generator().manual_seed(1234))
    tok, lp = sample_rows(logits.repeat(rows, 1), col(0).float(), col(1).long(), col(2).float(), u)
    for b, (t, k, p) in enumerate(SETTINGS):
        warped = TemperatureLogitsWarper(t)(None, logits[None].clone())
        if k:
            warped = TopKLogitsWarper(k)(None, warped)
        if p < 1:
            warped = TopPLogitsWarper(p)(None, warped)
        probs = warped.softmax(-1)[0]
        got, got_lp = tok[b * n : (b + 1) * n], lp[b * n : (b + 1) * n]
        # each sample's log-prob is its token's log-prob under the distribution it was drawn from
        assert torch.allclose(got_lp.exp(), probs[got], atol=1e-6), (t, k, p)
        counts = torch.bincount(got, minlength=len(logits)).double()
        kept = probs > 0
        assert counts[~kept].sum() == 0, (t, k, p)  # nothing outside top-k / top-p is ever drawn
        expected = n * probs[kept].double()
        chi2 = ((counts[kept] - expected) ** 2 / expected).sum()
        dof = int(kept.sum()) - 1
        p_value = torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), chi2 / 2)  # chi-square tail
        assert p_value > 1e-6, (t, k, p, float(chi2), dof)


def test_make_engine(built):
    assert make_engine("transformers", built[0], device=DEVICE).version == 0
    with pytest.raises(ValueError, match="unknown engine 'tgi'; choose one of transformers, vllm"):
        make_engine("tgi", built[0])
    try:
        import vllm  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="vllm"):
            make_engine("vllm", built[0])


# -- load_policy -------------------------------------------------------------------------------------------------


def test_load_policy_bad_paths(tmp_path, built):
    missing = tmp_path / "nope"
    with pytest.raises(CheckpointError, match=f"{missing}.*no such directory"):
        load_policy(missing)
    a_file = tmp_path / "model.bin"
    a_file.write_text("x")
    with pytest.raises(CheckpointError, match=f"{a_file}.*not a directory"):
        load_policy(a_file)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match=f"{empty}.*no config.json"):
        load_policy(empty)
    (empty / "config.json").write_text((built[0] / "config.json").read_text())
    with pytest.raises(CheckpointError, match=f"{empty}.*no tokenizer files"):
        load_policy(empty)
    with pytest.raises(CheckpointError, match=f"{empty}"):
        TransformersEngine(empty)
    model, tok = load_policy(built[0])
    assert not model.training and tok.chat_template


def test_shared_weights_refuse_what_they_cannot_serve():
    """weight_sync cuda_ipc's bad inputs, on any machine: a state dict not on one CUDA device, shared weights of
    another version, and ones on a GPU this process cannot see (`Unreachable`: the sync sends them another way)."""
    from whale_ray.policy.cuda_ipc import SharedWeights, Sharer, Unreachable, materialize

    with pytest.raises(ValueError, match=r"one CUDA device, got \['cpu'\]"):
        Sharer().share({"model.norm.weight": torch.zeros(4)}, 1)
    elsewhere = SharedWeights(3, "GPU-not-here", "key", (), 0)
    with pytest.raises(ValueError, match="version 3, not 4"):
        materialize(elsewhere, 4)
    with pytest.raises(Unreachable, match="GPU-not-here, which this process cannot see"):
        materialize(elsewhere, 3)
