"""Per-episode overhead of the sandbox (whale_ray/sandbox), and episode throughput with concurrent slots.

    python benchmarks/sandbox_overhead.py [--episodes 40] [--throughput-episodes 48] [--processes 1,2,4,8]

Prints, side by side, the latency of a trivial harness episode under bubblewrap, under
isolation="unsafe_none" (same runtime, no namespaces) and of a bare `python -I -S -c pass`
subprocess: start -> first RPC (the harness's first agent.generate reaching the host) and the full
episode including teardown. Then episodes/second with 1, 4 and 16 concurrent slots (threads of one
process, as the SandboxEvaluator runs them), each twice: in a process that is a child subreaper, as the
SandboxEvaluator is (the teardown reaps the sandbox's pid-namespace init itself and gives the slot's uid
back at once), and in one that is not (the init goes to the host's pid 1 and the uid pool scans /proc
before giving the uid back). --processes adds the pool across processes: P processes x S slots each,
the same episodes in flight in every row (--in-flight), as several SandboxEvaluators on one node run them.
Takes well under a minute on 2 cores without --processes."""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from whale_ray.records import ModelCall  # noqa: E402
from whale_ray.sandbox import (  # noqa: E402
    SandboxLimits,
    isolation,  # noqa: E402
    run_episode,
)
from whale_ray.sandbox.episode import become_subreaper  # noqa: E402

HARNESS = '''
def run(task, agent):
    text = agent.generate([{"role": "user", "content": task["question"]}], max_tokens=8)
    agent.log("answer", text=text)
    return text
'''
TASK = {"id": "bench", "question": "1+1?"}


class FirstCall:
    """A generate callback that notes when the first RPC of an episode arrives."""

    def __init__(self) -> None:
        self.t: float | None = None

    def __call__(self, messages, sampling):
        if self.t is None:
            self.t = time.perf_counter()
        return ModelCall(messages=messages, text="2", prompt_ids=[1], completion_ids=[2], logprobs=[0.0],
                         weight_version=0, finish_reason="stop")


def episode(isolation_mode: str, seed: int) -> tuple[float, float]:
    gen = FirstCall()
    t0 = time.perf_counter()
    r = run_episode(HARNESS, TASK, generate=gen, tools_path=None, host_tools={},
                    limits=SandboxLimits(isolation=isolation_mode), seed=seed)
    t1 = time.perf_counter()
    if r.status != "ok":
        raise SystemExit(f"benchmark episode failed under {isolation_mode}: {r.status}: {r.reason}")
    assert gen.t is not None
    return (gen.t - t0) * 1e3, (t1 - t0) * 1e3


def bare(n: int) -> list[float]:
    exe = isolation.interpreter_path()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        subprocess.run([exe, "-I", "-S", "-c", "pass"], check=True)
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def fmt(xs: list[float]) -> str:
    xs = sorted(xs)
    p90 = xs[min(len(xs) - 1, int(0.9 * len(xs)))]
    return f"{statistics.mean(xs):7.1f} {statistics.median(xs):7.1f} {p90:7.1f}"


def throughput(slots: int, n: int) -> float:
    lock = threading.Lock()
    done = [0]

    def one(i: int) -> None:
        episode("bwrap", i)
        with lock:
            done[0] += 1

    t0 = time.perf_counter()
    with ThreadPoolExecutor(slots) as pool:
        list(pool.map(one, range(n)))
    return done[0] / (time.perf_counter() - t0)


def one_process(slots: int, n: int, start, out) -> None:
    """A pool member: `n` episodes at `slots` in flight, timed from `start` (all members at once)."""
    become_subreaper()
    isolation.bwrap_launcher()
    episode("bwrap", 0)
    start.wait()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(slots) as pool:
        list(pool.map(lambda i: episode("bwrap", i), range(n)))
    out.put((t0, time.perf_counter()))


def across_processes(processes: int, slots: int, n: int) -> float:
    """Episodes/s of `processes` processes with `slots` threads each, `n` episodes each."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=one_process, args=(slots, n, start, out)) for _ in range(processes)]
    for p in procs:
        p.start()
    time.sleep(2.0 + 0.3 * processes)  # every member warmed up (interpreter mirror, first episode)
    start.set()
    spans = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    return processes * n / (max(e for _, e in spans) - min(t for t, _ in spans))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--episodes", type=int, default=40, help="sequential episodes per variant")
    ap.add_argument("--throughput-episodes", type=int, default=48, help="episodes per concurrency level")
    ap.add_argument("--processes", default="", help="comma-separated process counts for the pool across processes")
    ap.add_argument("--in-flight", type=int, default=16, help="episodes in flight in every --processes row")
    args = ap.parse_args()
    n = args.episodes

    isolation.bwrap_launcher()  # probe and interpreter mirror, once, outside the timings
    for mode in ("bwrap", "unsafe_none"):
        episode(mode, 0)
    bare(2)

    rows = {"bare": bare(n)}
    for mode in ("unsafe_none", "bwrap"):
        firsts, fulls = zip(*(episode(mode, i) for i in range(n)))
        rows[f"{mode} first"] = list(firsts)
        rows[f"{mode} full"] = list(fulls)

    base = statistics.mean(rows["bare"])
    print(f"sequential, {n} episodes each (ms)         mean     p50     p90   x bare")
    labels = {
        "bare": "bare `python -I -S -c pass`",
        "unsafe_none first": "unsafe_none: start -> first RPC",
        "unsafe_none full": "unsafe_none: full episode + teardown",
        "bwrap first": "bwrap: start -> first RPC",
        "bwrap full": "bwrap: full episode + teardown",
    }
    for key, label in labels.items():
        xs = rows[key]
        print(f"  {label:38s} {fmt(xs)}   {statistics.mean(xs) / base:5.2f}")
    extra = statistics.mean(rows["bwrap full"]) - statistics.mean(rows["unsafe_none full"])
    print(f"  bubblewrap's own cost per episode: {extra:+.1f} ms")
    print()
    print(f"throughput under bwrap, {args.throughput_episodes} episodes per row (threads of one process), episodes/s")
    print("  slots   subreaper   /proc scan   ratio")
    for slots in (1, 4, 16):
        become_subreaper(False)
        scan = throughput(slots, args.throughput_episodes)
        become_subreaper()
        reaped = throughput(slots, args.throughput_episodes)
        print(f"  {slots:5d}   {reaped:9.1f}   {scan:10.1f}   {reaped / scan:5.2f}x")
    if args.processes:
        print()
        print(f"the pool across processes, {args.in_flight} episodes in flight, "
              f"{args.throughput_episodes} episodes per process")
        base = None
        for p in (int(x) for x in args.processes.split(",")):
            slots = max(1, args.in_flight // p)
            rate = across_processes(p, slots, args.throughput_episodes)
            base = base or rate
            print(f"  {p:3d} processes x {slots:3d} slots: {rate:7.1f} episodes/s   {rate / base:5.2f}x the first row")


if __name__ == "__main__":
    main()
