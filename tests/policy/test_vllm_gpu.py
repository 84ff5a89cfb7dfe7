"""VLLMEngine against TransformersEngine on one GPU (skipped without CUDA and vllm).

The policy is WHALE_GPU_POLICY if set (a checkpoint directory: a real model such as an imported SmolLM2), else
the session's small embedded policy. vLLM runs in bf16 (its production dtype); the reference is TransformersEngine
in float32 on the same checkpoint. How far bf16 arithmetic alone moves this checkpoint's outputs is measured here,
with TransformersEngine in bf16 against the same reference, and vLLM is held to that: greedy tokens may part from
the reference only where its top-2 logits are closer than bf16 moves them (a near-tie, judged from the float32
logits), and its log-probs may be off by about what bf16 transformers' are. A fault (a wrong or missing weight, a
reload that loses the tied head) moves logits by far more than that.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch

from whale_ray.policy.engine import GenerationRequest
from whale_ray.policy.transformers_engine import TransformersEngine
from whale_ray.records import SamplingParams

vllm = pytest.importorskip("vllm")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

def ask(q: str, **sampling) -> GenerationRequest:
    return GenerationRequest([{"role": "system", "content": "Solve the problem."}, {"role": "user", "content": q}],
                             SamplingParams(**sampling))


QUESTIONS = [f"What is {a} {op} {b}?" for a, b, op in [(3, 4, "+"), (12, 7, "-"), (6, 9, "*"), (41, 17, "+"),
                                                        (99, 1, "+"), (8, 8, "*"), (50, 25, "-"), (13, 3, "*")]]


@pytest.fixture(scope="module")
def policy(request):
    return os.environ.get("WHALE_GPU_POLICY") or request.getfixturevalue("tiny_policy")


@pytest.fixture(scope="module")
def engines(policy):
    from whale_ray.policy.vllm_engine import VLLMEngine

    v = VLLMEngine(policy, dtype="bfloat16", max_batch=64, gpu_memory_utilization=0.2, seed=0)
    ref = TransformersEngine(policy, device="cuda", dtype="float32")
    yield v, ref
    v.close()


@pytest.fixture(scope="module")
def bf16(policy):
    """The checkpoint in bf16 through transformers: bf16 arithmetic alone, the floor vLLM is held to."""
    return TransformersEngine(policy, device="cuda", dtype="bfloat16")


def teacher_logits(ref: TransformersEngine, prompt_ids, completion_ids) -> torch.Tensor:
    ids = torch.tensor([list(prompt_ids) + list(completion_ids)], device=ref.device)
    with torch.no_grad():
        return ref.model(input_ids=ids).logits[0, len(prompt_ids) - 1 :].float()


def bf16_gap_noise(ref: TransformersEngine, half: TransformersEngine, outs) -> float:
    """A near-tie threshold for these weights: twice the largest change bf16 arithmetic makes to the reference's
    top-2 logit gap, teacher-forced on the reference's own greedy completions `outs` (at least 0.05)."""
    worst = 0.0
    for o in outs:
        a, b = teacher_logits(ref, o.prompt_ids, o.completion_ids), teacher_logits(half, o.prompt_ids, o.completion_ids)
        top = a.topk(2).indices
        ga, gb = a.gather(1, top), b.gather(1, top)
        worst = max(worst, float(((ga[:, 0] - ga[:, 1]) - (gb[:, 0] - gb[:, 1])).abs().max()))
    return max(0.05, 2 * worst)


@pytest.fixture(scope="module")
def near_tie(engines, bf16) -> float:
    _, ref = engines
    want = ref.generate([ask(q, max_tokens=160, temperature=0.0) for q in QUESTIONS])
    tie = bf16_gap_noise(ref, bf16, want)
    print(f"near-tie threshold (2x bf16's largest move of the top-2 gap): {tie:.3f}")
    return tie


