"""The same engine, driven the same way, in this process and in a Ray actor: does a Ray worker's process slow it?

    python benchmarks/engine_in_worker.py --model DIR [--device cuda] [--levels 1,32] [--rounds 3]
        [--setups here,here-thread,actor-async,actor-sync] [--profile SECONDS --profile-dir DIR]

The endpoint's engine runs in a Ray worker (a Serve replica, or its engine actor); benchmarks/serve_throughput.py
compares it with the engine in the benchmark's own process. This takes Serve, HTTP and the hop out: `PolicyService`
with closed-loop clients (each awaits its requests one after another, T 1, top-k 20, 32 max tokens, seeded), the
clients' event loop
- here: in this process's main thread (as the benchmark's in-process side runs);
- here-thread: in a thread of this process started for the round (as a Ray async actor's loop runs: not the main thread);
- actor-async: in an async Ray actor given the same CPUs and GPU (its loop in the thread Ray gives async actors);
- actor-sync: in a threaded Ray actor's method, `asyncio.run` on the worker's main thread.
Rounds are interleaved, the best of each kept; besides requests/s each round gives the engine's steps/s and rows per
step, so a slower setup shows whether its steps are slower or emptier. Then what differs between the processes
(torch threads, GC thresholds, tracing hooks, the environment variables that differ). With --profile, py-spy (on
PATH) records each setup's process under the last level's load: each thread's share of the time it was running.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import ray
import torch
from serve_throughput import thread_samples  # this folder is on sys.path when the script runs

RATE = 100  # py-spy's samples per second
MESSAGES = [{"role": "system", "content": "Solve the problem. You can run python."},
            {"role": "user", "content": "Tom has 3 apples and buys 4 more. How many apples does he have?"}]


class Driver:
    """A PolicyService and closed-loop clients, wherever it is made."""

    def __init__(self, model: str, device: str, threads: int):
        from whale_ray.policy.serving import PolicyService

        torch.set_num_threads(threads)
        self.service = PolicyService(model, device=device)

    async def round(self, clients: int, per_client: int) -> tuple[float, float, float]:
        """(requests/s, engine steps/s, rows per step) of one round."""
        from whale_ray.records import SamplingParams

        async def client(i: int) -> None:
            for j in range(per_client):
                await self.service.generate(MESSAGES, SamplingParams(max_tokens=32, temperature=1.0, top_k=20,
                                                                     seed=i * 1000 + j))
        before = self.service.stats()
        t0 = time.perf_counter()
        await asyncio.gather(*(client(i) for i in range(clients)))
        wall = time.perf_counter() - t0
        after = self.service.stats()
        steps = after["batches"] - before["batches"]
        return clients * per_client / wall, steps / wall, (after["tokens"] - before["tokens"]) / max(steps, 1)

    def round_in_thread(self, clients: int, per_client: int) -> tuple[float, float, float]:
        box: list = []
        t = threading.Thread(target=lambda: box.append(asyncio.run(self.round(clients, per_client))))
        t.start()
        t.join()
        return box[0]

    def pid(self) -> int:
        return os.getpid()

    def process(self) -> dict:
        return {"torch threads": torch.get_num_threads(), "interop threads": torch.get_num_interop_threads(),
                "gc thresholds": gc.get_threshold(), "gc frozen": gc.get_freeze_count(),
                "trace hook": repr(sys.gettrace()), "profile hook": repr(sys.getprofile()),
                "switch interval": sys.getswitchinterval(), "nice": os.nice(0),
                "affinity": len(os.sched_getaffinity(0)), "threads": threading.active_count(),
                "env": dict(os.environ)}


class SyncDriver:
    """The Driver in a threaded actor: no async method, so Ray runs its calls on the worker's main thread."""

    def __init__(self, model: str, device: str, threads: int):
        self.driver = Driver(model, device, threads)

    def round(self, clients: int, per_client: int) -> tuple[float, float, float]:
        return asyncio.run(self.driver.round(clients, per_client))

    def pid(self) -> int:
        return os.getpid()

    def process(self) -> dict:
        return self.driver.process()


