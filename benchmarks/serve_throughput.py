"""The endpoint against the same engine in process, side by side in one run, and the pause a weight swap makes.

    .venv/bin/python benchmarks/serve_throughput.py [--model DIR] [--device cpu|cuda] [--presets cpu,gpu]
        [--replicas N] [--batching continuous,pass] [--levels 1,8,32] [--requests-per-client 4,16]
        [--max-tokens 32] [--client-procs 1 [--client-cores K]] [--profile SECONDS --profile-dir DIR]

For 1, 8 and 32 concurrent clients (each sends its requests one after another: a round of each length given, so
short rounds, where the clients' first and last requests weigh, sit beside longer, steadier ones): requests/s, completion
tokens/s and p50/p99 latency through the endpoint (Ray Serve, one replica or --replicas, the real `openai.AsyncOpenAI`
client over loopback HTTP, from this process or spread over --client-procs processes) and through `PolicyService`
called in this process, with the same engine settings,
device and torch threads, alternating in-process and endpoint rounds (best of each); then the ratio endpoint /
in-process of the best rounds and the median ratio of each endpoint round to the in-process round before it
(`paired`: the engine's speed drifts over minutes on a shared machine, and a pair sees one drift), each side's
mean batch per engine pass and the time an engine step took (`step ms`) (the endpoint's from its /health); for each
serve.preset (cpu: the engine in each replica's process, behind Serve's HTTP proxy; gpu: one engine actor behind
all the replicas, behind Serve's HAProxy) and each policy.batching mode, one deployment each, in turn. Then the HTTP path alone (GET /health,
no engine work) and, for a machine whose cores the engine shares with it (on CPU), the ratio it leaves the
endpoint. With --profile, each setup is then profiled under 32 clients (py-spy on the replica's and the engine's
processes; the mean time a request spent at the client, in the replica's handler and in its completion, from the
replies' Server-Timing headers). The `idle` columns: the share of each round the engine waited with nothing to run
(in process and in the endpoint); `replica CPU ms`: the replica process's CPU time per request (the HTTP path's
cost where the engine runs in an actor of its own; the engine's too with preset cpu). `--client-cores K`
puts the client processes on K cores of their own, as remote clients would be, and everything measured (this
process with its engine, Ray, the replica and its engine actor) on the others. Last, 8 streams are
read while a new checkpoint lands in the followed run directory: the longest gap between two chunks of one stream,
with and without the swap.
Sampling is seeded (temperature 1, top-k 20); the tiny embedded policy by default. With --device cuda both
engines (in process and the endpoint's) are on the GPU and the endpoint's overhead runs on the spare cores:
scripts/gpu/serve_h200.sh runs it so on the H200.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

QUESTION = "Tom has 3 apples and buys 4 more. How many apples does he have?"
MESSAGES = [{"role": "system", "content": "Solve the problem. You can run python."}, {"role": "user", "content": QUESTION}]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def run_clients(call, clients: int, per_client: int, first: int = 0) -> tuple[float, float, list[float], list]:
    """`clients` clients (numbered from `first`), each awaiting `per_client` calls in turn; call(seed) -> (completion
    tokens, seconds in the replica's handler, of it in the completion: 0, 0 in process). (start, end, latencies, those
    three summed), on the system's monotonic clock, which every process shares."""
    latencies: list[float] = []
    sums = [0, 0.0, 0.0]

    async def client(i: int) -> None:
        for j in range(per_client):
            t0 = time.monotonic()
            got = await call(i * 1000 + j)  # not `sums[0] += await ...`: that reads sums[0] before the await,
            for k, x in enumerate(got):  # and concurrent clients then overwrite each other's counts
                sums[k] += x
            latencies.append(time.monotonic() - t0)
    start = time.monotonic()
    await asyncio.gather(*(client(first + i) for i in range(clients)))
    return start, time.monotonic(), latencies, sums