def agree_up_to_near_ties(ref, a, b, near_tie: float) -> bool:
    """a == b, or where they part the reference's float32 logits of the two tokens taken are closer than `near_tie`
    (on a real model bf16 sometimes takes the reference's third choice, as bf16 transformers does too)."""
    if a.completion_ids == b.completion_ids:
        return True
    j = next((i for i, (x, y) in enumerate(zip(a.completion_ids, b.completion_ids)) if x != y),
             min(len(a.completion_ids), len(b.completion_ids)))
    if j == min(len(a.completion_ids), len(b.completion_ids)):
        return True  # one stopped where the other went on: the eos was the near-tie
    logits = teacher_logits(ref, a.prompt_ids, a.completion_ids[:j])[j]
    return abs(float(logits[a.completion_ids[j]] - logits[b.completion_ids[j]])) < near_tie


def test_greedy_tokens_equal_transformers(engines, bf16, near_tie):
    v, ref = engines
    reqs = [ask(q, max_tokens=160, temperature=0.0) for q in QUESTIONS]
    got, want, floor = v.generate(reqs), ref.generate(reqs), bf16.generate(reqs)
    exact = sum(g.completion_ids == w.completion_ids for g, w in zip(got, want))
    exact_bf16 = sum(h.completion_ids == w.completion_ids for h, w in zip(floor, want))
    print(f"greedy: {exact}/{len(reqs)} identical to TransformersEngine (float32); transformers in bf16: "
          f"{exact_bf16}/{len(reqs)}")
    for g, w in zip(got, want):
        assert g.prompt_ids == w.prompt_ids  # the chat template rendered on the trusted side, same ids
        assert agree_up_to_near_ties(ref, g, w, near_tie), (g.text, w.text)
        if g.completion_ids == w.completion_ids:
            assert (g.text, g.finish_reason) == (w.text, w.finish_reason)
    assert exact >= exact_bf16 - 2  # parts from float32 about as often as bf16 arithmetic does, not more
    sampled = v.generate([ask(q, max_tokens=160, temperature=1.0, seed=s) for s in range(4) for q in QUESTIONS])
    stopped = [g for g in sampled if g.finish_reason == "stop"]
    assert stopped and all(g.completion_ids[-1] in v.eos_ids for g in stopped)  # the eos is kept
    assert all(not set(v.eos_ids) & set(g.completion_ids[:-1]) for g in sampled)


