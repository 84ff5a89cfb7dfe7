"""Weight sync Trainer -> PolicyServer on one GPU, through Ray, and vLLM's sleep mode, side by side in one run.

A Qwen3-1.7B-shaped checkpoint with random bf16 weights (gpu_engines.build_model) is served by the real
PolicyServer actor (actors/policy_server.py, engine vllm, sleep mode on, num_gpus 0.5). A second actor on the
same GPU (num_gpus 0.5) plays the Trainer's rank-0 worker: it holds the model's state in float32 on the GPU, as
RSFTLearner does, perturbed so every version differs. Measured, each from the driver as the weight phase calls
it (the seconds from asking to the server's reply):
  ipc        whale_ray.policy.weight_sync: snapshot into GPU buckets, CUDA IPC handles to the server, copied
             into vLLM in place (the Trainer's path when it trains on a GPU);
  store      today's CPU path: the worker's CPU state dict through the object store, materialised by a middle
             actor (the Trainer actor), handed on to the server (three object-store copies);
  fallback   SharedWeights whose GPU the server cannot see (a fake UUID): fetched through the object store once;
  raw        a device-to-device copy of the same bytes in the worker (the floor);
  reload     the engine's own reload from tensors already on its GPU (what vLLM costs without any transport);
then greedy completions after ipc and after store loads of the same version (must be equal), GPU memory
(nvidia-smi, whole GPU) around sleep levels 1 and 2, and decode tokens/s of B concurrent clients through Ray
against the same batch submitted inside the actor's process.

    python benchmarks/gpu_weight_sync.py --tokenizer PATH/TO/CHECKPOINT --dir /tmp/qwen3-1.7b
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray  # noqa: E402
import torch  # noqa: E402

from benchmarks.gpu_engines import build_model  # noqa: E402


def gpu_used_mib() -> int:
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout
    return int(out.split()[0])


@ray.remote(num_gpus=0.5, num_cpus=1)
class FakeTrainerWorker:
    """The Trainer's rank-0 worker, as far as the weights go: a float32 state on this GPU."""

    def __init__(self, model: str):
        from safetensors.torch import load_file

        dump_stacks_now_and_then()
        files = sorted(Path(model).glob("*.safetensors"))
        self.state = {k: v.to("cuda", torch.float32) for f in files for k, v in load_file(str(f)).items()}
        self.buckets: list = []
        self.dst = None

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.state.values())

    def perturb(self, version: int) -> None:
        g = torch.Generator(device="cuda").manual_seed(version)
        for t in self.state.values():
            t.add_(torch.randn(t.shape, generator=g, device="cuda", dtype=t.dtype), alpha=1e-3)
        torch.cuda.synchronize()

    def share(self, version: int, uuid: str | None = None, fallback=None):
        from whale_ray.policy.weight_sync import share

        t0 = time.perf_counter()
        w, self.buckets = share(self.state, version, buckets=self.buckets)
        self.snapshot_s = time.perf_counter() - t0
        if uuid is not None:  # a server that cannot see this GPU
            w = dataclasses.replace(w, gpu_uuid=uuid, fallback=fallback)
        return w

    def last_snapshot_s(self) -> float:
        return self.snapshot_s

    def cpu_state(self) -> dict:
        return {k: v.detach().to("cpu", copy=True) for k, v in self.state.items()}  # RSFTLearner.state_dict

    def host_weights(self, version: int) -> list:  # the Trainer actor's fallback, rank 0's ray.put
        return [ray.put(self.cpu_state())]

    def raw_copy(self, repeats: int = 5) -> float:
        if self.dst is None:
            self.dst = {k: torch.empty_like(t) for k, t in self.state.items()}
        best = float("inf")
        for _ in range(repeats):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            torch._foreach_copy_(list(self.dst.values()), list(self.state.values()))
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        return best


@ray.remote(num_cpus=0)
class Middle:
    """The Trainer actor of the CPU path: materialises the worker's weights, serves them by return value."""

    def hold(self, weights: dict) -> dict:
        self.weights = weights
        return self.weights


def in_actor_reload(actor_self, repeats: int) -> list[float]:
    """The engine's reload from a float32 state dict already on the server's GPU (what IPC hands it, without
    the transport)."""
    from safetensors.torch import load_file

    eng = actor_self._service.engine
    files = sorted(Path(eng.model_path).glob("*.safetensors"))
    state = {k: v.to("cuda", torch.float32) for f in files for k, v in load_file(str(f)).items()}
    out = []
    for i in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        eng.load_weights(state, eng.version)
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return out


