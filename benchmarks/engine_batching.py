"""Batched vs one-at-a-time generation with the transformers engine, measured in one run.

64 h0-style requests (the math domain's system prompt and questions, max_tokens 48, temperature 1.0,
top-k 20, each with its own seed so both modes sample the same tokens) are generated first one request
per `generate` call, then all in one call. Prints requests/s and completion tokens/s of each and the ratio.

    python benchmarks/engine_batching.py                      # the embedded tiny policy (built if needed)
    python benchmarks/engine_batching.py --model PATH         # any local HF checkpoint
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from whale_ray.policy.engine import GenerationRequest  # noqa: E402
from whale_ray.policy.tiny import build_embedded_policy  # noqa: E402
from whale_ray.policy.transformers_engine import TransformersEngine  # noqa: E402
from whale_ray.records import SamplingParams  # noqa: E402


def requests(n: int) -> list[GenerationRequest]:
    from domains.math_reasoning import generator, h0

    tasks = generator.generate_splits({"harness": n}, seed=0)["harness"]
    return [
        GenerationRequest(h0.build_messages(t.public()), SamplingParams(max_tokens=48, temperature=1.0, top_k=20, seed=i))
        for i, t in enumerate(tasks)
    ]


def timed(engine: TransformersEngine, batches: list[list[GenerationRequest]]) -> tuple[float, list]:
    t0 = time.perf_counter()
    outs = [o for b in batches for o in engine.generate(b)]
    return time.perf_counter() - t0, outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="checkpoint directory (default: the embedded tiny policy)")
    ap.add_argument("--warmstart-steps", type=int, default=1200, help="for the embedded policy (cached after one build)")
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    if args.model is None:
        from whale_ray.domain import get_domain

        args.model = build_embedded_policy(get_domain("math_reasoning"), warmstart_steps=args.warmstart_steps)
    engine = TransformersEngine(args.model, device=args.device, max_batch=max(64, args.n))
    reqs = requests(args.n)
    engine.generate(reqs[:2])  # warm-up

    t_one, one = timed(engine, [[r] for r in reqs])
    t_all, batched = timed(engine, [reqs])
    tokens = sum(len(o.completion_ids) for o in batched)
    same = sum(a.completion_ids == b.completion_ids for a, b in zip(one, batched))

    print(f"model {args.model}  device {args.device}  threads {args.threads}  requests {args.n}")
    print(f"completion tokens {tokens} (one-at-a-time {sum(len(o.completion_ids) for o in one)}); "
          f"{same}/{args.n} completions identical in both modes (seeded)")
    for name, t in (("one at a time", t_one), ("one batched call", t_all)):
        print(f"{name:>17}: {t:7.2f} s  {args.n / t:8.1f} requests/s  {tokens / t:9.1f} tokens/s")
    print(f"batched / one-at-a-time throughput: {t_one / t_all:.1f}x")


if __name__ == "__main__":
    main()