def test_sampled_logprobs_match_recomputation(engines, bf16):
    """vLLM's processed log-probs against the float32 recomputation, beside bf16 transformers' recomputation of the
    same tokens: vLLM may be off by about what bf16 arithmetic is, not more."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    v, ref = engines
    settings = [(1.0, 20, 1.0), (0.7, 0, 0.9), (1.3, 5, 0.8), (0.0, 0, 1.0), (1.0, 0, 1.0), (0.5, 10, 0.95)]
    reqs = [ask(q, max_tokens=32, temperature=t, top_k=k, top_p=p, seed=7 + i)
            for i, (q, (t, k, p)) in enumerate(zip(QUESTIONS, settings))]

    def processed(engine, out, t, k, p):
        logits = teacher_logits(engine, out.prompt_ids, out.completion_ids)[:-1]
        if t > 0:
            logits = TemperatureLogitsWarper(t)(None, logits)
            logits = TopKLogitsWarper(k)(None, logits) if k else logits
            logits = TopPLogitsWarper(p)(None, logits) if p < 1 else logits
        ids = torch.tensor(out.completion_ids, device=logits.device)[:, None]
        return logits.log_softmax(-1).gather(1, ids)[:, 0]

    diffs, floor, outside = [], [], 0
    for out, (t, k, p) in zip(v.generate(reqs), settings):
        assert len(out.logprobs) == len(out.completion_ids) > 0
        want, half = processed(ref, out, t, k, p), processed(bf16, out, t, k, p)
        finite = torch.isfinite(want) & torch.isfinite(half)
        outside += int((~finite).sum())  # sampled in bf16 just outside float32's top-p / top-k set
        diffs.append((torch.tensor(out.logprobs, device=want.device)[finite] - want[finite]).abs())
        floor.append((half[finite] - want[finite]).abs())
    d, f = torch.cat(diffs), torch.cat(floor)
    print(f"log-prob |vLLM bf16 - float32|: mean {d.mean():.4f} max {d.max():.4f}; |transformers bf16 - float32|: "
          f"mean {f.mean():.4f} max {f.max():.4f}; over {d.numel()} tokens, {outside} outside the float32 set")
    assert outside <= 2 and d.mean() <= 1.5 * f.mean() + 0.005 and d.max() <= 2 * f.max() + 0.05


def fresh_pair(text: str) -> str | None:
    """Two characters of `text`, past its first three, that appear nowhere before: a stop string that must cut
    the greedy completion exactly there (None for a completion too short or too repetitive to have one)."""
    for i in range(3, len(text) - 1):
        if text[i:i + 2].strip() and text.find(text[i:i + 2]) == i:
            return text[i:i + 2]
    return None


def test_stop_strings_and_max_tokens_cut_like_transformers(engines):
    v, ref = engines
    base = v.generate([ask(q, max_tokens=40, temperature=0.0) for q in QUESTIONS])
    cases = [(q, b, s) for q, b in zip(QUESTIONS, base) if (s := fresh_pair(b.text))]
    assert len(cases) >= 4, [b.text for b in base]
    reqs = [ask(q, max_tokens=40, temperature=0.0, stop=("@@never@@", s)) for q, _, s in cases]
    got, want = v.generate(reqs), ref.generate(reqs)
    for g, w, (_, b, s) in zip(got, want, cases):
        assert g.finish_reason == "stop" and g.text == b.text[: b.text.find(s)]
        assert g.completion_ids == b.completion_ids[: len(g.completion_ids)] and len(g.logprobs) == len(g.completion_ids)
        assert s in v.tokenizer.decode(g.completion_ids, skip_special_tokens=True)
        assert s not in v.tokenizer.decode(g.completion_ids[:-1], skip_special_tokens=True)
        if g.completion_ids == w.completion_ids:  # same path: the same cut, text and reason
            assert (g.text, g.finish_reason) == (w.text, w.finish_reason)
    k = max(1, min(len(b.completion_ids) for b in base) - 1)  # fewer tokens than any greedy completion has
    short = [ask(q, max_tokens=k, temperature=0.0) for q in QUESTIONS]  # greedy: the engines' RNGs differ
    for g, w in zip(v.generate(short), ref.generate(short)):
        assert len(g.completion_ids) == k == len(w.completion_ids) and g.finish_reason == "length" == w.finish_reason


def test_seeded_request_alone_and_in_company(engines):
    v, _ = engines
    req = ask("What is 5 + 6?", max_tokens=24, temperature=1.0, top_k=0, seed=123)
    alone = v.generate([req])[0]
    crowd = v.generate([ask(q, max_tokens=30, temperature=1.0, seed=i) for i, q in enumerate(QUESTIONS)] + [req])
    assert crowd[-1].completion_ids == alone.completion_ids


def checkpoint_state(policy) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: t for f in sorted(Path(policy).glob("*.safetensors")) for k, t in load_file(str(f)).items()}


@pytest.fixture(scope="module")
def own_greedy(engines):
    """Greedy outputs on the checkpoint's own weights, taken before any test reloads the engine."""
    v, _ = engines
    return [o.completion_ids for o in v.generate([ask(q, max_tokens=32, temperature=0.0) for q in QUESTIONS])]


