"""An RSFT step on the GPU by itself: where a run's slow first steps come from.

In a `whale run` on the GPU (benchmarks/gpu_whale_run.py) a weight phase's first step took several times the later
ones, and every step many times its arithmetic. Here the learner runs alone (no Ray, no vLLM beside it), built as
the Trainer's workers build it (`weight.precision` resolved for the checkpoint: bfloat16 autocast on a GPU), on steps
shaped like a run's (`--examples` accepted calls of prompt and completion lengths drawn from the given ranges), in
two fresh processes side by side:

    cold     the learner's steps in a process that has run nothing on the GPU (a Trainer worker's first step)
    warm     the same after a thrown-away step of a throwaway learner in that process; then a second learner
             that hands its cache back to the driver after every step (`torch.cuda.empty_cache()`, what a worker
             beside a sleeping vLLM does when the GPU is short of room)

Printed: every step's seconds and its split (prepare / forward+backward+clip / AdamW: rsft.RSFTLearner's metrics),
then the first step and the median of the later ones per learner, and their ratios.

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


def run(learner: RSFTLearner, steps: list, empty_cache: bool) -> list[dict]:
    out = []
    for examples in steps:
        t0 = time.perf_counter()
        m = learner.train_step(examples)
        if empty_cache and learner.device.type == "cuda":
            torch.cuda.empty_cache()
        out.append({"wall_s": time.perf_counter() - t0, **{k: m[k] for k in ("prepare_s", "pass_s", "update_s")}})
    return out


def one_process(args: argparse.Namespace) -> dict:
    """This process's learners (args.one: cold or warm) and their steps' times."""
    lo_hi = [tuple(int(x) for x in s.split(",")) for s in (args.prompt_tokens, args.completion_tokens)]
    t0 = time.perf_counter()
    learner = learner_for(args)
    out: dict = {"built_s": time.perf_counter() - t0}
    vocab = learner.model.get_input_embeddings().num_embeddings
    steps = steps_of(args.steps, args.examples, *lo_hi, vocab=vocab, seed=0)
    if args.one == "warm":
        t0 = time.perf_counter()
        throwaway = learner_for(args)
        throwaway.train_step(steps_of(1, args.examples, *lo_hi, vocab=vocab, seed=1)[0])
        del throwaway
        if args.device != "cpu":
            torch.cuda.synchronize()
        out["warm_up_s"] = time.perf_counter() - t0
    out["kept"] = run(learner, steps, empty_cache=False)
    if args.one == "warm":
        del learner
        out["emptied"] = run(learner_for(args), steps, empty_cache=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a Hugging Face checkpoint directory")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--examples", type=int, default=72, help="accepted calls per step")
    ap.add_argument("--prompt-tokens", default="120,260", help="lo,hi of a prompt's length")
    ap.add_argument("--completion-tokens", default="8,48", help="lo,hi of a completion's length")
    ap.add_argument("--one", choices=("cold", "warm"), help=argparse.SUPPRESS)  # a child process's part
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one_process(args)))
        return
    results = {}
    for one in ("cold", "warm"):
        proc = subprocess.run([sys.executable, *sys.argv, "--one", one], capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"the {one} process failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
        results[one] = json.loads(proc.stdout.strip().splitlines()[-1])
    rows = {}
    for name, times in (("cold", results["cold"]["kept"]), ("warm", results["warm"]["kept"]),
                        ("warm, emptied", results["warm"]["emptied"])):
        print(f"{name}:")
        for i, t in enumerate(times):
            print(f"  step {i}: {t['wall_s']:.3f} s (prepare {t['prepare_s']:.3f}, pass {t['pass_s']:.3f}, "
                  f"update {t['update_s']:.3f})")
        rows[name] = (times[0]["wall_s"], statistics.median(t["wall_s"] for t in times[1:]))
    print(f"\nlearners built in {results['cold']['built_s']:.2f} s (cold) and {results['warm']['built_s']:.2f} s; "
          f"the warm process's thrown-away step {results['warm']['warm_up_s']:.2f} s")
    print(f"{'learner':<14} {'first s':>8} {'later s':>8} {'first/later':>12}")
    for name, (first, later) in rows.items():
        print(f"{name:<14} {first:8.3f} {later:8.3f} {first / later:12.2f}")
    print(f"first step, cold / warm: {rows['cold'][0] / rows['warm'][0]:.2f}; "
          f"later steps, emptied / kept: {rows['warm, emptied'][1] / rows['warm'][1]:.2f}")


if __name__ == "__main__":
    main()
