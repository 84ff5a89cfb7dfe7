"""Per-episode overhead of the sandbox (whale_ray/sandbox), and episode throughput with concurrent slots.

    python benchmarks/sandbox_overhead.py [--episodes 40] [--throughput-episodes 48]

Prints, side by side, the latency of a trivial harness episode under bubblewrap, under
isolation="unsafe_none" (same runtime, no namespaces) and of a bare `python -I -S -c pass`
subprocess: start -> first RPC (the harness's first agent.generate reaching the host) and the full
episode including teardown. Then episodes/second with 1, 4 and 16 concurrent slots (threads of one
process, as the SandboxEvaluator runs them). Takes well under a minute on 2 cores.
"""

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--episodes", type=int, default=40, help="sequential episodes per variant")
    ap.add_argument("--throughput-episodes", type=int, default=48, help="episodes per concurrency level")
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
    print(f"throughput under bwrap, {args.throughput_episodes} episodes per row (threads of one process)")
    for slots in (1, 4, 16):
        print(f"  {slots:2d} slots: {throughput(slots, args.throughput_episodes):6.1f} episodes/s")


if __name__ == "__main__":
    main()