def summary(wall: float, latencies: list[float], sums: list, before: dict, after: dict) -> dict[str, float]:
    """A round's numbers; `before` and `after`, the engine's counters around it (`engine_counts`), give its mean
    batch, the share of it that the engine waited with nothing to run, its steps per second and the time one took
    (forward and sampling: `step_ms`), the replica's CPU time per request (the endpoint's; 0 in process), and
    where a request's time went: at the client (its latency), in the replica's handler and its completion (the
    endpoint's Server-Timing), in the engine (from reaching it to its output) and, of that, waiting to join a
    batch."""
    n = len(latencies)
    d = {k: after[k] - before[k] for k in after}
    per = lambda x, count=n: 1e3 * x / max(1, count)  # noqa: E731 - ms per request
    return {"req_s": n / wall, "tok_s": sums[0] / wall, "p50": pct(latencies, 0.5),
            "p99": pct(latencies, 0.99), "batch": d["tokens"] / max(1, d["steps"]), "idle": d["idle_s"] / wall,
            "cpu_ms": per(d["cpu_s"]), "client_ms": per(sum(latencies)), "handler_ms": per(sums[1]),
            "completion_ms": per(sums[2]), "engine_ms": per(d["latency_s"], d["finished"]),
            "wait_ms": per(d["wait_s"], d["finished"]), "round_trip_ms": per(d["round_trip_s"], d["round_trips"]),
            "actor_ms": per(d["actor_s"], d["answered"]), "step_ms": per(d["busy_s"], d["steps"]),
            "steps_s": d["steps"] / wall, "steps_per": d["steps"] / max(1, d["finished"]),
            "prefills_per": d["prefills"] / max(1, d["finished"]),
            # how late each loop ran a timer, on average (ms): the replica's, the engine actor's
            "lag_ms": per(d["lag_s"], d["lag_ticks"]), "engine_lag_ms": per(d["engine_lag_s"], d["engine_lag_ticks"])}


def engine_counts(stats: dict, cpu_s: float = 0.0, loop: dict | None = None) -> dict[str, float]:
    """The counters `summary` reads, from a `PolicyService.stats()` (continuous: its steps are engine steps; the
    engine actor's add its loop's lag) and the replica's loop lag (`loop`, GET /health's)."""
    loop = loop or {}
    return {"lag_ticks": loop.get("lag_ticks", 0), "lag_s": loop.get("lag_s", 0.0),
            "engine_lag_ticks": stats.get("lag_ticks", 0), "engine_lag_s": stats.get("lag_s", 0.0),
            "steps": stats["batches"], "tokens": stats.get("tokens", stats["requests"]),
            "idle_s": stats.get("idle_s", 0.0), "busy_s": stats.get("busy_s", 0.0), "prefills": stats.get("prefills", 0),
            "cpu_s": cpu_s, "finished": stats.get("finished", 0),
            "wait_s": stats.get("wait_s", 0.0), "latency_s": stats.get("latency_s", 0.0),
            **{k: stats.get(k, 0) for k in ("round_trips", "round_trip_s", "answered", "actor_s")}}


