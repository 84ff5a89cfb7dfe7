"""The evaluator pool's dispatch overhead and the PolicyServer's recovery time, measured side by side in one run.

    .venv/bin/python benchmarks/cluster_pool.py [--episodes 96]

1. Dispatch: episodes/s of a harness that answers at once (no model call), through `run_episode` in a plain
   loop, through the pool with one evaluator of one slot (the same serial work, plus queue, chunks and Ray
   calls), and through an elastic pool on 1 and on 3 nodes (ray.cluster_utils.Cluster on this machine: the
   nodes share its cores, so 3 nodes measure dispatch across raylets, not more hardware).
2. Recovery: a PolicyServer (max_restarts, max_task_retries) answering a stream of generate calls is
   SIGKILLed; seconds from the kill until a call is answered again, and how many calls failed (retried by Ray,
   none should).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from actors.evaluator_pool import EvaluatorPool  # noqa: E402
from actors.policy_server import PolicyServer  # noqa: E402
from whale_ray.config import DataConfig, SandboxConfig  # noqa: E402
from whale_ray.domain import get_domain  # noqa: E402
from whale_ray.loop import EpisodeWork  # noqa: E402
from whale_ray.policy.tiny import build_embedded_policy  # noqa: E402
from whale_ray.records import EpisodeJob, SamplingParams  # noqa: E402
from whale_ray.sandbox import SandboxLimits, run_episode  # noqa: E402
from whale_ray.storage import default_cache_dir  # noqa: E402

AT_ONCE = "def run(task, agent):\n    return '\\\\boxed{1}'\n"


def jobs(n: int) -> list[EpisodeJob]:
    tasks = get_domain("math_reasoning").load_splits(DataConfig(n_harness=16), 0).harness
    return [EpisodeJob(task=tasks[i % len(tasks)], seed=i) for i in range(n)]


def plain_loop(work: list[EpisodeJob]) -> float:
    """What an evaluator does per episode (the domain's tools included), one after another in this process."""
    d, limits = get_domain("math_reasoning"), SandboxLimits.from_config(SandboxConfig())
    tools = d.sandbox_tools_path if d.sandbox_tools_path.exists() else None
    t0 = time.perf_counter()
    for job in work:
        ep = run_episode(AT_ONCE, job.task.public(), generate=None, tools_path=tools,
                         host_tools={**d.host_tools({}), **d.episode_tools(job.task, {})}, limits=limits, seed=job.seed,
                         harness_name="h.py")
        assert ep.status == "ok", ep.reason
    return len(work) / (time.perf_counter() - t0)


def through_pool(work: list[EpisodeJob], **sandbox) -> float:
    pool = EvaluatorPool("math_reasoning", None, SandboxConfig(**sandbox), poll_s=0.5)
    pool.run([EpisodeWork(AT_ONCE, "h.py", work[:4])], lambda n: None)  # evaluators up and warm
    t0 = time.perf_counter()
    (results,) = pool.run([EpisodeWork(AT_ONCE, "h.py", work)], lambda n: None)
    rate = len(work) / (time.perf_counter() - t0)
    assert all(r.status == "ok" for r in results)
    for actor in pool.actors:
        ray.kill(actor)
    return rate


def recovery(model: str) -> tuple[float, int, int]:
    server = PolicyServer.options(max_restarts=1, max_task_retries=-1).remote(model)
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    sampling = SamplingParams(max_tokens=4, temperature=0.0)
    ray.get(server.generate.remote(messages, sampling))
    answered: list[float] = []
    failed = [0]
    stop = threading.Event()

    def client() -> None:
        while not stop.is_set():
            try:
                ray.get(server.generate.remote(messages, sampling))
                answered.append(time.perf_counter())
            except ray.exceptions.RayError:
                failed[0] += 1

    threads = [threading.Thread(target=client, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(2.0)
    pid = ray.get(server.__ray_call__.remote(lambda self: os.getpid()))
    killed = time.perf_counter()
    os.kill(pid, signal.SIGKILL)
    while not any(t > killed + 0.05 for t in answered):
        time.sleep(0.05)
    back = min(t for t in answered if t > killed + 0.05)
    stop.set()
    for t in threads:
        t.join(timeout=60)
    ray.kill(server)
    return back - killed, failed[0], len(answered)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--episodes", type=int, default=96)
    args = ap.parse_args()
    console = Console(width=150)
    work = jobs(args.episodes)
    model = str(build_embedded_policy(get_domain("math_reasoning"), cache_dir=default_cache_dir(), progress=False,
                                      warmstart_steps=60, seed=0))  # the tests' small policy: any policy will do

    rates = {"run_episode, plain loop": plain_loop(work)}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    ray.init(address=cluster.address, log_to_driver=False)
    rates["pool, 1 evaluator x 1 slot (1 node)"] = through_pool(work, slots=1, chunk=1, evaluators=1)
    rates["pool, auto, slots 4 (1 node)"] = through_pool(work, slots=4, evaluators={"min": 1, "max": 8})
    cluster.add_node(num_cpus=2)
    cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    rates["pool, auto, slots 4 (3 nodes)"] = through_pool(work, slots=4, evaluators={"min": 1, "max": 24})
    seconds, failed, answered = recovery(model)
    ray.shutdown()
    cluster.shutdown()

    base = rates["run_episode, plain loop"]
    table = Table(title=f"dispatch: {args.episodes} episodes of a harness that answers at once")
    for h in ("path", "episodes/s", "ratio to the plain loop"):
        table.add_column(h)
    for name, rate in rates.items():
        table.add_row(name, f"{rate:.1f}", f"{rate / base:.2f}")
    console.print(table)
    console.print(f"PolicyServer SIGKILL under 4 clients: generation resumed after {seconds:.1f} s; "
                  f"{failed} calls failed (Ray retried the others), {answered} answered in all")


if __name__ == "__main__":
    main()
