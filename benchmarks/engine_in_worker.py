"""The same engine, driven the same way, in this process and in a Ray actor: does a Ray worker's process slow it?

    python benchmarks/engine_in_worker.py --model DIR [--device cuda] [--levels 1,32] [--rounds 3]

The endpoint's engine runs in a Ray worker (a Serve replica, or its engine actor); benchmarks/serve_throughput.py
compares it with the engine in the benchmark's own process. This takes Serve, HTTP and the hop out: `PolicyService`
with closed-loop clients (each awaits its requests one after another, T 1, top-k 20, 32 max tokens, seeded) inside
the driver and inside an actor given the same CPUs and GPU, rounds interleaved, the best of each; then what differs
between the two processes (torch threads, GC thresholds, tracing hooks, the environment variables that differ).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import sys
import time

import ray
import torch

MESSAGES = [{"role": "system", "content": "Solve the problem. You can run python."},
            {"role": "user", "content": "Tom has 3 apples and buys 4 more. How many apples does he have?"}]


class Driver:
    """A PolicyService and closed-loop clients, wherever it is made."""

    def __init__(self, model: str, device: str, threads: int):
        from whale_ray.policy.serving import PolicyService

        torch.set_num_threads(threads)
        self.service = PolicyService(model, device=device)

    async def round(self, clients: int, per_client: int) -> float:
        from whale_ray.records import SamplingParams

        async def client(i: int) -> None:
            for j in range(per_client):
                await self.service.generate(MESSAGES, SamplingParams(max_tokens=32, temperature=1.0, top_k=20,
                                                                     seed=i * 1000 + j))
        t0 = time.perf_counter()
        await asyncio.gather(*(client(i) for i in range(clients)))
        return clients * per_client / (time.perf_counter() - t0)

    def process(self) -> dict:
        return {"torch threads": torch.get_num_threads(), "interop threads": torch.get_num_interop_threads(),
                "gc thresholds": gc.get_threshold(), "gc frozen": gc.get_freeze_count(),
                "trace hook": repr(sys.gettrace()), "profile hook": repr(sys.getprofile()),
                "switch interval": sys.getswitchinterval(), "nice": os.nice(0),
                "affinity": len(os.sched_getaffinity(0)), "env": dict(os.environ)}


RemoteDriver = ray.remote(Driver)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--levels", default="1,32")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests-per-client", type=int, default=4)
    args = ap.parse_args()
    gpus = 1 if args.device.startswith("cuda") else 0
    os.environ.setdefault("RAY_worker_niceness", "0")
    ray.init(address="local", num_cpus=max(args.threads, os.cpu_count() or 1), num_gpus=gpus,
             include_dashboard=False, log_to_driver=False)
    try:
        here = Driver(args.model, args.device, args.threads)
        there = RemoteDriver.options(num_cpus=args.threads, num_gpus=gpus).remote(args.model, args.device, args.threads)
        asyncio.run(here.round(1, 1))
        ray.get(there.round.remote(1, 1))  # warm-up
        print(f"{'clients':>7} | {'this process req/s':>18} | {'Ray actor req/s':>15} | {'actor / here':>12}")
        for c in [int(x) for x in args.levels.split(",")]:
            a = b = 0.0
            for _ in range(args.rounds):
                a = max(a, asyncio.run(here.round(c, args.requests_per_client)))
                b = max(b, ray.get(there.round.remote(c, args.requests_per_client)))
            print(f"{c:>7} | {a:>18.2f} | {b:>15.2f} | {b / a:>12.2f}", flush=True)
        mine, theirs = here.process(), ray.get(there.process.remote())
        for k in mine:
            if k != "env" and mine[k] != theirs[k]:
                print(f"differs: {k}: here {mine[k]}, actor {theirs[k]}")
        env_a, env_b = mine["env"], theirs["env"]
        for k in sorted(set(env_a) | set(env_b)):
            if env_a.get(k) != env_b.get(k) and not k.startswith(("RAY_", "PYTHONPATH")):
                print(f"env differs: {k}: here {env_a.get(k)!r:.80}, actor {env_b.get(k)!r:.80}")
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