def cpu_seconds(pid: int) -> float:
    """A process's user + system CPU time (it runs on this machine: the benchmark starts its own Ray)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def descendants(root: int) -> list[int]:
    """`root` and every process under it."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(Path(f"/proc/{d}/stat").read_text().rpartition(")")[2].split()[1])
            except (OSError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def pin_clients(clients: list[int], cores: int) -> str:
    """The load generator on cores of its own, as remote clients would be: every thread of the `clients` processes
    on the last `cores` cores, every other process under this one (this one, Ray's, Serve's, the replica, its
    engine's) on the rest. Processes started later inherit their parent's cores."""
    n = os.cpu_count() or 1
    theirs = set(range(n - cores, n))
    ours = set(range(n)) - theirs
    if not ours or not theirs:
        raise SystemExit(f"--client-cores {cores}: this machine has {n} cores; leave at least one to each side")
    for pid in descendants(os.getpid()):
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                os.sched_setaffinity(int(tid), theirs if pid in clients else ours)
        except OSError:  # gone meanwhile
            pass
    return f"clients on cores {min(theirs)}-{max(theirs)}, the rest on 0-{max(ours)}"


def mean_lag_ms(spans: list[dict[str, float]]) -> float:
    """The mean lateness (ms) of the timer runs in `spans` (`LoopLag.since`s of one loop or several)."""
    return 1e3 * sum(s["lag_s"] for s in spans) / max(1, sum(s["lag_ticks"] for s in spans))


async def closed_loop(call, clients: int, per_client: int, counts=None) -> dict[str, float]:
    """`run_clients` in this process, summed up (with `counts()`, the engine's counters, where given)."""
    none = engine_counts({"batches": 0, "requests": 0})
    before = await counts() if counts else none
    start, end, latencies, sums = await run_clients(call, clients, per_client)
    after = await counts() if counts else none
    return summary(end - start, latencies, sums, before, after)


def in_process_call(model: str, max_tokens: int, wait_ms: float, batching: str, device: str):
    from whale_ray.policy.serving import PolicyService
    from whale_ray.records import SamplingParams

    service = PolicyService(model, device=device, batch_wait_ms=wait_ms, batching=batching)

    async def call(seed: int) -> tuple[int, float, float]:
        out = await service.generate(MESSAGES, SamplingParams(max_tokens=max_tokens, temperature=1.0, top_k=20,
                                                              seed=seed))
        return len(out.completion_ids), 0.0, 0.0

    async def counts() -> dict[str, float]:
        return engine_counts(service.stats())
    return call, counts


# the engine's own counters (engine_counts); the rest are each replica's (its CPU, its loop's lag, its hop)
ENGINE_KEYS = ("steps", "tokens", "idle_s", "busy_s", "prefills", "finished", "wait_s", "latency_s", "answered",
               "actor_s", "engine_lag_ticks", "engine_lag_s")


def replica_urls(url: str, c) -> list[str]:
    """Each replica's own base URL, to read every replica's /health: with preset gpu their own HTTP servers on the
    ports above the endpoint's HAProxy (whale_ray/serve/app.py `_haproxy_env`); otherwise the endpoint's."""
    import httpx2

    base = url.removesuffix("/v1")
    if c.preset != "gpu":
        return [base]
    host, found = base.rpartition(":")[0], {}
    for port in range(c.port + 1, c.port + 1 + 2 * c.replicas):
        try:
            found.setdefault(httpx2.get(f"{host}:{port}/health", timeout=2).json()["pid"], f"{host}:{port}")
        except httpx2.HTTPError:
            continue
    if len(found) != c.replicas:
        raise SystemExit(f"found {len(found)} of the {c.replicas} replicas on ports {c.port + 1}-{c.port + 2 * c.replicas}")
    return list(found.values())


def endpoint_call(url: str, max_tokens: int, fronts: list[str] | None = None, shared: bool = False):
    """The endpoint's client call, and its counters from every replica's /health (`fronts`; summed; with a
    shared engine its own counters once)."""
    import openai

    ac: list = []

    async def call(seed: int) -> tuple[int, float, float]:
        if not ac:  # made in the running event loop
            ac.append(openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=600))
        raw = await ac[0].chat.completions.with_raw_response.create(
            model="whale-latest", messages=MESSAGES, max_tokens=max_tokens, temperature=1.0, seed=seed,
            extra_body={"top_k": 20})
        timing = dict(x.strip().split(";dur=") for x in raw.headers["server-timing"].split(","))
        return raw.parse().usage.completion_tokens, float(timing["handler"]) / 1e3, float(timing["completion"]) / 1e3

    async def counts() -> dict[str, float]:
        import httpx2

        async with httpx2.AsyncClient() as c:
            healths = [(await c.get(f + "/health")).json() for f in fronts or [url.removesuffix("/v1")]]
        each = [engine_counts(h["batches"]["whale-latest"], cpu_seconds(h["pid"]), h.get("loop")) for h in healths]
        total = {k: sum(e[k] for e in each) for k in each[0]}
        return {**total, **{k: each[0][k] for k in ENGINE_KEYS}} if shared else total

    async def close() -> None:  # in the loop that made the client (else its connections close after the loop)
        if ac:
            await ac.pop().close()
    call.close = close
    return call, counts


