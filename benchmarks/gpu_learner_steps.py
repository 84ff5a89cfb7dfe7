"""An RSFT step on the GPU by itself: is a run's slow first step the learner's, and what does `empty_cache` cost?

In a `whale run` on the GPU (benchmarks/gpu_whale_run.py) a weight phase's first step took several times the later
ones on the Trainer's clock. Here the learner runs alone in this process (no Ray, no vLLM beside it), built as the
Trainer's workers build it (`weight.precision` resolved for the checkpoint: bfloat16 autocast on a GPU), on steps
shaped like a run's (`--examples` accepted calls of prompt and completion lengths drawn from the given ranges).
Two learners in turn, each for `--steps` steps: one hands its cache back to the driver after every step, as a
worker beside a sleeping vLLM does (`torch.cuda.empty_cache()`), one keeps it. Printed: every step's seconds and
its split (prepare / forward+backward+clip / AdamW, rsft.RSFTLearner's metrics), then per learner its first step
and the median of the later ones, side by side.

    python benchmarks/gpu_learner_steps.py --model ~/smollm2
    python benchmarks/gpu_learner_steps.py --model /tmp/tiny --device cpu --steps 3     # a CPU check
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from whale_ray.config import WeightPhaseConfig
from whale_ray.rsft import RSFTLearner
from whale_ray.rsft_defaults import describe_checkpoint, resolve_weight_phase


def steps_of(n_steps: int, n_examples: int, prompt: tuple[int, int], completion: tuple[int, int], vocab: int,
             seed: int) -> list[list[tuple[list[int], list[int]]]]:
    rng = random.Random(seed)

    def ids(lo: int, hi: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(rng.randint(lo, hi))]

    return [[(ids(*prompt), ids(*completion)) for _ in range(n_examples)] for _ in range(n_steps)]


def run(learner: RSFTLearner, steps: list, empty_cache: bool) -> list[dict]:
    out = []
    for examples in steps:
        t0 = time.perf_counter()
        m = learner.train_step(examples)
        if empty_cache and learner.device.type == "cuda":
            torch.cuda.empty_cache()
        out.append({"wall_s": time.perf_counter() - t0, **{k: m[k] for k in ("prepare_s", "pass_s", "update_s")}})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a Hugging Face checkpoint directory")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--examples", type=int, default=72, help="accepted calls per step")
    ap.add_argument("--prompt-tokens", default="120,260", help="lo,hi of a prompt's length")
    ap.add_argument("--completion-tokens", default="8,48", help="lo,hi of a completion's length")
    args = ap.parse_args()
    use_gpu = args.device != "cpu"
    w = resolve_weight_phase(WeightPhaseConfig(use_gpu=use_gpu), describe_checkpoint(args.model))
    lo_hi = [tuple(int(x) for x in s.split(",")) for s in (args.prompt_tokens, args.completion_tokens)]
    rows = {}
    for empty_cache in (True, False):
        t0 = time.perf_counter()
        learner = RSFTLearner(args.model, device=args.device, lr=w.learning_rate, micro_batch=w.micro_batch,
                              warmup_steps=w.warmup_steps, max_grad_norm=w.max_grad_norm, precision=w.precision)
        built = time.perf_counter() - t0
        vocab = learner.model.get_input_embeddings().num_embeddings
        steps = steps_of(args.steps, args.examples, *lo_hi, vocab=vocab, seed=0)
        name = "empty_cache" if empty_cache else "cache kept"
        print(f"{name}: learner built in {built:.2f} s ({w.precision}, micro_batch {w.micro_batch})")
        times = run(learner, steps, empty_cache)
        for i, t in enumerate(times):
            print(f"  step {i}: {t['wall_s']:.3f} s (prepare {t['prepare_s']:.3f}, pass {t['pass_s']:.3f}, "
                  f"update {t['update_s']:.3f})")
        rows[name] = (times[0]["wall_s"], statistics.median(t["wall_s"] for t in times[1:]))
        del learner
        if use_gpu:
            torch.cuda.empty_cache()
    print(f"\n{'learner':<12} {'first s':>8} {'later s':>8} {'first/later':>12}")
    for name, (first, later) in rows.items():
        print(f"{name:<12} {first:8.3f} {later:8.3f} {first / later:12.2f}")
    (_, kept), (_, emptied) = rows["cache kept"], rows["empty_cache"]
    print(f"later steps, empty_cache / cache kept: {emptied / kept:.2f}")


if __name__ == "__main__":
    main()