def set_level(actor_self, level: int) -> None:
    actor_self._service.engine.sleep_level = level


def in_actor_batch(actor_self, reqs) -> tuple[int, float]:
    eng = actor_self._service.engine
    t0 = time.perf_counter()
    outs = eng.generate(reqs)
    return sum(len(o.completion_ids) for o in outs), time.perf_counter() - t0


def dump_stacks_now_and_then(_=None, every_s: float = 40.0) -> None:
    """Every thread's stack to stderr (the Ray worker's .err log) every `every_s`: where a hung call waits."""
    import faulthandler

    faulthandler.dump_traceback_later(every_s, repeat=True)


def timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def section(name: str, fn, results: dict) -> None:
    try:
        t0 = time.perf_counter()
        fn()
        print(f"[{name}: {time.perf_counter() - t0:.1f} s]", flush=True)
    except Exception as e:  # one part failing still leaves the others' numbers
        results.setdefault("failed", []).append(f"{name}: {type(e).__name__}: {str(e)[:400]}")
        print(f"[{name} FAILED: {type(e).__name__}: {e}]", flush=True)
    print("RESULTS", json.dumps(results), flush=True)  # kept if a later part runs out of time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", type=Path, required=True)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/qwen3-1.7b"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batches", default="64,256")
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--sleep-level", type=int, default=2, help="the server's vLLM sleep mode (0: off)")
    ap.add_argument("--call-timeout", type=float, default=60.0, help="seconds any one call may take")
    a = ap.parse_args()
    from actors.policy_server import PolicyServer
    from whale_ray.policy import GenerationRequest
    from whale_ray.records import SamplingParams

    t_start = time.perf_counter()
    model = str(build_model(a.tokenizer, a.dir))
    torch.cuda.empty_cache()
    ray.init(num_cpus=8, num_gpus=1, include_dashboard=False, log_to_driver=False)
    R: dict = {}
    base_mib = gpu_used_mib()
    worker = FakeTrainerWorker.remote(model)
    middle = Middle.remote()
    nbytes = ray.get(worker.nbytes.remote())  # its memory is taken before vLLM profiles the GPU's
    server = PolicyServer.options(num_gpus=0.5, num_cpus=1).remote(
        model, engine="vllm", max_batch=256, dtype="bfloat16", gpu_memory_utilization=0.35,
        sleep_level=a.sleep_level)
    ray.get(server.version.remote())
    ray.get(server.__ray_call__.remote(dump_stacks_now_and_then))
    real_get = ray.get

    def get(refs, what: str = ""):  # every call bounded: a hang fails its part, named, not the whole run
        t0 = time.perf_counter()
        out = real_get(refs, timeout=a.call_timeout)
        if what:
            print(f"  {what}: {time.perf_counter() - t0:.3f} s", flush=True)
        return out

    print(f"[setup: {time.perf_counter() - t_start:.1f} s; {nbytes / 1e9:.2f} GB of float32 Trainer state; "
          f"GPU used {base_mib} MiB before the actors, {gpu_used_mib()} after]", flush=True)
    v = [0]

    def next_version() -> int:
        v[0] += 1
        get(worker.perturb.remote(v[0]))
        return v[0]

    def greedy() -> list[list[int]]:
        msgs = [[{"role": "user", "content": f"Say {i} twice."}] for i in range(4)]
        calls = get([server.generate.remote(m, SamplingParams(temperature=0.0, max_tokens=24)) for m in msgs])
        return [list(c.completion_ids) for c in calls]

    def sync_part():
        R["raw"] = get(worker.raw_copy.remote(), "raw copy")
        ipc, snap, store, fb = [], [], [], []
        for _ in range(a.repeats):
            n = next_version()
            s, got = timed(lambda: get(server.load_weights.remote(worker.share.remote(n), n), f"ipc load v{n}"))
            assert got == n, (got, n)
            ipc.append(s)
            snap.append(get(worker.last_snapshot_s.remote()))
        R["ipc"], R["snapshot"] = ipc, snap
        out_ipc = greedy()
        n = v[0]  # the same version through the object store: the same greedy tokens
        s, _ = timed(lambda: get(server.load_weights.remote(middle.hold.remote(worker.cpu_state.remote()), n)))
        store.append(s)
        R["same_tokens"] = greedy() == out_ipc
        for _ in range(1):
            n = next_version()
            s, _ = timed(lambda: get(server.load_weights.remote(
                worker.share.remote(n, uuid="GPU-not-here", fallback=worker), n)))
            fb.append(s)
        n = next_version()
        s, _ = timed(lambda: get(server.load_weights.remote(middle.hold.remote(worker.cpu_state.remote()), n)))
        store.append(s)
        R["store"], R["fallback"] = store, fb
        R["reload"] = get(server.__ray_call__.remote(in_actor_reload, a.repeats))

    def sleep_part():
        if a.sleep_level == 0:
            raise RuntimeError("the server runs without sleep mode (--sleep-level 0)")
        n = v[0]
        for level in (1, 2):
            get(server.__ray_call__.remote(set_level, level))
            awake = gpu_used_mib()
            s_sleep, _ = timed(lambda: get(server.sleep.remote()))
            asleep = gpu_used_mib()
            if level == 1:
                s_wake, _ = timed(lambda: get(server.wake_up.remote()))
            else:  # level 2 wakes by new weights (the weight phase's step), by IPC
                n = next_version()
                s_wake, _ = timed(lambda: get(server.load_weights.remote(worker.share.remote(n), n)))
            R[f"sleep{level}"] = dict(awake=awake, asleep=asleep, woken=gpu_used_mib(), sleep_s=s_sleep, wake_s=s_wake)
        R["after_sleep_tokens"] = len(greedy()[0])

    def ray_part():
        sp = SamplingParams(temperature=1.0, top_k=20, max_tokens=a.new, seed=1)
        counter = iter(range(10**6))

        def reqs(b):
            return [[{"role": "user", "content": f"{next(counter)} Count from one to one hundred."}] for _ in range(b)]

        for b in map(int, a.batches.split(",")):
            for _ in range(2):  # warm-up, then timed, per path
                t_ray, calls = timed(lambda: get([server.generate.remote(m, sp) for m in reqs(b)]))
                local = [GenerationRequest(m, sp) for m in reqs(b)]
                tok_local, t_local = get(server.__ray_call__.remote(in_actor_batch, local))
            R[f"ray{b}"] = (sum(len(c.completion_ids) for c in calls) / t_ray, tok_local / t_local)

    section("weight sync", sync_part, R)
    section("sleep mode", sleep_part, R)
    section("through Ray", ray_part, R)
    report(R, nbytes)


