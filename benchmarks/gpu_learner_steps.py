"""An RSFT step on the GPU by itself: where a run's slow first steps, and its slow later ones, come from.

In a `whale run` on the GPU (benchmarks/gpu_whale_run.py) a weight phase's first step took several times the later
ones, and some later steps several times their neighbours. Here the learner runs alone (no Ray, no vLLM beside it),
built as the Trainer's workers build it (`weight.precision` resolved for the checkpoint: bfloat16 autocast on a GPU),
on steps shaped like a run's (`--examples` accepted calls of prompt and completion lengths drawn from the given
ranges), in two fresh processes side by side:

    cold     the learner's steps in a process that has run nothing on the GPU
    warmed   the same after `RSFTLearner.warm_up()`, as a Trainer worker does when it starts

Printed: every step's seconds and its split (prepare / forward+backward+clip / AdamW: rsft.RSFTLearner's metrics),
the memory the caching allocator took from the driver in it (cudaMalloc calls, and retries after a failed one) and
the shape of its passes (its widest micro-batch, the positions run, padding included); then the first step and the
median of the later ones per process, and their ratios.

    python benchmarks/gpu_learner_steps.py --model ~/smollm2
    python benchmarks/gpu_learner_steps.py --model /tmp/tiny --device cpu --steps 3     # a CPU check
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time

import torch

from actors.trainer import _learner_kwargs
from whale_ray.config import WeightPhaseConfig
from whale_ray.rsft import RSFTLearner


def steps_of(n_steps: int, n_examples: int, prompt: tuple[int, int], completion: tuple[int, int], vocab: int,
             seed: int) -> list[list[tuple[list[int], list[int]]]]:
    rng = random.Random(seed)

    def ids(lo: int, hi: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(rng.randint(lo, hi))]

    return [[(ids(*prompt), ids(*completion)) for _ in range(n_examples)] for _ in range(n_steps)]


def learner_for(args: argparse.Namespace) -> RSFTLearner:
    """The learner a Trainer worker builds for this checkpoint (actors/trainer.py's settings, resolved as a run would)."""
    cfg = WeightPhaseConfig(use_gpu=args.device != "cpu")
    return RSFTLearner(args.model, device=args.device, **_learner_kwargs(cfg, args.model, seed=0, max_len=None))


def allocator(device: torch.device) -> tuple[int, int]:
    if device.type != "cuda":
        return 0, 0
    stats = torch.cuda.memory_stats(device)
    return stats.get("num_device_alloc", 0), stats.get("num_alloc_retries", 0)


def run(learner: RSFTLearner, steps: list) -> list[dict]:
    out = []
    for examples in steps:
        a0, r0 = allocator(learner.device)
        t0 = time.perf_counter()
        m = learner.train_step(examples)
        a1, r1 = allocator(learner.device)
        keys = ("prepare_s", "pass_s", "update_s", "max_width", "padded_tokens")
        out.append({"wall_s": time.perf_counter() - t0, "mallocs": a1 - a0, "retries": r1 - r0,
                    **{k: m[k] for k in keys}})
    return out


def one_process(args: argparse.Namespace) -> dict:
    """This process's learner (args.one: cold or warmed) and its steps' times."""
    lo_hi = [tuple(int(x) for x in s.split(",")) for s in (args.prompt_tokens, args.completion_tokens)]
    t0 = time.perf_counter()
    learner = learner_for(args)
    out: dict = {"built_s": time.perf_counter() - t0}
    vocab = learner.model.get_input_embeddings().num_embeddings
    if args.one == "warmed":
        out["warm_up_s"] = learner.warm_up()
    out["steps"] = run(learner, steps_of(args.steps, args.examples, *lo_hi, vocab=vocab, seed=0))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a Hugging Face checkpoint directory")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--examples", type=int, default=72, help="accepted calls per step")
    ap.add_argument("--prompt-tokens", default="120,260", help="lo,hi of a prompt's length")
    ap.add_argument("--completion-tokens", default="8,48", help="lo,hi of a completion's length")
    ap.add_argument("--one", choices=("cold", "warmed"), help=argparse.SUPPRESS)  # a child process's part
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one_process(args)))
        return
    results = {}
    for one in ("cold", "warmed"):
        proc = subprocess.run([sys.executable, *sys.argv, "--one", one], capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"the {one} process failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
        results[one] = json.loads(proc.stdout.strip().splitlines()[-1])
    rows = {}
    for name, result in results.items():
        print(f"{name}:")
        for i, t in enumerate(result["steps"]):
            print(f"  step {i}: {t['wall_s']:.3f} s (prepare {t['prepare_s']:.3f}, pass {t['pass_s']:.3f}, "
                  f"update {t['update_s']:.3f}); cudaMalloc {t['mallocs']} (retries {t['retries']}); widest "
                  f"{t['max_width']}, {t['padded_tokens']} positions")
        rows[name] = (result["steps"][0]["wall_s"], statistics.median(t["wall_s"] for t in result["steps"][1:]))
    print(f"\nlearners built in {results['cold']['built_s']:.2f} s (cold) and {results['warmed']['built_s']:.2f} s; "
          f"the warm-up {results['warmed']['warm_up_s']:.2f} s")
    print(f"{'learner':<14} {'first s':>8} {'later s':>8} {'first/later':>12}")
    for name, (first, later) in rows.items():
        print(f"{name:<14} {first:8.3f} {later:8.3f} {first / later:12.2f}")
    print(f"first step, cold / warmed: {rows['cold'][0] / rows['warmed'][0]:.2f}")


if __name__ == "__main__":
    main()
