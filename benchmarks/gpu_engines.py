"""The generation engines on one GPU, side by side in one run, as ratios to the HBM roofline.

A Qwen3-1.7B-shaped model with random bf16 weights (built once under --dir, with the tokenizer of --tokenizer)
decodes batches of 8 / 64 / 256 requests (prompt --prompt tokens, --new tokens, temperature 1, top-k 20, each
request seeded, processed log-probs) through:
  vllm      vLLM 0.26 in-process (`vllm.LLM.generate`, CUDA graphs), the same prompts and sampling; and the same
            batches unseeded, greedy without log-probs, and with max_tokens 1 (prefill alone), to show from
            measurements what holds it below the roofline;
  ray       the PolicyServer actor on VLLMEngine through Ray (the episodes' path: B concurrent `generate` calls,
            one request each), alternating with the same batch inside the actor's process;
  server    whale-ray's PolicyService on VLLMEngine (the PolicyServer actor's code, without Ray), B concurrent
            asyncio clients, one request each; and its own costs (the same batch through VLLMEngine.generate
            from one thread, chat template + tokenisation, engine steps, a stop string);
  hf        TransformersEngine (bf16, one batched generate) with --hf-new tokens (64: it decodes ~10 steps/s);
and, on the server: the latency of short requests submitted while long ones run (continuous batching), and
the weight sync of the whole model (GPU state dict -> VLLMEngine.load_weights, and from pinned CPU tensors)
against a raw device-to-device copy of the same bytes. Each part runs in its own process (a fresh CUDA
context); the orchestrator prints the table. Every timed batch follows a warm-up at its own batch size (Triton's
sampling kernels are compiled per batch shape on first use) and has prompts never seen before (no prefix-cache
hits), so the columns compare like with like.

tokens/s counts completion tokens over wall time, prefill included. Roofline tokens/s at batch B =
B x HBM bandwidth (a measured device copy) / bytes read per decode step (all weights + the KV cache of B
sequences at their mean length).

    python benchmarks/gpu_engines.py --tokenizer PATH/TO/CHECKPOINT [--parts vllm,ray,server,hf,sync]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

QWEN3_1P7B = dict(vocab_size=151936, hidden_size=2048, num_hidden_layers=28, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, intermediate_size=6144, tie_word_embeddings=True,
                  max_position_embeddings=4096)
BATCHES = (8, 64, 256)
REPEATS = 2


def build_model(tokenizer: Path, out: Path) -> Path:
    import shutil

    from transformers import Qwen3Config, Qwen3ForCausalLM

    if (out / "model.safetensors").is_file() or (out / "model.safetensors.index.json").is_file():
        return out
    torch.manual_seed(0)
    cfg = Qwen3Config(**QWEN3_1P7B, eos_token_id=[2, 0], pad_token_id=0, dtype="bfloat16")
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tokenizer / f).is_file():
            shutil.copy(tokenizer / f, out / f)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0], "pad_token_id": 0}))
    return out


class Prompts:
    """Requests whose rendered prompts are exactly `prompt` ids (the tokenizer splits digits), each prompt never
    handed out before: no run (warm-up or timed, this variant or another) finds its prompts in the prefix cache."""

    def __init__(self, tokenizer, prompt: int):
        self.tokenizer, self.prompt, self.next = tokenizer, prompt, 0
        self.overhead = len(self._encode([self._req(0, 0, 1)])[0])

    def _encode(self, reqs):
        from whale_ray.policy.engine import encode_prompts

        return encode_prompts(self.tokenizer, reqs)

    def _req(self, i, digits, new, **sampling):
        from whale_ray.policy.engine import GenerationRequest
        from whale_ray.records import SamplingParams

        sampling = {"temperature": 1.0, "top_k": 20, "seed": i, **sampling}
        return GenerationRequest([{"role": "user", "content": f"{i:07d}" + "7" * digits}],
                                 SamplingParams(max_tokens=new, **sampling))

    def take(self, n: int, new: int, **sampling):
        first, self.next = self.next, self.next + n
        out = [self._req(i, max(self.prompt - self.overhead, 0), new, **sampling) for i in range(first, first + n)]
        assert len(self._encode(out[:1])[0]) == max(self.prompt, self.overhead)
        return out


def hbm_bandwidth() -> float:
    x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    torch.cuda.synchronize()
    return 2 * x.numel() * 10 / (time.perf_counter() - t0)  # read + write


def engine_facts(cfg) -> dict:
    sizes = cfg.compilation_config.cudagraph_capture_sizes or []
    return {"max_num_batched_tokens": cfg.scheduler_config.max_num_batched_tokens,
            "async_scheduling": cfg.scheduler_config.async_scheduling,
            "cudagraph_sizes": f"{len(sizes)} sizes, {min(sizes, default=0)}..{max(sizes, default=0)}",
            "prefix_caching": cfg.cache_config.enable_prefix_caching}


def part_vllm(a) -> dict:
    """vLLM's own LLM.generate. Besides the headline (T 1, top-k 20, seeded, log-probs), the same batch without
    seeds (no per-request generators), greedy without log-probs (no sampling work) and with max_tokens 1 (the
    prefill alone): what each costs, measured rather than guessed."""
    import vllm
    from vllm.inputs.engine import tokens_input

    from whale_ray.policy.checkpoint import load_tokenizer

    prompts = Prompts(load_tokenizer(a.model), a.prompt)
    llm = vllm.LLM(model=str(a.model), dtype="bfloat16", skip_tokenizer_init=True, max_num_seqs=256, seed=0,
                   logprobs_mode="processed_logprobs", gpu_memory_utilization=0.6, max_model_len=4096,
                   compilation_config={"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"})

    def run(b, new, seeded=True, greedy=False) -> tuple[int, float]:
        reqs = prompts.take(b, new)
        ids = [tokens_input(x) for x in prompts._encode(reqs)]
        params = [vllm.SamplingParams(temperature=0.0 if greedy else 1.0, top_k=-1 if greedy else 20, max_tokens=new,
                                      seed=r.sampling.seed if seeded else None, logprobs=None if greedy else 0,
                                      stop_token_ids=[2, 0], detokenize=False) for r in reqs]
        t0 = time.perf_counter()
        outs = llm.generate(ids, params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs), time.perf_counter() - t0

    def in_thread(b, new) -> tuple[int, float]:  # the same call from a second thread, as VLLMEngine steps vLLM
        box = {}
        t = threading.Thread(target=lambda: box.update(r=run(b, new)))
        t.start()
        t.join()
        return box["r"]

    res = {"facts": engine_facts(llm.llm_engine.vllm_config)}
    for b in BATCHES:
        run(b, 16)  # warm-up at this batch size: Triton's sampling kernels specialise on it (compiled here, untimed)
        runs = [run(b, a.new) for _ in range(REPEATS)]
        n, t = min(runs, key=lambda x: x[1])  # best of REPEATS: runs of one batch differ by up to ~10%
        res[b], res[f"{b}_s"], res[f"{b}_all"] = n / t, t, [n / t for n, t in runs]
        res[f"{b}_thread"] = (lambda n, t: n / t)(*in_thread(b, a.new))
        res[f"{b}_unseeded"] = (lambda n, t: n / t)(*run(b, a.new, seeded=False))
        res[f"{b}_greedy"] = (lambda n, t: n / t)(*run(b, a.new, greedy=True))
        res[f"{b}_prefill_s"] = run(b, 1)[1]
    return res


def part_server(a) -> dict:
    """PolicyService on VLLMEngine (the actor's code without Ray), B concurrent asyncio clients; the same batch
    through VLLMEngine.generate from one thread (no asyncio); the chat template + tokenisation of the batch
    alone; the engine's step count; and a batch whose requests carry a stop string that never matches."""
    from whale_ray.policy.checkpoint import load_tokenizer
    from whale_ray.policy.serving import PolicyService

    prompts = Prompts(load_tokenizer(a.model), a.prompt)
    svc = PolicyService(str(a.model), engine="vllm", max_batch=256, dtype="bfloat16", gpu_memory_utilization=0.6)
    eng = svc.engine

    async def clients(reqs):
        return await asyncio.gather(*(svc.generate(r.messages, r.sampling) for r in reqs))

    def timed(fn, reqs) -> tuple[float, float, int]:
        steps = eng.steps
        t0 = time.perf_counter()
        outs = fn(reqs)
        dt = time.perf_counter() - t0
        return sum(len(o.completion_ids) for o in outs) / dt, dt, eng.steps - steps

    ids = itertools.count()

    def stepped_here(reqs):  # the engine's own LLMEngine and SamplingParams, stepped on this thread (its own idles)
        from vllm.inputs.engine import tokens_input

        core = eng._core
        for r, x in zip(reqs, prompts._encode(reqs)):
            core.add_request(f"main-{next(ids)}", tokens_input(x), eng.sampling_params(r, len(x), r.sampling.seed))
        done = []
        while core.has_unfinished_requests():
            done += [types.SimpleNamespace(completion_ids=o.outputs[0].token_ids) for o in core.step() if o.finished]
        return done

    res = {"facts": engine_facts(eng.vllm_config)}
    for b in BATCHES:
        asyncio.run(clients(prompts.take(b, 16)))  # warm-up at this batch size (see part_vllm)
        runs = [timed(lambda r: asyncio.run(clients(r)), prompts.take(b, a.new)) for _ in range(REPEATS)]
        res[b], res[f"{b}_s"], res[f"{b}_steps"] = max(runs)  # best of REPEATS, as in part_vllm
        res[f"{b}_all"] = [x[0] for x in runs]
        res[f"{b}_direct"] = timed(eng.generate, prompts.take(b, a.new))[0]
        res[f"{b}_main"] = timed(stepped_here, prompts.take(b, a.new))[0]
        reqs = prompts.take(b, a.new)
        t0 = time.perf_counter()
        for r in reqs:  # what each client's submit does first, one request at a time
            prompts._encode([r])
        res[f"{b}_encode_s"] = time.perf_counter() - t0
    b = BATCHES[-1]
    reqs = prompts.take(b, a.new, stop=("@@never@@",))
    res[f"{b}_stop"] = timed(lambda r: asyncio.run(clients(r)), reqs)[0]

    async def mixed():  # 64 long completions running; 8 short requests join mid-way
        long = [asyncio.ensure_future(svc.generate(r.messages, r.sampling)) for r in prompts.take(64, 1024)]
        t0 = time.perf_counter()
        await asyncio.sleep(1.0)
        t1 = time.perf_counter()
        short = await asyncio.gather(*(svc.generate(r.messages, r.sampling) for r in prompts.take(8, 16)))
        t_short = time.perf_counter() - t1
        running = sum(not f.done() for f in long)
        done = await asyncio.gather(*long)
        return {"short_s": t_short, "long_s": time.perf_counter() - t0, "long_running_when_short_done": running,
                "long_tokens": sum(len(c.completion_ids) for c in done) / 64,
                "short_tokens": sum(len(c.completion_ids) for c in short) / 8}

    res["mixed"] = asyncio.run(mixed())
    return res


def _in_actor(actor_self, reqs) -> tuple[int, float]:
    """The same batch inside the PolicyServer's process: asyncio clients of its PolicyService, no Ray call in
    between (`__ray_call__` runs a plain function on a thread of the actor, so it gets an event loop of its own)."""
    svc = actor_self._service

    async def clients():
        return await asyncio.gather(*(svc.generate(r.messages, r.sampling) for r in reqs))

    t0 = time.perf_counter()
    outs = asyncio.run(clients())
    return sum(len(o.completion_ids) for o in outs), time.perf_counter() - t0


def part_ray(a) -> dict:
    """The PolicyServer actor on VLLMEngine, as the episodes call it: B concurrent `generate` calls through Ray,
    one request each; alternating with the same batch submitted inside the actor's process (asyncio clients there),
    REPEATS + 1 runs of each, so both columns see the same GPU and the same moment."""
    import ray

    from actors.policy_server import PolicyServer
    from whale_ray.policy.checkpoint import load_tokenizer

    prompts = Prompts(load_tokenizer(a.model), a.prompt)
    ray.init(num_cpus=8, num_gpus=1, include_dashboard=False, log_to_driver=False)
    server = PolicyServer.options(num_gpus=1, num_cpus=1).remote(
        str(a.model), engine="vllm", max_batch=256, dtype="bfloat16", gpu_memory_utilization=0.6)
    ray.get(server.version.remote(), timeout=300)  # up (vLLM's start and CUDA graph capture)

    def through_ray(reqs) -> tuple[int, float]:
        t0 = time.perf_counter()
        calls = ray.get([server.generate.remote(r.messages, r.sampling) for r in reqs])
        return sum(len(c.completion_ids) for c in calls), time.perf_counter() - t0

    def in_actor(reqs) -> tuple[int, float]:
        return ray.get(server.__ray_call__.remote(_in_actor, reqs))

    res = {}
    for b in BATCHES:
        through_ray(prompts.take(b, 16))  # warm-up at this batch size (see part_vllm)
        runs = {"ray": [], "actor": []}
        for _ in range(REPEATS + 1):
            for path, fn in (("ray", through_ray), ("actor", in_actor)):
                n, t = fn(prompts.take(b, a.new))
                runs[path].append(n / t)
        res[b], res[f"{b}_all"] = max(runs["ray"]), runs["ray"]
        res[f"{b}_actor"], res[f"{b}_actor_all"] = max(runs["actor"]), runs["actor"]
    ray.shutdown()
    return res


def part_hf(a) -> dict:
    """TransformersEngine, with --hf-new tokens (fewer than the others: at ~10 decode steps/s it would not fit the
    device call otherwise); its roofline column uses its own context length."""
    from whale_ray.policy.transformers_engine import TransformersEngine

    eng = TransformersEngine(a.model, device="cuda", dtype="bfloat16", max_batch=256)
    prompts = Prompts(eng.tokenizer, a.prompt)
    res = {}
    for b in BATCHES:
        eng.generate(prompts.take(b, 2))
        reqs = prompts.take(b, a.hf_new)
        t0 = time.perf_counter()
        outs = eng.generate(reqs)
        res[b] = sum(len(o.completion_ids) for o in outs) / (time.perf_counter() - t0)
    return res


def part_sync(a) -> dict:
    from safetensors.torch import load_file

    from whale_ray.policy.vllm_engine import VLLMEngine

    eng = VLLMEngine(a.model, dtype="bfloat16", max_batch=64, gpu_memory_utilization=0.4)
    files = sorted(Path(a.model).glob("*.safetensors"))
    trainer = {k: v.cuda() for f in files for k, v in load_file(str(f)).items()}  # the Trainer's GPU state
    nbytes = sum(t.numel() * t.element_size() for t in trainer.values())
    dst = {k: torch.empty_like(t) for k, t in trainer.items()}
    res = {"bytes": nbytes, "bw": hbm_bandwidth()}
    gpu, pinned, raw = [], [], []
    host = {k: t.cpu().pin_memory() for k, t in trainer.items()}
    for i in range(4):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for k, t in trainer.items():
            dst[k].copy_(t)
        torch.cuda.synchronize()
        raw.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        eng.load_weights(trainer, 2 * i + 1)
        torch.cuda.synchronize()
        gpu.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        eng.load_weights(host, 2 * i + 2)
        torch.cuda.synchronize()
        pinned.append(time.perf_counter() - t0)
    res.update(raw=raw, gpu=gpu, pinned=pinned, version=eng.version)
    eng.close()
    return res


PART_TIMEOUT = {"vllm": 170, "server": 170, "ray": 200, "hf": 110, "sync": 100}  # seconds


def orchestrate(a) -> None:
    model = build_model(a.tokenizer, a.dir)
    bw = hbm_bandwidth()
    results = {}
    for part in a.parts.split(","):
        cmd = [sys.executable, __file__, "--part", part, "--model", str(model), "--prompt", str(a.prompt),
               "--new", str(a.new), "--hf-new", str(a.hf_new)]
        t0 = time.perf_counter()
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=PART_TIMEOUT[part])
        except subprocess.TimeoutExpired as e:
            print(f"part {part} ran past {PART_TIMEOUT[part]} s:\n{(e.stdout or b'')[-2000:]!r}\n{(e.stderr or b'')[-3000:]!r}")
            continue
        line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
        if p.returncode or not line:
            print(f"part {part} failed (rc {p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-4000:]}")
            continue
        results[part] = json.loads(line[-1][7:])
        print(f"part {part}: {time.perf_counter() - t0:.0f} s  {json.dumps(results[part])}", flush=True)
    c = QWEN3_1P7B
    weights = 2 * (c["vocab_size"] * c["hidden_size"] + c["num_hidden_layers"] * (
        c["hidden_size"] * c["head_dim"] * (c["num_attention_heads"] * 2 + c["num_key_value_heads"] * 2)
        + 3 * c["hidden_size"] * c["intermediate_size"]))
    kv_token = c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * c["head_dim"] * 2

    def roof(b: int, new: int) -> float:  # tokens/s at batch b, mean context prompt + new / 2
        return b * bw / (weights + b * (a.prompt + new / 2) * kv_token)

    def row(name: str, r: dict, key: str = "", new: int = a.new) -> None:
        if all(f"{b}{key}" in r for b in BATCHES):
            print(f"{name:<44}" + "".join(f"{r[f'{b}{key}']:>9,.0f} ({r[f'{b}{key}'] / roof(b, new):5.1%}) "
                                          for b in BATCHES))

    def ratio(name: str, x: dict, kx: str, y: dict, ky: str, fmt: str = ".2f") -> None:
        print(f"{name:<44}" + "".join(f"{x[f'{b}{kx}'] / y[f'{b}{ky}']:>21{fmt}}x" for b in BATCHES))

    print(f"\nHBM copy bandwidth {bw / 1e12:.2f} TB/s; weights {weights / 1e9:.2f} GB; KV {kv_token} B/token; "
          f"prompt {a.prompt}, {a.new} new tokens, T 1.0, top-k 20, seeded, processed log-probs; every timed batch "
          f"has prompts never seen before and follows a warm-up at its own batch size")
    print(f"{'tokens/s (share of the roofline)':<44}" + "".join(f"{'batch ' + str(b):>22}" for b in BATCHES))
    print(f"{'roofline':<44}" + "".join(f"{roof(b, a.new):>15,.0f} tok/s " for b in BATCHES))
    v, srv, hf, rs = results.get("vllm"), results.get("server"), results.get("hf"), results.get("ray")
    if v:
        row(f"vLLM 0.26 in-process (LLM.generate, best of {REPEATS})", v)
    if rs:
        row(f"PolicyServer through Ray (best of {REPEATS + 1})", rs)
        row("  the same batch inside its process", rs, "_actor")
    if srv:
        row(f"PolicyService on VLLMEngine (best of {REPEATS})", srv)
    if hf:
        print(f"{'roofline at ' + str(a.hf_new) + ' new tokens':<44}"
              + "".join(f"{roof(b, a.hf_new):>15,.0f} tok/s " for b in BATCHES))
        row(f"TransformersEngine ({a.hf_new} new tokens)", hf, new=a.hf_new)
    if v and rs:
        ratio("PolicyServer through Ray / vLLM in-process", rs, "", v, "")
    if rs:
        ratio("  through Ray / inside its process", rs, "", rs, "_actor")
        print(f"{'  every run through Ray / inside (tok/s)':<44}" + "".join(
            f"{' / '.join(f'{x:,.0f}' for x in rs[f'{b}_all']):>22}" for b in BATCHES))
        print(f"{'':<44}" + "".join(f"{' / '.join(f'{x:,.0f}' for x in rs[f'{b}_actor_all']):>22}" for b in BATCHES))
    if v and srv:
        ratio("server / vLLM in-process", srv, "", v, "")
    if v and hf:
        ratio("vLLM / TransformersEngine", v, "", hf, "", ".1f")
    if v:
        print("\nwhat holds vLLM in-process below the roofline:")
        print(f"{'  every run (tok/s)':<44}" + "".join(f"{' / '.join(f'{x:,.0f}' for x in v[f'{b}_all']):>22}"
                                                 for b in BATCHES))
        row("  same, LLM.generate on a second thread", v, "_thread")
        row("  same, unseeded (no per-request generators)", v, "_unseeded")
        row("  same, greedy without log-probs (no sampling)", v, "_greedy")
        print(f"{'  prefill (max_tokens 1) share of the run':<44}"
              + "".join(f"{v[f'{b}_prefill_s'] / v[f'{b}_s']:>22.1%}" for b in BATCHES))
        dec = {f"{b}": b * (a.new - 1) / (v[f"{b}_s"] - v[f"{b}_prefill_s"]) for b in BATCHES}
        row("  decode alone (run minus prefill)", dec)
        print(f"  engine: {json.dumps(v['facts'])}")
    if srv:
        print("\nthe server's own costs:")
        row("  VLLMEngine.generate from one thread", srv, "_direct")
        row("  its LLMEngine stepped on the main thread", srv, "_main")
        print(f"{'  every asyncio run (tok/s)':<44}" + "".join(f"{' / '.join(f'{x:,.0f}' for x in srv[f'{b}_all']):>22}"
                                                           for b in BATCHES))
        print(f"{'  chat template + tokenise, one by one (s)':<44}"
              + "".join(f"{srv[f'{b}_encode_s']:>22.3f}" for b in BATCHES))
        print(f"{'  share of the timed batch':<44}"
              + "".join(f"{srv[f'{b}_encode_s'] / srv[f'{b}_s']:>22.1%}" for b in BATCHES))
        mnbt = srv["facts"]["max_num_batched_tokens"]
        print(f"{'  engine steps (fewest possible)':<44}" + "".join(
            f"{srv[f'{b}_steps']:>13} ({a.new - 1 + -(-b * a.prompt // mnbt)})" for b in BATCHES))
        b = BATCHES[-1]
        if f"{b}_stop" in srv:
            print(f"  batch {b} with a stop string that never matches: {srv[f'{b}_stop']:,.0f} tok/s "
                  f"({srv[f'{b}_stop'] / srv[str(b)]:.2f}x without)")
        m = srv["mixed"]
        print(f"  continuous batching: 8 short requests ({m['short_tokens']:.0f} tokens) done in {m['short_s']:.2f} s "
              f"while {m['long_running_when_short_done']}/64 long ones ({m['long_tokens']:.0f} tokens) ran on; "
              f"long ones took {m['long_s']:.2f} s")
        print(f"  engine: {json.dumps(srv['facts'])}")
    if "sync" in results:
        s = results["sync"]
        raw = min(s["raw"])
        print(f"\nweight sync of {s['bytes'] / 1e9:.2f} GB: raw device copy {raw * 1e3:.1f} ms; load_weights from GPU "
              f"tensors {min(s['gpu']):.3f} s (first {s['gpu'][0]:.3f} s, {min(s['gpu']) / raw:.1f}x raw), from pinned "
              f"CPU {min(s['pinned']):.3f} s ({min(s['pinned']) / raw:.1f}x raw); version {s['version']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", type=Path, help="a checkpoint whose tokenizer and chat template to use")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/qwen3-1p7b-random"))
    ap.add_argument("--parts", default="vllm,ray,server,hf,sync")
    ap.add_argument("--part")
    ap.add_argument("--model", type=Path)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--hf-new", type=int, default=64, help="new tokens for TransformersEngine (slow)")
    a = ap.parse_args()
    if a.part:
        res = {"vllm": part_vllm, "server": part_server, "ray": part_ray, "hf": part_hf, "sync": part_sync}[a.part](a)
        print("RESULT " + json.dumps(res), flush=True)
        import os

        os._exit(0)  # skip vLLM's slow teardown
    orchestrate(a)


if __name__ == "__main__":
    main()