def _client_process(conn, url: str, max_tokens: int) -> None:
    """One process of endpoint clients (--client-procs): runs the closed loops the parent sends, (first client,
    clients, requests each), and sends back (start, end, latencies, completion tokens), on the system's monotonic
    clock, which every process shares."""
    from whale_ray.serve.lag import LoopLag

    call, _ = endpoint_call(url, max_tokens)
    lag = LoopLag()

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        lag.start()
        while (job := await loop.run_in_executor(None, conn.recv)) is not None:
            first, clients, per_client = job  # the seeds of clients first.. are those the in-process clients use
            before = lag.stats()
            got = await run_clients(call, clients, per_client, first)
            conn.send((*got, lag.since(before)))
        await call.close()
    asyncio.run(serve())


class ClientProcesses:
    """The endpoint's clients spread over `n` processes (real clients do not share one Python process, whose
    event loop and the openai client's parsing would otherwise bound the endpoint at many clients)."""

    def __init__(self, n: int, url: str, max_tokens: int):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.conns, self.procs = [], []
        for _ in range(n):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_client_process, args=(child, url, max_tokens), daemon=True)
            p.start()
            self.conns.append(parent)
            self.procs.append(p)

    async def round(self, clients: int, per_client: int, counts) -> dict[str, float]:
        loop = asyncio.get_running_loop()
        before = await counts()
        n = len(self.conns)
        sizes = [clients // n + (k < clients % n) for k in range(n)]
        busy = [(conn, sum(sizes[:k]), size) for k, (conn, size) in enumerate(zip(self.conns, sizes)) if size]
        for conn, first, size in busy:
            conn.send((first, size, per_client))
        replies = await asyncio.gather(*(loop.run_in_executor(None, conn.recv) for conn, _, _ in busy))
        after = await counts()
        wall = max(r[1] for r in replies) - min(r[0] for r in replies)
        return {**summary(wall, [x for r in replies for x in r[2]], [sum(x) for x in zip(*(r[3] for r in replies))],
                          before, after), "client_lag_ms": mean_lag_ms([r[4] for r in replies])}

    def close(self) -> None:
        for conn, p in zip(self.conns, self.procs):
            conn.send(None)
            p.join(timeout=30)


def health_call(url: str):
    """GET /health: the HTTP path (client, Serve's proxy, the replica's routes) without any engine work."""
    import httpx2

    ac: list = []

    async def call(seed: int) -> int:
        if not ac:
            ac.append(httpx2.AsyncClient(timeout=600))
        (await ac[0].get(url.removesuffix("/v1") + "/health")).raise_for_status()
        return 0, 0.0, 0.0

    async def close() -> None:
        if ac:
            await ac.pop().aclose()
    call.close = close
    return call


async def health_round(url: str, clients: int, per_client: int) -> dict[str, float]:
    call = health_call(url)
    try:
        return await closed_loop(call, clients, per_client)
    finally:
        await call.close()


async def side_by_side(local, remote, levels: list[int], lengths: list[int], rounds: int,
                       procs: ClientProcesses | None = None) -> tuple[dict, dict]:
    """Per (clients, requests per client), `rounds` alternations of in-process then endpoint; the best round of
    each (the machine's other load varies from minute to minute: interleaving and best-of keep it out of the ratio
    as far as one run can), with every round's requests/s under "rounds" and the median ratio of each endpoint
    round to the in-process round before it under "paired". One event loop for all: the in-process
    batcher's worker lives in it. With `procs`, the endpoint's clients run in those processes instead of this one."""
    from whale_ray.serve.lag import LoopLag

    best_local: dict[tuple[int, int], dict[str, float]] = {}
    best_remote: dict[tuple[int, int], dict[str, float]] = {}
    (local, local_counts), (remote, remote_counts) = local, remote
    lag = LoopLag()  # this process's loop: the in-process clients' (beside the engine's thread), or the endpoint's
    lag.start()

    async def lagged(run) -> dict[str, float]:
        before = lag.stats()
        r = await run
        r.setdefault("client_lag_ms", mean_lag_ms([lag.since(before)]))  # client processes measure their own
        return r
    await local(0)
    await remote(0)  # warm-up
    for key in [(c, n) for c in levels for n in lengths]:
        # a request per client first, uncounted, on both sides: each client's first request opens its connections
        # (in each client process, through HAProxy too) and builds the openai client's reply models, which would
        # otherwise slow the first counted round far below the others
        await closed_loop(local, key[0], 1)
        await (procs.round(key[0], 1, remote_counts) if procs else closed_loop(remote, key[0], 1))
        runs: tuple[list, list] = ([], [])
        for _ in range(rounds):
            runs[0].append(await lagged(closed_loop(local, *key, local_counts)))
            runs[1].append(await lagged(procs.round(*key, remote_counts) if procs else
                                        closed_loop(remote, *key, remote_counts)))
        for best, rs in zip((best_local, best_remote), runs):
            best[key] = {**max(rs, key=lambda r: r["req_s"]), "rounds": [r["req_s"] for r in rs]}
        # each endpoint round against the in-process round just before it: a drift of the machine's speed over
        # the run moves both alike
        best_remote[key]["paired"] = statistics.median([b["req_s"] / a["req_s"] for a, b in zip(*runs)])
    await remote.close()
    return best_local, best_remote


def stream_gaps(url: str, land) -> tuple[float, float, set[str]]:
    """Longest gap between chunks of 8 concurrent streams: once quiet, once with `land()` called mid-stream."""
    import openai

    async def streams(swap: bool) -> tuple[float, set[str]]:
        ac = openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)
        gaps, prints = [0.0], set()

        async def one(seed: int) -> None:
            s = await ac.completions.create(model="whale-latest", prompt=QUESTION, max_tokens=96, temperature=1.0,
                                            seed=seed, stream=True, extra_body={"top_k": 20})
            last = time.perf_counter()
            async for ch in s:
                now = time.perf_counter()
                gaps[0] = max(gaps[0], now - last)
                last = now
                prints.add(ch.system_fingerprint)
        tasks = [asyncio.create_task(one(i)) for i in range(8)]
        if swap:
            await asyncio.sleep(0.3)
            await asyncio.get_running_loop().run_in_executor(None, land)
            tasks += [asyncio.create_task(one(100 + i)) for i in range(8)]  # these run on the new weights
        await asyncio.gather(*tasks)
        await ac.close()
        return gaps[0], prints
    quiet, _ = asyncio.run(streams(False))
    swapped, prints = asyncio.run(streams(True))
    return quiet, swapped, prints