@pytest.mark.parametrize("form", ["gpu_bf16", "trainer_cpu_fp32"])
def test_reload_in_place_then_greedy_equals_transformers(engines, bf16, own_greedy, policy, form):
    """From GPU tensors in the engine's dtype, and in the form the Trainer sends them in a `whale run`
    (RSFTLearner.state_dict: float32 copies on the CPU, cast by load_weights). The checkpoint's own weights first:
    reloaded (after whatever an earlier case left loaded), every greedy output is again bit for bit the one of the
    first load from disk (a head or embedding loaded wrong would change them); then weights moved by noise
    relative to each tensor's spread, held to the float32 reference on the same rounded weights."""
    v, ref = engines
    reqs = [ask(q, max_tokens=32, temperature=0.0) for q in QUESTIONS]
    own = checkpoint_state(policy)
    version = v.version
    v.load_weights({k: t.to("cuda", torch.bfloat16) if form == "gpu_bf16" else t.float() for k, t in own.items()},
                   version + 1)
    assert [o.completion_ids for o in v.generate(reqs)] == own_greedy

    g = torch.Generator().manual_seed(0 if form == "gpu_bf16" else 1)
    new = {k: t.float() + 0.05 * t.float().std().clamp_min(1e-3) * torch.randn(t.shape, generator=g)
           for k, t in own.items()}  # a tied head is not in the checkpoint: it follows the embedding
    sent = {k: t.to("cuda", torch.bfloat16) for k, t in new.items()} if form == "gpu_bf16" else new
    v.load_weights(sent, version + 2)
    # the references hold what vLLM holds: the same weights rounded to bf16
    rounded = {k: t.to(torch.bfloat16).float() for k, t in new.items()}
    if "lm_head.weight" not in rounded:
        rounded["lm_head.weight"] = rounded["model.embed_tokens.weight"]
    ref.load_weights(rounded, version + 2)
    bf16.load_weights(rounded, version + 2)
    after, want = v.generate(reqs), ref.generate(reqs)
    near_tie = bf16_gap_noise(ref, bf16, want)
    assert v.version == version + 2 and all(o.weight_version == version + 2 for o in after)
    assert any(a.completion_ids != b for a, b in zip(after, own_greedy))  # the new weights are the ones answering
    exact = sum(a.completion_ids == w.completion_ids for a, w in zip(after, want))
    print(f"after reload: greedy {exact}/{len(reqs)} identical to TransformersEngine with the same weights "
          f"(near-tie {near_tie:.3f})")
    assert all(agree_up_to_near_ties(ref, a, w, near_tie) for a, w in zip(after, want))
    with pytest.raises(ValueError, match="shape mismatch"):
        v.load_weights({**new, "model.norm.weight": torch.zeros(3)}, version + 3)
    assert v.version == version + 2


def test_the_copy_plan_loads_bit_for_bit_what_vllms_reload_loads(engines):
    """After the first reload the engine replays its loader's recorded copies (whale_ray/policy/vllm_reload.py):
    from the Trainer's float32 GPU tensors they leave every parameter as vLLM's reload_weights leaves it."""
    from whale_ray.policy.vllm_engine import _model

    v, ref = engines
    torch.manual_seed(2)
    new = {k: (t + 0.01 * torch.randn_like(t)).to("cuda", torch.float32) for k, t in ref.model.state_dict().items()}
    version = v.version
    v.load_weights(new, version + 1)  # the first load of this engine records the plan; later ones replay it
    v.load_weights(new, version + 1)
    assert v.plan_status.startswith("in use"), v.plan_status
    assert v.last_reload["path"] == "copy plan"
    model = v._core.collective_rpc(_model)[0]
    via_plan = {n: p.detach().cpu() for n, p in model.named_parameters()}
    plan, v._plan = v._plan, None
    try:
        v.load_weights(new, version + 2)
        assert v.last_reload["path"] == "vLLM reload_weights"
    finally:
        v._plan = plan
    by_vllm = {n: p.detach().cpu() for n, p in model.named_parameters()}
    assert via_plan.keys() == by_vllm.keys() and all(torch.equal(via_plan[n], by_vllm[n]) for n in by_vllm)
    print(f"copy plan {v.plan_status}; reload {v.last_reload}")
    v.load_weights(ref.model.state_dict(), version + 3)  # back to the reference's weights for the tests after


def test_in_flight_requests_finish_on_the_weights_they_started_with(engines):
    """A load_weights while requests run: they finish on the old weights and are labelled so; requests that
    arrive during the reload wait and run on the new weights."""
    v, ref = engines
    state = {k: t.to("cuda", torch.bfloat16) for k, t in ref.model.state_dict().items()}
    version = v.version
    reqs = [ask(q, max_tokens=40, temperature=0.0) for q in QUESTIONS]
    solo = v.generate(reqs)
    running = [v.submit(r) for r in reqs]
    while v.steps < 3:  # admitted and decoding
        time.sleep(0.001)
    zeros = {k: torch.zeros_like(t) for k, t in state.items()}
    import threading

    loader = threading.Thread(target=v.load_weights, args=(zeros, version + 1))
    loader.start()
    time.sleep(0.005)
    late = v.submit(reqs[0])
    loader.join()
    outs = [f.result() for f in running]
    assert [o.completion_ids for o in outs] == [o.completion_ids for o in solo]
    assert all(o.weight_version == version for o in outs)
    assert late.result().weight_version == version + 1 and late.result().completion_ids != solo[0].completion_ids
    v.load_weights(state, version + 2)
    assert [o.completion_ids for o in v.generate(reqs)] == [o.completion_ids for o in solo]


