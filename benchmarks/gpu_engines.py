"""The generation engines on one GPU, side by side in one run, as ratios to the HBM roofline.

A Qwen3-1.7B-shaped model with random bf16 weights (built once under --dir, with the tokenizer of --tokenizer)
decodes batches of 8 / 64 / 256 requests (prompt --prompt tokens, --new tokens, temperature 1, top-k 20, each
request seeded) through:
  vllm      vLLM 0.26 in-process (`vllm.LLM.generate`, CUDA graphs), the same prompts and sampling;
  server    whale-ray's PolicyService on VLLMEngine (the PolicyServer actor's code, without Ray: Ray is not on
            the GPU image), B concurrent asyncio clients, one request each;
  hf        TransformersEngine (bf16, one batched generate);
and, on the server: the latency of short requests submitted while long ones run (continuous batching), and
the weight sync of the whole model (GPU state dict -> VLLMEngine.load_weights, and from pinned CPU tensors)
against a raw device-to-device copy of the same bytes. Each part runs in its own process (a fresh CUDA
context); the orchestrator prints the table.

tokens/s counts completion tokens over wall time, prefill included. Roofline tokens/s at batch B =
B x HBM bandwidth (a measured device copy) / bytes read per decode step (all weights + the KV cache of B
sequences at their mean length).

    python benchmarks/gpu_engines.py --tokenizer PATH/TO/CHECKPOINT [--parts vllm,server,hf,sync]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

QWEN3_1P7B = dict(vocab_size=151936, hidden_size=2048, num_hidden_layers=28, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, intermediate_size=6144, tie_word_embeddings=True,
                  max_position_embeddings=4096)
BATCHES = (8, 64, 256)


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


def requests(tokenizer, n: int, prompt: int, new: int, first_seed: int = 0):
    """n distinct requests whose rendered prompts are exactly `prompt` ids (the tokenizer splits digits)."""
    from whale_ray.policy import GenerationRequest
    from whale_ray.policy.engine import encode_prompts
    from whale_ray.records import SamplingParams

    def req(i, digits):
        return GenerationRequest([{"role": "user", "content": f"{i:05d}" + "7" * digits}],
                                 SamplingParams(max_tokens=new, temperature=1.0, top_k=20, seed=first_seed + i))

    overhead = len(encode_prompts(tokenizer, [req(0, 0)])[0])
    out = [req(i, max(prompt - overhead, 0)) for i in range(n)]
    assert len(encode_prompts(tokenizer, out[:1])[0]) == max(prompt, overhead)
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


def part_vllm(a) -> dict:
    import vllm
    from vllm.inputs.engine import tokens_input

    from whale_ray.policy.engine import encode_prompts
    from whale_ray.policy.tiny import load_tokenizer

    tok = load_tokenizer(a.model)
    llm = vllm.LLM(model=str(a.model), dtype="bfloat16", skip_tokenizer_init=True, max_num_seqs=256, seed=0,
                   logprobs_mode="processed_logprobs", gpu_memory_utilization=0.6, max_model_len=4096,
                   compilation_config={"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"})
    res = {}
    for b in BATCHES:
        reqs = requests(tok, b, a.prompt, a.new)
        prompts = [tokens_input(ids) for ids in encode_prompts(tok, reqs)]
        params = [vllm.SamplingParams(temperature=1.0, top_k=20, max_tokens=a.new, seed=i, logprobs=0,
                                      stop_token_ids=[2, 0], detokenize=False) for i in range(b)]
        llm.generate(prompts[: min(b, 8)], params[: min(b, 8)], use_tqdm=False)  # warm-up
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t0
        res[b] = sum(len(o.outputs[0].token_ids) for o in outs) / dt
    return res


def part_server(a) -> dict:
    from whale_ray.policy.serving import PolicyService
    from whale_ray.policy.tiny import load_tokenizer

    tok = load_tokenizer(a.model)
    svc = PolicyService(str(a.model), engine="vllm", max_batch=256, dtype="bfloat16", gpu_memory_utilization=0.6)

    async def run(reqs):
        return await asyncio.gather(*(svc.generate(r.messages, r.sampling) for r in reqs))

    res = {}
    for b in BATCHES:
        reqs = requests(tok, b, a.prompt, a.new)
        asyncio.run(run(reqs[: min(b, 8)]))
        t0 = time.perf_counter()
        calls = asyncio.run(run(reqs))
        dt = time.perf_counter() - t0
        res[b] = sum(len(c.completion_ids) for c in calls) / dt

    async def mixed():  # 64 long completions running; 8 short requests join mid-way
        from whale_ray.records import SamplingParams

        long = [asyncio.ensure_future(svc.generate(r.messages, SamplingParams(max_tokens=1024, temperature=1.0, seed=i)))
                for i, r in enumerate(requests(tok, 64, a.prompt, 1024))]
        t0 = time.perf_counter()
        await asyncio.sleep(1.0)
        t1 = time.perf_counter()
        short = await asyncio.gather(*(svc.generate(r.messages, SamplingParams(max_tokens=16, temperature=1.0, seed=i))
                                       for i, r in enumerate(requests(tok, 8, a.prompt, 16, 500))))
        t_short = time.perf_counter() - t1
        running = sum(not f.done() for f in long)
        done = await asyncio.gather(*long)
        return {"short_s": t_short, "long_s": time.perf_counter() - t0, "long_running_when_short_done": running,
                "long_tokens": sum(len(c.completion_ids) for c in done) / 64, "short_tokens": sum(len(c.completion_ids) for c in short) / 8}

    res["mixed"] = asyncio.run(mixed())
    return res


def part_hf(a) -> dict:
    from whale_ray.policy import TransformersEngine

    eng = TransformersEngine(a.model, device="cuda", dtype="bfloat16", max_batch=256)
    res = {}
    for b in BATCHES:
        reqs = requests(eng.tokenizer, b, a.prompt, a.new)
        eng.generate(reqs[:2])
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


def orchestrate(a) -> None:
    model = build_model(a.tokenizer, a.dir)
    bw = hbm_bandwidth()
    results = {}
    for part in a.parts.split(","):
        cmd = [sys.executable, __file__, "--part", part, "--model", str(model), "--prompt", str(a.prompt), "--new", str(a.new)]
        t0 = time.perf_counter()
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.part_timeout)
        except subprocess.TimeoutExpired as e:
            print(f"part {part} ran past {a.part_timeout} s:\n{(e.stdout or b'')[-2000:]!r}\n{(e.stderr or b'')[-3000:]!r}")
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
    ctx = a.prompt + a.new / 2
    print(f"\nHBM copy bandwidth {bw / 1e12:.2f} TB/s; weights {weights / 1e9:.2f} GB; KV {kv_token} B/token; "
          f"prompt {a.prompt}, {a.new} new tokens, T 1.0, top-k 20, seeded")
    print(f"{'engine':<34}" + "".join(f"{'batch ' + str(b):>22}" for b in BATCHES))
    roof = {b: b * bw / (weights + b * ctx * kv_token) for b in BATCHES}
    print(f"{'roofline':<34}" + "".join(f"{roof[b]:>15,.0f} tok/s " for b in BATCHES))
    names = {"vllm": "vLLM 0.26 in-process", "server": "PolicyService on VLLMEngine", "hf": "TransformersEngine"}
    for part, name in names.items():
        if part in results:
            r = results[part]
            print(f"{name:<34}" + "".join(f"{r[str(b)]:>9,.0f} ({r[str(b)] / roof[b]:5.1%}) " for b in BATCHES))
    if "server" in results and "vllm" in results:
        print(f"{'server / vLLM in-process':<34}" + "".join(
            f"{results['server'][str(b)] / results['vllm'][str(b)]:>21.2f}x" for b in BATCHES))
    if "hf" in results and "vllm" in results:
        print(f"{'vLLM / TransformersEngine':<34}" + "".join(
            f"{results['vllm'][str(b)] / results['hf'][str(b)]:>21.1f}x" for b in BATCHES))
    if "server" in results:
        m = results["server"]["mixed"]
        print(f"continuous batching: 8 short requests ({m['short_tokens']:.0f} tokens) done in {m['short_s']:.2f} s "
              f"while {m['long_running_when_short_done']}/64 long ones ({m['long_tokens']:.0f} tokens) ran on; "
              f"long ones took {m['long_s']:.2f} s")
    if "sync" in results:
        s = results["sync"]
        raw = min(s["raw"])
        print(f"weight sync of {s['bytes'] / 1e9:.2f} GB: raw device copy {raw * 1e3:.1f} ms; load_weights from GPU "
              f"tensors {min(s['gpu']):.3f} s (first {s['gpu'][0]:.3f} s, {min(s['gpu']) / raw:.1f}x raw), from pinned "
              f"CPU {min(s['pinned']):.3f} s ({min(s['pinned']) / raw:.1f}x raw); version {s['version']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", type=Path, help="a checkpoint whose tokenizer and chat template to use")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/qwen3-1p7b-random"))
    ap.add_argument("--parts", default="vllm,server,hf,sync")
    ap.add_argument("--part")
    ap.add_argument("--model", type=Path)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--part-timeout", type=float, default=240)
    a = ap.parse_args()
    if a.part:
        res = {"vllm": part_vllm, "server": part_server, "hf": part_hf, "sync": part_sync}[a.part](a)
        print("RESULT " + json.dumps(res), flush=True)
        import os

        os._exit(0)  # skip vLLM's slow teardown
    orchestrate(a)


if __name__ == "__main__":
    main()