def thread_samples(path: Path) -> dict[str, int]:
    """Samples per thread in a py-spy `--threads -f raw` file (each line: `thread;frame;...;frame count`)."""
    threads: dict[str, int] = {}
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        thread = stack.split(";", 1)[0]
        threads[thread] = threads.get(thread, 0) + int(n)
    return threads


def profile(url: str, setup: str, seconds: float, out: Path, per_client: int) -> None:
    """py-spy (on PATH) on the replica's process and its engine's (one process with preset cpu) while 32
    clients keep the endpoint busy: samples of the thread holding the GIL only (`--gil`), so a process's samples
    over rate x seconds is its GIL's busy share, and each thread's share says who holds it. Raw stacks are
    written to `out`; a line per process is printed."""
    import subprocess

    import httpx2

    health = httpx2.get(url.removesuffix("/v1") + "/health", timeout=60).json()
    pids = {"replica": health["pid"], "engine": health["batches"]["whale-latest"]["pid"]}
    out.mkdir(parents=True, exist_ok=True)
    rate = 200
    spies = {role: subprocess.Popen(["py-spy", "record", "--gil", "--threads", "--nonblocking", "-r", str(rate),
                                     "-d", str(int(seconds)), "-f", "raw", "-o", str(out / f"{setup}-{role}.txt"),
                                     "-p", str(pid)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for role, pid in pids.items() if role == "replica" or pid != pids["replica"]}

    async def load() -> None:  # until the profiles end
        call, _ = endpoint_call(url, 32)
        while any(p.poll() is None for p in spies.values()):
            await closed_loop(call, 32, per_client)
        await call.close()
    asyncio.run(load())
    for role, spy in spies.items():
        f = out / f"{setup}-{role}.txt"
        if not f.exists():
            print(f"py-spy on the {role} process wrote nothing: {spy.stdout.read()[-300:]}")
            continue
        threads = thread_samples(f)
        top = ", ".join(f"{t[:40]} {n / (rate * seconds):.0%}" for t, n in sorted(threads.items(), key=lambda x: -x[1])[:4])
        print(f"GIL held in the {role} process ({pids[role]}, {setup}): {sum(threads.values()) / (rate * seconds):.0%} "
              f"of {seconds:g} s; by thread: {top or 'no samples'}", flush=True)


def print_rows(preset: str, mode: str, local: dict, remote: dict) -> None:
    for (c, n), a in local.items():
        b = remote[c, n]
        print(f"{preset:>6} {mode:>10} {c:>7} {n:>6} | {a['req_s']:>16.2f} {a['tok_s']:>7.1f} {a['p50']:>6.3f} "
              f"{a['p99']:>6.3f} {a['batch']:>5.1f} | {b['req_s']:>14.2f} {b['tok_s']:>7.1f} {b['p50']:>6.3f} "
              f"{b['p99']:>6.3f} {b['batch']:>5.1f} | {b['req_s'] / a['req_s']:>11.2f} {b['paired']:>12.2f} "
              f"{b['tok_s'] / a['tok_s']:>11.2f} | {a['idle']:>7.0%} {b['idle']:>7.0%} | {b['cpu_ms']:>14.2f} | "
              f"{a['step_ms']:>5.2f} {b['step_ms']:>5.2f}",
              flush=True)


def split(b: dict) -> str:
    if not b["round_trip_ms"]:  # preset cpu: no channel
        return ""
    return (f" (replica {b['completion_ms'] - b['round_trip_ms']:.1f}, socket {b['round_trip_ms'] - b['actor_ms']:.1f}, "
            f"actor {b['actor_ms'] - b['engine_ms']:.1f})")


def print_times(local: dict, remote: dict) -> None:
    """Where a request's time went (means, ms): in process, the client's latency and the engine's share of it; through
    the endpoint, the client's latency as the HTTP path (the client, Serve, the handler's way in and out), the
    handler's own work around the completion, the hop to the engine and back (the completion less the engine's
    time; with preset cpu only the event loop's turns) and the engine. The engine's time runs from a request
    reaching it to its output, of it `wait` before it joined a batch. With preset gpu the hop splits further:
    the replica's part of the completion outside the channel (the prompt's rendering, the reply, its loop's turns),
    the socket both ways (with each end's wake-ups) and the engine actor's loop around the engine. Then how late each
    event loop ran a 20 ms timer, on average: the in-process clients' (beside the engine's thread), the endpoint's
    clients', the replica's and the engine actor's (whale_ray/serve/lag.py): the wait anything ready there had."""
    for (c, n), a in local.items():
        b = remote[c, n]
        print(f"    ms per request at {c} clients x {n}: in process {a['client_ms']:.1f} = engine {a['engine_ms']:.1f} "
              f"(wait {a['wait_ms']:.1f}) + {a['client_ms'] - a['engine_ms']:.1f}; endpoint {b['client_ms']:.1f} = HTTP "
              f"{b['client_ms'] - b['handler_ms']:.1f} + handler {b['handler_ms'] - b['completion_ms']:.1f} + hop "
              f"{b['completion_ms'] - b['engine_ms']:.1f}{split(b)} + engine {b['engine_ms']:.1f} (wait {b['wait_ms']:.1f}); "
              f"engine steps per request (of them prefills): in process {a['steps_per']:.2f} ({a['prefills_per']:.2f}), "
              f"endpoint {b['steps_per']:.2f} ({b['prefills_per']:.2f}); loop lag ms (a timer's lateness): in process "
              f"{a['client_lag_ms']:.2f}, endpoint's clients {b['client_lag_ms']:.2f}, replica {b['lag_ms']:.2f}, engine "
              f"actor {b['engine_lag_ms']:.2f}; "
              f"req/s of each round: in process {', '.join(f'{x:.1f}' for x in a['rounds'])}, endpoint "
              f"{', '.join(f'{x:.1f}' for x in b['rounds'])}", flush=True)


def model_path(model: str | None) -> str:
    """`model` resolved, or the embedded tiny math policy (built once, then cached)."""
    if model is None:
        from whale_ray.domain import get_domain
        from whale_ray.policy.tiny import build_embedded_policy
        from whale_ray.storage import default_cache_dir

        model = str(build_embedded_policy(get_domain("math_reasoning"), cache_dir=default_cache_dir()))
    return str(Path(model).resolve())


def write_run_config(root: Path, device: str, batch_wait_ms: float, batching: str) -> None:
    """The run directory's config.yaml, as a run writes it: the endpoint's engines read their policy settings there."""
    from whale_ray.config import dump_config, load_config

    cfg = load_config(None, {"run_dir": str(root), "policy.batch_wait_ms": batch_wait_ms, "policy.batching": batching,
                             "policy.device": device})
    (root / "config.yaml").write_text(dump_config(cfg))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", help="Hugging Face checkpoint (default: the embedded tiny math policy)")
    ap.add_argument("--device", default="cpu", help="both engines' device: cpu or cuda")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of both engines (the engine's Ray CPUs)")
    ap.add_argument("--requests-per-client", default="4",
                    help="each client's requests in a round, one after another; several (comma-separated) give a "
                         "round of each length per level")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--batch-wait-ms", type=float, default=5.0, help="policy.batch_wait_ms, both ways")
    ap.add_argument("--rounds", type=int, default=2, help="alternations per level; the best of each is shown")
    ap.add_argument("--presets", default="cpu,gpu", help="serve.preset values to measure in turn")
    ap.add_argument("--replicas", type=int, default=1,
                    help="Serve replicas: with preset gpu, front ends of one engine; "
                         "otherwise each with an engine of its own, scaling out against the one engine in process")
    ap.add_argument("--batching", default="continuous",
                    help="policy.batching modes to measure in turn, both ways (comma-separated: continuous,pass)")
    ap.add_argument("--levels", default="1,8,32", help="concurrent clients (comma-separated)")
    ap.add_argument("--client-procs", type=int, default=1,
                    help="processes the endpoint's clients are spread over (the in-process clients stay in this one)")
    ap.add_argument("--client-cores", type=int, default=0,
                    help="with --client-procs: the client processes on the last this many cores, everything else on "
                         "the others (0: the OS places them)")
    ap.add_argument("--profile", type=int, default=0,
                    help="after each setup's rounds, this many seconds of py-spy (on PATH) on its replica and engine "
                         "processes under 32 clients (raw stacks into --profile-dir)")
    ap.add_argument("--profile-dir", default="serve-profiles")
    args = ap.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    lengths = [int(x) for x in args.requests_per_client.split(",")]
    setups = [(preset, mode) for preset in args.presets.split(",") for mode in args.batching.split(",")]
    args.model = model_path(args.model)
    torch.set_num_threads(args.threads)  # the endpoint's engine gets as many (serve.engine_cpus)
    gpus = 1 if args.device.startswith("cuda") else 0

    import ray
    from transformers import AutoModelForCausalLM

    from whale_ray.config import ServeConfig
    from whale_ray.run_state import RunState
    from whale_ray.serve.app import deploy, free_port, undeploy
    from whale_ray.serve.spec import for_run_dir

    # Ray starts its workers at niceness 15: on a busy machine the replica would then lose the cores to the
    # in-process engine (niceness 0 in this process), which is not what is being compared
    os.environ.setdefault("RAY_worker_niceness", "0")
    ray.init(address="local", num_cpus=max(args.threads, os.cpu_count() or 1), num_gpus=gpus,
             include_dashboard=False, log_to_driver=False)  # first: a Ray that fails to start leaves nothing behind
    root = Path(tempfile.mkdtemp(prefix="serve-bench-"))
    RunState().save(root)
    results = {}
    print(f"model {args.model} on {args.device}; {args.requests_per_client} requests per client, max_tokens "
          f"{args.max_tokens}, T 1, top-k 20, the same seeds both ways; endpoint: {args.replicas} replica(s), clients in "
          f"{args.client_procs} process(es), {args.threads} torch "
          f"threads, as in process; best of {args.rounds} interleaved rounds each; batch: requests per pass (pass), "
          f"rows per engine step, prefills included (continuous)")
    print(f"{'preset':>6} {'batching':>10} {'clients':>7} {'req/cl':>6} | {'in-process req/s':>16} {'tok/s':>7} "
          f"{'p50 s':>6} {'p99 s':>6} {'batch':>5} | {'endpoint req/s':>14} {'tok/s':>7} {'p50 s':>6} {'p99 s':>6} {'batch':>5} | "
          f"{'req/s ratio':>11} {'paired ratio':>12} {'tok/s ratio':>11} | {'idle in':>7} {'idle ep':>7} | {'replica CPU ms':>14} | "
          f"{'step ms in, ep':>11}")
    try:
        for preset, mode in setups:  # a deployment each; the last one also serves the HTTP floor and the swap
            write_run_config(root, args.device, args.batch_wait_ms, mode)
            # the engine's CPUs (its torch threads) and GPU: each replica's (cpu) or the one engine actor's (gpu)
            shared = preset == "gpu"  # one engine behind every replica: it holds the GPU whole
            serve = ServeConfig(port=free_port(), replicas=args.replicas, max_concurrent=64, preset=preset,
                                engine_cpus=args.threads, engine_gpus=gpus if shared else gpus / args.replicas)
            url = deploy(for_run_dir(root, args.model, serve))
            fronts = replica_urls(url, serve)
            procs = ClientProcesses(args.client_procs, url, args.max_tokens) if args.client_procs > 1 else None
            if procs and args.client_cores:
                print(pin_clients([p.pid for p in procs.procs], args.client_cores), flush=True)
            try:
                results[preset, mode] = asyncio.run(side_by_side(
                    in_process_call(args.model, args.max_tokens, args.batch_wait_ms, mode, args.device),
                    endpoint_call(url, args.max_tokens, fronts, shared), levels, lengths, args.rounds, procs))
            finally:
                if procs:
                    procs.close()
            # as it goes: a run cut short keeps these
            print_rows(preset, mode, *results[preset, mode])
            print_times(*results[preset, mode])
            if args.profile:
                profile(url, f"{preset}-{mode}", args.profile, Path(args.profile_dir), lengths[0])
            if (preset, mode) != setups[-1]:
                undeploy()

        def land() -> float:
            t0 = time.perf_counter()
            model = AutoModelForCausalLM.from_pretrained(args.model)
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(1.01)
            model.save_pretrained(root / "checkpoints" / "v00001")
            state = RunState(weight_version=1, checkpoint="checkpoints/v00001")
            state.save(root)
            return time.perf_counter() - t0
        floor = max((asyncio.run(health_round(url, levels[-1], 4 * lengths[0]))
                     for _ in range(args.rounds)), key=lambda r: r["req_s"])
        quiet, swapped, prints = stream_gaps(url, land)
    finally:
        undeploy()
        ray.shutdown()
        shutil.rmtree(root, ignore_errors=True)

    # Where the HTTP path and the engine share the cores (a CPU engine), a request costs 1/in-process of the engine
    # and at least 1/floor beside it, so the endpoint reaches at most floor / (floor + in-process) of in-process.
    last = " ".join(setups[-1])
    a = results[setups[-1]][0][levels[-1], lengths[-1]]["req_s"]
    print(f"the HTTP path alone (GET /health, {levels[-1]} clients, no engine work, {last}): {floor['req_s']:.1f} "
          f"req/s, {floor['req_s'] / a:.2f}x in-process at {levels[-1]} clients; where the engine shares the cores "
          f"with it (CPU), the endpoint can reach at most {floor['req_s'] / (floor['req_s'] + a):.2f} of in-process")
    print(f"longest gap between two chunks of a stream (8 streams, 96 tokens, {last}): {quiet:.3f} s quiet, "
          f"{swapped:.3f} s with a checkpoint landing mid-stream ({swapped / quiet:.1f}x); versions seen: "
          f"{', '.join(sorted(p for p in prints if p))}")


if __name__ == "__main__":
    main()
