"""How far bf16 moves a policy's outputs, and whether vLLM's reloads add anything to it (one GPU).

Three engines on one checkpoint: TransformersEngine in float32 (the reference), TransformersEngine in bf16 (bf16
arithmetic alone, no vLLM) and VLLMEngine in bf16. It prints, per engine against the reference:
- greedy completions identical, and at each place where one parts from the reference: the reference's top-2
  logit gap there (a near-tie or not);
- teacher-forced on the reference's own greedy completions, how much bf16 moves the top-2 gap and the top
  logit (the quantiles give the near-tie threshold the GPU tests use);
- sampled log-probs against the float32 recomputation (vLLM's, and the bf16 engine's own on the same tokens);
then, for vLLM, reloads: the checkpoint's own weights (bf16 GPU tensors, then float32 CPU tensors, then the copy
plan) must leave every greedy completion bit for bit as before; perturbed weights (relative noise) are compared
with both TransformersEngines on the same bf16-rounded weights.

    python benchmarks/gpu_bf16_error.py --policy DIR [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from whale_ray.policy.engine import GenerationRequest
from whale_ray.policy.transformers_engine import TransformersEngine
from whale_ray.records import SamplingParams

QUESTIONS = [f"What is {a} {op} {b}?" for a, b, op in [
    (3, 4, "+"), (12, 7, "-"), (6, 9, "*"), (41, 17, "+"), (99, 1, "+"), (8, 8, "*"), (50, 25, "-"), (13, 3, "*"),
    (7, 15, "+"), (64, 8, "/"), (120, 45, "-"), (11, 11, "*"), (250, 125, "+"), (81, 9, "/"), (17, 6, "-"),
    (19, 4, "*")]] + [
    "Tom has 5 apples and buys 7 more. How many apples does he have?",
    "A train travels 60 km in one hour. How far does it go in 3 hours?",
    "Name the capital of France.", "Write one sentence about the sea.",
    "List three colors.", "What is the square root of 49?",
    "Sara had 20 sweets and gave away 8. How many are left?", "Explain what a prime number is in one sentence.",
]


def ask(q: str, **sampling) -> GenerationRequest:
    return GenerationRequest([{"role": "system", "content": "Solve the problem."}, {"role": "user", "content": q}],
                             SamplingParams(**sampling))


def logits_of(engine: TransformersEngine, prompt_ids, completion_ids) -> torch.Tensor:
    ids = torch.tensor([list(prompt_ids) + list(completion_ids)], device=engine.device)
    with torch.no_grad():
        return engine.model(input_ids=ids).logits[0, len(prompt_ids) - 1:].float()


def quantiles(xs: list[float]) -> dict[str, float]:
    s = sorted(xs)
    at = lambda q: s[min(len(s) - 1, int(q * len(s)))]  # noqa: E731
    return {"n": len(s), "mean": statistics.fmean(s), "p50": at(0.5), "p99": at(0.99), "p999": at(0.999),
            "max": s[-1]}


def partings(ref: TransformersEngine, got, want) -> dict:
    """Identical completions, and where the others part: the reference's top-2 gap and whether both tokens are
    its top 2 (teacher-forced on the common prefix)."""
    out = {"identical": 0, "parted": []}
    for g, w in zip(got, want):
        if g.completion_ids == w.completion_ids:
            out["identical"] += 1
            continue
        j = next((i for i, (x, y) in enumerate(zip(g.completion_ids, w.completion_ids)) if x != y),
                 min(len(g.completion_ids), len(w.completion_ids)))
        if j == min(len(g.completion_ids), len(w.completion_ids)):
            out["parted"].append({"at": j, "gap": None, "top2": None, "note": "one is a prefix of the other"})
            continue
        top = logits_of(ref, w.prompt_ids, w.completion_ids[:j])[j].topk(2)
        out["parted"].append({"at": j, "gap": round(float(top.values[0] - top.values[1]), 4),
                              "top1": round(float(top.values[0]), 3),
                              "top2": {g.completion_ids[j], w.completion_ids[j]} <= set(top.indices.tolist())})
    return out


def gap_error(ref: TransformersEngine, half: TransformersEngine, outs) -> dict:
    """Teacher-forced on the reference's greedy completions: |bf16 - float32| of the top-2 gap (the reference's
    top-2 tokens) and of the top logit, every position."""
    gaps, tops = [], []
    for o in outs:
        a = logits_of(ref, o.prompt_ids, o.completion_ids)
        b = logits_of(half, o.prompt_ids, o.completion_ids)
        idx = a.topk(2).indices
        ga, gb = a.gather(1, idx), b.gather(1, idx)
        gaps += ((ga[:, 0] - ga[:, 1]) - (gb[:, 0] - gb[:, 1])).abs().tolist()
        tops += (ga[:, 0] - gb[:, 0]).abs().tolist()
    return {"gap": quantiles(gaps), "top_logit": quantiles(tops)}


def logprob_error(ref: TransformersEngine, half: TransformersEngine, outs, settings) -> dict:
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    def processed(engine, o, t, k, p):
        x = logits_of(engine, o.prompt_ids, o.completion_ids)[:-1]
        if t > 0:
            x = TemperatureLogitsWarper(t)(None, x)
            x = TopKLogitsWarper(k)(None, x) if k else x
            x = TopPLogitsWarper(p)(None, x) if p < 1 else x
        return x.log_softmax(-1).gather(1, torch.tensor(o.completion_ids, device=x.device)[:, None])[:, 0]

    engine_d, half_d = [], []
    for o, (t, k, p) in zip(outs, settings):
        want, h = processed(ref, o, t, k, p), processed(half, o, t, k, p)
        ok = torch.isfinite(want) & torch.isfinite(h)
        engine_d += (torch.tensor(o.logprobs, device=want.device)[ok] - want[ok]).abs().tolist()
        half_d += (h[ok] - want[ok]).abs().tolist()
    return {"engine_vs_fp32": quantiles(engine_d), "hf_bf16_vs_fp32": quantiles(half_d)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--policy", required=True)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--engine", choices=["vllm", "transformers"], default="vllm",
                    help="the engine under test (transformers in bf16: a dry run of this script without vLLM)")
    args = ap.parse_args()

    res: dict = {"policy": args.policy, "engine": args.engine}
    t0 = time.perf_counter()
    ref = TransformersEngine(args.policy, device=args.device, dtype="float32")
    half = TransformersEngine(args.policy, device=args.device, dtype="bfloat16")
    if args.engine == "vllm":
        from whale_ray.policy.vllm_engine import VLLMEngine

        v = VLLMEngine(args.policy, dtype="bfloat16", max_batch=64, gpu_memory_utilization=0.2, seed=0)
    else:
        v = TransformersEngine(args.policy, device=args.device, dtype="bfloat16")
    res["start_s"] = round(time.perf_counter() - t0, 1)
    res["params"] = sum(p.numel() for p in ref.model.parameters())
    res["tied"] = bool(getattr(ref.model.config, "tie_word_embeddings", False))

    greedy = [ask(q, max_tokens=args.max_tokens, temperature=0.0) for q in QUESTIONS]
    want, by_half, by_vllm = ref.generate(greedy), half.generate(greedy), v.generate(greedy)
    res["greedy"] = {"hf_bf16": partings(ref, by_half, want), "vllm": partings(ref, by_vllm, want),
                     "vllm_vs_hf_bf16_identical": sum(a.completion_ids == b.completion_ids
                                                      for a, b in zip(by_vllm, by_half)),
                     "mean_len": statistics.fmean(len(w.completion_ids) for w in want), "n": len(greedy)}
    res["bf16_error_teacher_forced"] = gap_error(ref, half, want)

    settings = [(1.0, 20, 1.0), (0.7, 0, 0.9), (1.3, 5, 0.8), (0.0, 0, 1.0), (1.0, 0, 1.0), (0.5, 10, 0.95)] * 4
    sampled_reqs = [ask(q, max_tokens=32, temperature=t, top_k=k, top_p=p, seed=7 + i)
                    for i, (q, (t, k, p)) in enumerate(zip(QUESTIONS, settings))]
    res["logprobs"] = logprob_error(ref, half, v.generate(sampled_reqs), settings)

    # reloads of the checkpoint's own weights: nothing may change
    from safetensors.torch import load_file

    disk = {k: t for f in sorted(Path(args.policy).glob("*.safetensors")) for k, t in load_file(str(f)).items()}
    res["disk_keys"] = {"n": len(disk), "has_lm_head": "lm_head.weight" in disk}
    base = [o.completion_ids for o in by_vllm]
    reloads = {}
    for name, state in [("own_bf16_gpu", {k: t.to(args.device, torch.bfloat16) for k, t in disk.items()}),
                        ("own_fp32_cpu", {k: t.float() for k, t in disk.items()}),
                        ("own_fp32_gpu_plan", {k: t.to(args.device, torch.float32) for k, t in disk.items()})]:
        v.load_weights(state, v.version + 1)
        now = [o.completion_ids for o in v.generate(greedy)]
        reloads[name] = {"identical": sum(a == b for a, b in zip(now, base)),
                         "path": getattr(v, "last_reload", {}).get("path"), "plan": getattr(v, "plan_status", None)}
    res["reload_own_weights"] = reloads

    # perturbed weights (noise relative to each tensor's spread, and the old GPU test's absolute 0.02); both
    # references on the same bf16-rounded weights
    perturbed = {}
    own = {k: t.detach().cpu() for k, t in ref.model.state_dict().items()}
    for label, scale, relative in (("rel0.01", 0.01, True), ("rel0.05", 0.05, True), ("abs0.02", 0.02, False)):
        g = torch.Generator().manual_seed(0)
        new = {k: t + scale * (t.float().std().clamp_min(1e-3) if relative else 1.0) * torch.randn(t.shape, generator=g)
               for k, t in own.items() if not (res["tied"] and k == "lm_head.weight")}
        rounded = {k: t.to(torch.bfloat16).float() for k, t in new.items()}
        if res["tied"]:
            rounded["lm_head.weight"] = rounded["model.embed_tokens.weight"]
        v.load_weights({k: t.to(args.device, torch.bfloat16) for k, t in new.items()}, v.version + 1)
        ref.load_weights(rounded, v.version)
        half.load_weights(rounded, v.version)
        w2, h2, v2 = ref.generate(greedy), half.generate(greedy), v.generate(greedy)
        perturbed[label] = {"hf_bf16": partings(ref, h2, w2), "vllm": partings(ref, v2, w2),
                            "changed_vs_base": sum(a.completion_ids != b for a, b in zip(v2, base)),
                            "bf16_error_teacher_forced": gap_error(ref, half, w2)}
    res["reload_perturbed"] = perturbed
    if hasattr(v, "close"):
        v.close()
    text = json.dumps(res, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