def report(R: dict, nbytes: int) -> None:
    gb = nbytes / 1e9
    print(f"\n## Weight sync, {gb:.2f} GB float32 Trainer state -> vLLM bf16 (1.7 B Qwen3-shaped), one H200")
    if "raw" in R:
        raw = R["raw"]
        print(f"raw device-to-device copy of the same bytes: {raw * 1e3:.1f} ms ({2 * nbytes / raw / 1e12:.2f} TB/s r+w)")
        print("| path | seconds (each call) | best | best / raw copy |")
        print("|---|---|---|---|")
        for key, name in (("ipc", "CUDA IPC buckets (new)"), ("store", "object store, 3 copies (old CPU path)"),
                          ("fallback", "IPC fallback: object store once"), ("reload", "vLLM reload alone, fp32 on its GPU"),
                          ("snapshot", "  of ipc: the worker's snapshot copy")):
            if key in R:
                xs = R[key]
                print(f"| {name} | {' / '.join(f'{x:.3f}' for x in xs)} | {min(xs):.3f} | {min(xs) / raw:.0f}x |")
        if "ipc" in R and "store" in R:
            print(f"ipc vs object store: {min(R['store']) / min(R['ipc']):.1f}x faster; greedy tokens after ipc == "
                  f"after object store of the same version: {R.get('same_tokens')}")
    for level in (1, 2):
        if f"sleep{level}" in R:
            s = R[f"sleep{level}"]
            print(f"sleep level {level}: GPU used {s['awake']} -> {s['asleep']} MiB asleep (frees "
                  f"{(s['awake'] - s['asleep']) / 1024:.1f} GiB) -> {s['woken']} MiB woken; sleep {s['sleep_s']:.2f} s, "
                  f"{'wake_up' if level == 1 else 'wake by an IPC load'} {s['wake_s']:.2f} s")
    if "after_sleep_tokens" in R:
        print(f"greedy completion after the sleeps: {R['after_sleep_tokens']} tokens")
    for k in sorted(k for k in R if k.startswith("ray")):
        via, local = R[k]
        print(f"batch {k[3:]}: {via:,.0f} tokens/s through Ray (concurrent actor calls), {local:,.0f} inside the "
              f"actor's process (VLLMEngine.generate): {via / local:.2f}x")
    for f in R.get("failed", []):
        print("FAILED", f)


if __name__ == "__main__":
    main()