def spy(pid: int, seconds: int, out: Path) -> subprocess.Popen:
    return subprocess.Popen(["py-spy", "record", "--threads", "--nonblocking", "-r", str(RATE), "-d",
                             str(seconds), "-f", "raw", "-o", str(out), "-p", str(pid)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def thread_shares(path: Path, seconds: int) -> str:
    """Per thread, the share of the profile's time it was running (py-spy keeps only samples of running threads
    without --idle; a thread waiting for the GIL sleeps, so it is not running)."""
    total = thread_samples(path)
    return ", ".join(f"{t[:48]} {n / (RATE * seconds):.0%}" for t, n in sorted(total.items(), key=lambda kv: -kv[1])[:6])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--levels", default="1,32")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests-per-client", type=int, default=4)
    ap.add_argument("--setups", default="here,here-thread,actor-async,actor-sync")
    ap.add_argument("--profile", type=int, default=0, help="seconds of py-spy per setup under the last level")
    ap.add_argument("--profile-dir", default="engine-profiles")
    args = ap.parse_args()
    setups = args.setups.split(",")
    gpus = 1 if args.device.startswith("cuda") else 0
    os.environ.setdefault("RAY_worker_niceness", "0")
    ray.init(address="local", num_cpus=max(2 * args.threads, os.cpu_count() or 1), num_gpus=gpus,
             include_dashboard=False, log_to_driver=False)
    try:
        here = Driver(args.model, args.device, args.threads)
        actors = {"actor-async": ray.remote(Driver), "actor-sync": ray.remote(SyncDriver)}
        gpu_share = gpus / max(1, sum(s in actors for s in setups))
        remote = {s: actors[s].options(num_cpus=args.threads, num_gpus=gpu_share).remote(args.model, args.device,
                                                                                         args.threads)
                  for s in setups if s in actors}
        run = {"here": lambda c, n: asyncio.run(here.round(c, n)), "here-thread": here.round_in_thread,
               **{s: (lambda a: lambda c, n: ray.get(a.round.remote(c, n)))(a) for s, a in remote.items()}}
        for s in setups:
            run[s](1, 1)  # warm-up
        print("clients | " + " | ".join(f"{s} req/s (steps/s, rows)" for s in setups))
        for c in [int(x) for x in args.levels.split(",")]:
            best = {s: (0.0, 0.0, 0.0) for s in setups}
            for _ in range(args.rounds):
                for s in setups:
                    best[s] = max(best[s], run[s](c, args.requests_per_client))
            print(f"{c} | " + " | ".join(f"{r:.2f} ({st:.1f}, {rows:.1f})" for r, st, rows in best.values()) +
                  " | ratios to here: " + ", ".join(f"{s} {best[s][0] / best[setups[0]][0]:.2f}" for s in setups[1:]),
                  flush=True)
        if args.profile:
            out = Path(args.profile_dir)
            out.mkdir(parents=True, exist_ok=True)
            pids = {s: (os.getpid() if s.startswith("here") else ray.get(remote[s].pid.remote())) for s in setups}
            last = int(args.levels.split(",")[-1])
            for s in setups:
                proc = spy(pids[s], args.profile, out / f"{s}.txt")
                while proc.poll() is None:
                    run[s](last, args.requests_per_client)
                f = out / f"{s}.txt"
                print(f"py-spy, {s}: " + (thread_shares(f, args.profile) if f.exists() else proc.stdout.read()[-300:]), flush=True)
        mine = here.process()
        theirs = {s: ray.get(a.process.remote()) for s, a in remote.items()}
        for s, other in theirs.items():
            for k in mine:
                if k != "env" and mine[k] != other[k]:
                    print(f"differs ({s}): {k}: here {mine[k]}, actor {other[k]}")
        env_a, env_b = mine["env"], next(iter(theirs.values()))["env"] if theirs else {}
        for k in sorted(set(env_a) | set(env_b)):
            if env_a.get(k) != env_b.get(k) and not k.startswith(("RAY_", "PYTHONPATH")):
                print(f"env differs: {k}: here {env_a.get(k)!r:.80}, actor {env_b.get(k)!r:.80}")
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