def test_a_long_completion_never_holds_back_a_short_one(engines, policy, tmp_path):
    """A copy of the checkpoint whose eos is a byte the policy never writes: greedy runs to max_tokens."""
    from whale_ray.policy.vllm_engine import VLLMEngine

    long_ckpt = tmp_path / "long"
    shutil.copytree(policy, long_ckpt)
    rare = engines[1].tokenizer("\x01", add_special_tokens=False)["input_ids"]
    tc = json.loads((long_ckpt / "tokenizer_config.json").read_text())
    tc["eos_token"] = engines[1].tokenizer.convert_ids_to_tokens(rare)[0]
    (long_ckpt / "tokenizer_config.json").write_text(json.dumps(tc))
    gen = json.loads((long_ckpt / "generation_config.json").read_text())
    (long_ckpt / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": rare}))
    v = VLLMEngine(long_ckpt, dtype="bfloat16", max_batch=64, gpu_memory_utilization=0.15, cuda_graphs=False)
    long = v.submit(ask("What is 1 + 1?", max_tokens=400, temperature=0.0))
    while v.steps < 5:
        time.sleep(0.001)
    short = v.submit(ask("What is 2 + 2?", max_tokens=4, temperature=0.0))
    short_out = short.result()
    assert not long.done() and len(short_out.completion_ids) == 4  # served while the long one still runs
    assert len(long.result().completion_ids) == 400 and long.result().finish_reason == "length"
    v.close()


READER = """
import json, pickle, sys, torch
from whale_ray.policy.cuda_ipc import SharedReader, materialize
reader = SharedReader()
for path in sys.stdin:
    w = pickle.load(open(path.strip(), 'rb'))
    s = materialize(w, w.version, reader)
    print(json.dumps({"views": id(s), "sums": {k: [float(t.double().sum()), str(t.dtype), list(t.shape)]
                                              for k, t in s.items()}}), flush=True)
"""


def test_shared_weights_are_read_in_another_process_and_follow_each_version(tmp_path):
    """CUDA IPC handles of the producer's tensors themselves (whale_ray/policy/cuda_ipc.py): another process
    reads exactly the producer's tensors, tied names included; while they stay where they are, each version
    reuses what the reader opened and sees the values written in place since; a tensor that moved gets new
    handles under a new key."""
    import pickle
    import subprocess
    import sys

    from whale_ray.policy.cuda_ipc import Sharer, materialize

    emb = torch.randn(1000, 64, device="cuda")
    state = {"model.embed_tokens.weight": emb, "lm_head.weight": emb,
             "model.norm.weight": torch.randn(64, device="cuda", dtype=torch.bfloat16),
             "model.layers.0.mlp.up_proj.weight": torch.randn(256, 64, device="cuda")}
    sharer = Sharer()
    child = subprocess.Popen([sys.executable, "-c", READER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        seen = []
        for version in (1, 2, 3):
            if version == 3:  # a tensor in new memory: the handles are made again
                state["model.norm.weight"] = state["model.norm.weight"].clone()
            w = sharer.share(state, version)
            assert w.nbytes == sum(t.numel() * t.element_size() for k, t in state.items() if k != "lm_head.weight")
            (tmp_path / f"w{version}.pkl").write_bytes(pickle.dumps(w))
            child.stdin.write(f"{tmp_path / f'w{version}.pkl'}\n")
            child.stdin.flush()
            got = json.loads(child.stdout.readline())
            want = {k: [float(t.double().sum()), str(t.dtype), list(t.shape)] for k, t in state.items()}
            assert got["sums"] == want
            seen.append((w.key, got["views"]))
            for t in state.values():
                t.mul_(2)  # the next version differs, written in place as an optimizer step writes
        assert seen[0] == seen[1] and seen[2][0] != seen[1][0]  # one key and one set of views until a tensor moved
    finally:
        child.stdin.close()
        child.wait(timeout=30)
    with pytest.raises(ValueError, match="version 3, not 4"):
        materialize(w, 4)


def test_sleep_levels_free_memory_and_wake_on_the_same_weights(policy):
    """Sleep level 1 (weights to CPU) then wake_up; level 2 (weights dropped) then load_weights, twice (vLLM's
    reload, then the copy plan into the weights' memory as it comes back): greedy outputs equal the ones before
    each sleep, and requests sent while asleep wait for the wake."""
    import threading

    from whale_ray.policy.vllm_engine import VLLMEngine

    v = VLLMEngine(policy, dtype="bfloat16", max_batch=64, gpu_memory_utilization=0.15, cuda_graphs=False,
                   sleep_level=1)
    reqs = [ask(q, max_tokens=24, temperature=0.0) for q in QUESTIONS]
    before = [o.completion_ids for o in v.generate(reqs)]
    alone = v.generate(reqs[:1])[0].completion_ids  # the held request runs alone: compare like with like
    state = {k: t.cuda() for k, t in checkpoint_state(policy).items()}
    for level in (1, 2, 2):  # the second level-2 load replays the copy plan the first one recorded
        v.sleep_level = level
        free0 = torch.cuda.mem_get_info()[0]
        v.sleep()
        freed = torch.cuda.mem_get_info()[0] - free0
        assert v.asleep and freed > 0
        waiting = v.submit(reqs[0])
        time.sleep(0.2)
        assert not waiting.done()  # held while asleep
        if level == 1:
            threading.Timer(0.1, v.wake_up).start()
        else:
            with pytest.raises(RuntimeError, match="level-2"):
                v.wake_up()
            threading.Timer(0.1, v.load_weights, args=(state, v.version + 1)).start()
        assert waiting.result(timeout=60).completion_ids == alone
        print(f"sleep level {level} freed {freed / 2**30:.2f} GiB")
        assert not v.asleep and [o.completion_ids for o in v.generate(reqs)] == before
    assert v.last_reload["path"] == "copy plan", v.plan_status
    v.close()


PRODUCER = """
import pickle, sys, torch
from safetensors.torch import load_file
from pathlib import Path
from whale_ray.policy.cuda_ipc import Sharer
state = {k: t.to("cuda", torch.float32) * 0.9 for f in sorted(Path(sys.argv[1]).glob("*.safetensors"))
         for k, t in load_file(str(f)).items()}  # a float32 Trainer state, not the checkpoint's weights
w = Sharer().share(state, int(sys.argv[3]))
Path(sys.argv[2]).write_bytes(pickle.dumps(w))
print("ready", flush=True)
sys.stdin.read()  # keeps the tensors alive until the consumer is done
"""


def test_shared_weights_load_into_vllm_like_the_same_weights_sent_directly(engines, policy, tmp_path):
    """Another process's tensors go into VLLMEngine by CUDA IPC, in place (no Ray): greedy outputs equal those after
    loading the same weights from this process's own GPU tensors."""
    import concurrent.futures as cf
    import pickle
    import subprocess
    import sys

    from whale_ray.policy.cuda_ipc import materialize

    v, _ = engines
    reqs = [ask(q, max_tokens=24, temperature=0.0) for q in QUESTIONS]
    version = v.version + 1
    child = subprocess.Popen([sys.executable, "-c", PRODUCER, str(policy), str(tmp_path / "w.pkl"), str(version)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        w = pickle.loads((tmp_path / "w.pkl").read_bytes())
        t0 = time.perf_counter()
        pool = cf.ThreadPoolExecutor(1)  # a hang fails the test instead of the session (not `with`: its exit
        try:                             # would wait for the hung thread)
            pool.submit(lambda: v.load_weights(materialize(w, version), version)).result(timeout=60)
        finally:
            pool.shutdown(wait=False)
        print(f"IPC load of {w.nbytes / 1e6:.1f} MB: {time.perf_counter() - t0:.3f} s")
        via_ipc = [o.completion_ids for o in v.generate(reqs)]
    finally:
        child.stdin.close()
        child.wait(timeout=30)
    direct = {k: t.to("cuda", torch.float32) * 0.9 for k, t in checkpoint_state(policy).items()}
    v.load_weights(direct, version + 1)
    assert [o.completion_ids for o in v.generate(reqs)] == via_ipc
