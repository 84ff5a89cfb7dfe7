"""Weight sync Trainer -> PolicyServer on one GPU, through Ray, and vLLM's sleep mode, side by side in one run.

A Qwen3-1.7B-shaped checkpoint with random bf16 weights (gpu_engines.build_model) is served by the real
PolicyServer actor (actors/policy_server.py, engine vllm, sleep mode on, num_gpus 0.5). A second actor on the
same GPU (num_gpus 0.45) plays the Trainer's rank-0 worker: it holds the model's state in float32 on the GPU, as
RSFTLearner does, perturbed so every version differs. A third, plain actor (num_gpus 0.05, no vLLM) only opens
handles.

First a ladder of CUDA IPC steps, each bounded and printed as it ends, so that one run tells apart where a hang
lies (the first run of this benchmark hung somewhere in its weight-sync part, with nothing printed):
  share       the handles of the worker's tensors themselves (no copy), fetched by the driver;
  open/plain  a plain Ray actor opens the handles and checksums the tensors (IPC between Ray actors, no vLLM);
  open/server the same inside the PolicyServer's process (vLLM and its engine thread there), in a thread;
  engine      VLLMEngine.load_weights of the opened tensors in the server's process, in a thread (no asyncio);
  ipc         PolicyServer.load_weights of the handles, as the weight phase calls it (Ray, asyncio, executor).
In-process steps run in a thread joined with a timeout: a hang returns that thread's stack instead of
blocking the actor. Where a server step fails with sleep mode on, a second server without sleep mode runs the
ladder again (--retry-without-sleep), which separates sleep mode from IPC. Every actor also dumps all its
threads' stacks to its log every 20 s (faulthandler, which works even while a C call holds the GIL); after a
timeout the driver prints the newest dump of that actor.

Then, each from the driver as the weight phase calls it (the seconds from asking to the server's reply):
  ipc        (above) the Trainer's path when it trains on a GPU; with the server's own split (open / engine);
  store      the CPU path (weight_sync object_store) in its two hops, each timed: the worker's CPU state dict
             into the object store, the server's read of that ref and its load;
  fallback   SharedWeights whose GPU the server cannot see (a fake UUID), pushed by actors/weight_sync.py's
             CudaIpcSync: the server answers Unreachable and gets them through the object store once;
  raw        a device-to-device copy of the same bytes in the worker (the floor);
  reload     the engine's own reload from float32 tensors already on its GPU (no transport): by the copy plan it
             recorded at its first load (whale_ray/policy/vllm_reload.py), and by vLLM's reload_weights;
then greedy completions after ipc and after store loads of the same version (must be equal), GPU memory
(nvidia-smi, whole GPU) around sleep levels 1 and 2, and decode tokens/s of B concurrent clients through Ray
against the same batch submitted inside the actor's process, at each of --switch-intervals (the server
process's GIL switch interval: how long the engine thread can wait for the GIL held by the thread that runs
the actor calls). Each part prints a RESULTS line when it ends.

Seen on the H200 (2026-12-02, scripts/gpu/weight_sync_h200.sh; scripts/gpu/README.md has the whole tables):
ipc 0.011 s a version, 2.8x a raw copy of the bytes (4.0 ms), the first of a key 0.041 s (the server opens the
310 handles once); the worker's share 0.6 ms, the engine's copy plan 4 ms against vLLM's reload_weights 83-167 ms.
The day before, with a snapshot into buckets: ipc 0.026-0.029 s; object store 78.1 s (hops 26.5 + 35.9 + 15.7 s),
fallback 30.7 s; greedy tokens equal after ipc and store; through Ray 1.02 / 0.91 / 0.89x in-actor at batch
8 / 64 / 256 (benchmarks/gpu_engines.py's ray part now measures that with the issue's prompts).

    python benchmarks/gpu_weight_sync.py --tokenizer PATH/TO/CHECKPOINT --dir /tmp/qwen3-1.7b
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray  # noqa: E402
import torch  # noqa: E402

from benchmarks.gpu_engines import build_model  # noqa: E402

DUMP_EVERY_S = 20.0


def gpu_used_mib() -> int:
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout
    return int(out.split()[0])


def dump_stacks_now_and_then(_=None) -> int:
    """Every thread's stack to stderr (the Ray worker's .err log) every DUMP_EVERY_S; returns the pid."""
    import faulthandler

    faulthandler.dump_traceback_later(DUMP_EVERY_S, repeat=True)
    return os.getpid()


def in_thread(fn, timeout: float) -> dict:
    """fn() in a thread joined with `timeout`: {"out"} or {"error"}, or {"hung", "stack"} (that thread's stack)."""
    box: dict = {}

    def run():
        try:
            box["out"] = fn()
        except BaseException as e:
            box["error"] = f"{type(e).__name__}: {str(e)[:600]}"
            box["trace"] = traceback.format_exc()[-1500:]

    t = threading.Thread(target=run, daemon=True, name="bench-step")
    t.start()
    t.join(timeout)
    if t.is_alive():
        frame = sys._current_frames().get(t.ident)
        stack = "".join(traceback.format_stack(frame)) if frame is not None else "?"
        return {"hung": True, "stack": stack[-2500:]}
    return box


def checksum(tensors) -> float:
    tensors = list(tensors)
    return float(torch.stack([t.sum(dtype=torch.float64) for t in tensors]).sum()) if tensors else 0.0


@ray.remote(num_gpus=0.45, num_cpus=1)
class FakeTrainerWorker:
    """The Trainer's rank-0 worker, as far as the weights go: a float32 state on this GPU."""

    def __init__(self, model: str):
        from safetensors.torch import load_file

        dump_stacks_now_and_then()
        files = sorted(Path(model).glob("*.safetensors"))
        self.state = {k: v.to("cuda", torch.float32) for f in files for k, v in load_file(str(f)).items()}
        from whale_ray.policy.cuda_ipc import Sharer

        self.sharer = Sharer()
        self.dst = None
        self.snapshot_s = 0.0
        self.elsewhere = False  # shared_weights name a GPU no server can see

    def pid(self) -> int:
        return os.getpid()

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.state.values())

    def checksum(self) -> float:
        return checksum(self.state.values())

    def perturb(self, version: int) -> None:
        g = torch.Generator(device="cuda").manual_seed(version)
        for t in self.state.values():
            t.add_(torch.randn(t.shape, generator=g, device="cuda", dtype=t.dtype), alpha=1e-3)
        torch.cuda.synchronize()

    def share(self, version: int):
        t0 = time.perf_counter()
        w = self.sharer.share(self.state, version)  # handles made at the first call; later ones only synchronize
        self.snapshot_s = time.perf_counter() - t0
        return w

    def pretend_elsewhere(self, elsewhere: bool) -> None:
        self.elsewhere = elsewhere

    def shared_weights(self, version: int):  # the Trainer actor's, as CudaIpcSync asks for them
        w = self.share(version)
        return dataclasses.replace(w, gpu_uuid="GPU-not-here") if self.elsewhere else w

    def last_snapshot_s(self) -> float:
        return self.snapshot_s

    def cpu_state(self) -> dict:
        return {k: v.detach().to("cpu", copy=True) for k, v in self.state.items()}  # RSFTLearner.state_dict

    def host_weights(self, version: int) -> list:  # the Trainer actor's, rank 0's ray.put
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
        self.dst = None  # its memory back for vLLM's reload buffers
        torch.cuda.empty_cache()
        return best


@ray.remote(num_gpus=0.05, num_cpus=0)
class Opener:
    """A plain actor on the same GPU, no vLLM: opens the handles as the server would, and checksums them."""

    def __init__(self):
        dump_stacks_now_and_then()

    def pid(self) -> int:
        return os.getpid()

    def open(self, w, timeout: float) -> dict:
        return open_and_checksum(w, timeout)


def open_and_checksum(w, timeout: float) -> dict:
    """Opens the handles of `w` in this process (bounded) and checksums the distinct tensors."""
    from whale_ray.policy.cuda_ipc import materialize

    def go():
        t0 = time.perf_counter()
        state = materialize(w, w.version)
        t1 = time.perf_counter()
        return {"open_s": t1 - t0, "checksum": checksum(state[name] for name in _distinct(w))}

    return in_thread(go, timeout)


def _distinct(w) -> list[str]:
    """One name per distinct tensor (a tied head once): by IPC handle, storage offset, tensor offset and shape."""
    seen: dict[tuple, str] = {}
    for name, args in w.handles:
        seen.setdefault((args[7], args[9], args[3], tuple(args[1])), name)
    return list(seen.values())


# -- run inside the PolicyServer's process (server.__ray_call__) -----------------------------------------------

def srv_open(actor_self, w, timeout: float) -> dict:
    return open_and_checksum(w, timeout)


def srv_engine_load(actor_self, w, timeout: float) -> dict:
    from whale_ray.policy.cuda_ipc import materialize

    eng = actor_self._service.engine

    def go():
        t0 = time.perf_counter()
        state = materialize(w, w.version)
        t1 = time.perf_counter()
        eng.load_weights(state, w.version)
        torch.cuda.synchronize()
        return {"open_s": t1 - t0, "engine_s": time.perf_counter() - t1, "version": eng.version}

    return in_thread(go, timeout)


def srv_last_load(actor_self) -> dict:
    return dict(getattr(actor_self._service, "last_load", {}))  # PolicyService's split of its last load


def srv_reload(actor_self, repeats: int, timeout: float) -> dict:
    """The engine's reload from a float32 state dict already on the server's GPU (what IPC hands it, without
    the transport): by its recorded copy plan (whale_ray/policy/vllm_reload.py), then by vLLM's reload_weights."""
    from safetensors.torch import load_file

    eng = actor_self._service.engine

    def go():
        files = sorted(Path(eng.model_path).glob("*.safetensors"))
        state = {k: v.to("cuda", torch.float32) for f in files for k, v in load_file(str(f)).items()}
        out = {"status": eng.plan_status}
        plan = eng._plan
        for path in ("plan", "vllm"):
            eng._plan = plan if path == "plan" else None
            out[path] = []
            for _ in range(repeats):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                eng.load_weights(state, eng.version)
                torch.cuda.synchronize()
                out[path].append(time.perf_counter() - t0)
            out[f"{path}_path"] = eng.last_reload.get("path")
        eng._plan = plan
        return out

    return in_thread(go, timeout)


def set_switch_interval(actor_self, seconds: float) -> float:
    sys.setswitchinterval(seconds)
    return sys.getswitchinterval()


def set_level(actor_self, level: int) -> None:
    actor_self._service.engine.sleep_level = level


def in_actor_batch(actor_self, reqs) -> tuple[int, float]:
    eng = actor_self._service.engine
    t0 = time.perf_counter()
    outs = eng.generate(reqs)
    return sum(len(o.completion_ids) for o in outs), time.perf_counter() - t0


# -- the driver ------------------------------------------------------------------------------------------------

def system_facts() -> dict:
    facts = {}
    try:
        mem = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
        facts["MemTotal_GiB"] = round(int(mem["MemTotal"].split()[0]) / 2**20, 1)
        st = os.statvfs("/dev/shm")
        facts["dev_shm_GiB"] = round(st.f_blocks * st.f_frsize / 2**30, 1)
    except Exception as e:  # facts only
        facts["error"] = str(e)
    return facts


def last_dump(pid: int | None, lines: int = 40) -> str:
    """The newest faulthandler dump in the log of the worker with this pid (its threads' stacks)."""
    if pid is None:
        return ""
    files = glob.glob(f"/tmp/ray/session_latest/logs/worker-*-{pid}.err")
    if not files:
        return f"(no log for pid {pid})"
    text = Path(files[0]).read_text(errors="replace")
    start = text.rfind("Timeout (0:")
    dump = text[start:] if start >= 0 else text[-4000:]
    keep = [ln for ln in dump.splitlines() if ln.startswith(("Thread", "Current thread", "  File", "Timeout"))]
    # the frames of interest are the innermost ones: each thread's first few lines
    return "\n".join(keep[:lines])


def section(name: str, fn, results: dict) -> None:
    try:
        t0 = time.perf_counter()
        fn()
        print(f"[{name}: {time.perf_counter() - t0:.1f} s]", flush=True)
    except Exception as e:  # one part failing still leaves the others' numbers
        results.setdefault("failed", []).append(f"{name}: {type(e).__name__}: {str(e)[:400]}")
        print(f"[{name} FAILED: {type(e).__name__}: {str(e)[:600]}]", flush=True)
    print("RESULTS", json.dumps(results, default=str), flush=True)  # kept if a later part runs out of time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", type=Path, required=True)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/qwen3-1.7b"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batches", default="8,64,256")
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3, help="timed runs of each path per batch, alternating")
    ap.add_argument("--switch-intervals", default="0.005,0.001,0.0002",
                    help="the server process's sys.setswitchinterval values to measure decode through Ray at")
    ap.add_argument("--sleep-level", type=int, default=2, help="the server's vLLM sleep mode (0: off)")
    ap.add_argument("--retry-without-sleep", type=int, default=1,
                    help="1: where a server step of the IPC ladder fails, run it again on a server without sleep mode")
    ap.add_argument("--call-timeout", type=float, default=45.0, help="seconds an IPC / control call may take")
    ap.add_argument("--store-timeout", type=float, default=150.0, help="seconds one object-store hop may take")
    ap.add_argument("--object-store-gb", type=float, default=0, help="Ray's object store size (0: Ray's default)")
    ap.add_argument("--parts", default="sync,store,sleep,ray")
    ap.add_argument("--ok-file", type=Path, help="written when the IPC path through the PolicyServer worked")
    a = ap.parse_args()
    from actors.policy_server import PolicyServer
    from actors.weight_sync import CudaIpcSync
    from whale_ray.policy.engine import GenerationRequest
    from whale_ray.records import SamplingParams

    parts = set(a.parts.split(","))
    T = a.call_timeout
    t_start = time.perf_counter()
    model = str(build_model(a.tokenizer, a.dir))
    torch.cuda.empty_cache()
    init = {"object_store_memory": int(a.object_store_gb * 1e9)} if a.object_store_gb else {}
    ray.init(num_cpus=8, num_gpus=1, include_dashboard=False, log_to_driver=False, **init)
    R: dict = {"system": {**system_facts(),
                          "object_store_GiB": round(ray.cluster_resources().get("object_store_memory", 0) / 2**30, 1)}}
    print("system:", json.dumps(R["system"]), flush=True)
    base_mib = gpu_used_mib()
    worker = FakeTrainerWorker.remote(model)
    opener = Opener.remote()
    nbytes = ray.get(worker.nbytes.remote())  # its memory is taken before vLLM profiles the GPU's
    real_get = ray.get
    pids = {"worker": real_get(worker.pid.remote()), "opener": real_get(opener.pid.remote())}

    def get(refs, what: str = "", timeout: float | None = None, who: str | None = None):
        """Every call bounded: a hang fails its step, named, with the newest stack dump of the actor `who`."""
        t0 = time.perf_counter()
        try:
            out = real_get(refs, timeout=timeout or T)
        except ray.exceptions.GetTimeoutError:
            print(f"  {what or 'call'}: TIMED OUT after {timeout or T:.0f} s", flush=True)
            if who:
                time.sleep(1)
                print(f"  newest stack dump of the {who} (pid {pids.get(who)}):\n{last_dump(pids.get(who))}",
                      flush=True)
            raise
        if what:
            print(f"  {what}: {time.perf_counter() - t0:.3f} s", flush=True)
        return out

    def start_server(level: int):
        t0 = time.perf_counter()
        s = PolicyServer.options(num_gpus=0.5, num_cpus=1).remote(
            model, engine="vllm", max_batch=256, dtype="bfloat16", gpu_memory_utilization=0.35, sleep_level=level)
        pids["server"] = real_get(s.__ray_call__.remote(dump_stacks_now_and_then), timeout=240)
        print(f"  server up (sleep level {level}): {time.perf_counter() - t0:.1f} s", flush=True)
        return s

    server = start_server(a.sleep_level)
    server_level = a.sleep_level
    print(f"[setup: {time.perf_counter() - t_start:.1f} s; {nbytes / 1e9:.2f} GB of float32 Trainer state; "
          f"GPU used {base_mib} MiB before the actors, {gpu_used_mib()} after]", flush=True)
    v = [0]

    def next_version() -> int:
        v[0] += 1
        get(worker.perturb.remote(v[0]))
        return v[0]

    def greedy() -> list[list[int]]:
        msgs = [[{"role": "user", "content": f"Say {i} twice."}] for i in range(4)]
        calls = get([server.generate.remote(m, SamplingParams(temperature=0.0, max_tokens=24)) for m in msgs],
                    who="server")
        return [list(c.completion_ids) for c in calls]

    def step(name: str, box: dict, ladder: dict) -> bool:
        """An in-thread step's outcome, printed and recorded; True if it finished without error."""
        if box.get("hung"):
            print(f"  {name}: HUNG; its thread's stack:\n{box['stack']}", flush=True)
            ladder[name] = "hung"
            return False
        if "error" in box:
            print(f"  {name}: ERROR {box['error']}\n{box.get('trace', '')}", flush=True)
            ladder[name] = "error: " + box["error"][:200]
            return False
        ladder[name] = box["out"]
        print(f"  {name}: {json.dumps(box['out'])}", flush=True)
        return True

    def server_ladder(level: int) -> bool:
        """open/server, engine, ipc (x repeats) on the current server; True if every step passed."""
        lad = R.setdefault("ladder", {}).setdefault(f"sleep{level}", {})
        try:
            n = next_version()
            wref = worker.share.remote(n)
            want = get(worker.checksum.remote())
            ok = step("open/server", get(server.__ray_call__.remote(srv_open, wref, T), "open/server call",
                                         timeout=T + 15, who="server"), lad)
            if ok and lad["open/server"]["checksum"] != want:
                print(f"  open/server: checksum {lad['open/server']['checksum']} != the worker's {want}", flush=True)
                ok = False
            ok = ok and step("engine", get(server.__ray_call__.remote(srv_engine_load, wref, T), "engine call",
                                           timeout=T + 15, who="server"), lad)
            if not ok:
                return False
            ipc, snap, split = [], [], []
            for _ in range(a.repeats):
                n = next_version()
                t0 = time.perf_counter()
                got = get(server.load_weights.remote(worker.share.remote(n), n), f"ipc load v{n}", who="server")
                ipc.append(time.perf_counter() - t0)
                assert got == n, (got, n)
                snap.append(get(worker.last_snapshot_s.remote()))
                split.append(get(server.__ray_call__.remote(srv_last_load)))
            lad["ipc"] = ipc
            R["ipc"], R["snapshot"], R["ipc_split"] = ipc, snap, split
            R["ipc_level"] = level
            return True
        except Exception as e:
            lad["failed"] = f"{type(e).__name__}: {str(e)[:300]}"
            print(f"  ladder at sleep level {level} failed: {lad['failed']}", flush=True)
            return False

    def sync_part():
        nonlocal server, server_level
        R["raw"] = get(worker.raw_copy.remote(), "raw copy")
        lad = R.setdefault("ladder", {})
        n = next_version()
        wref = worker.share.remote(n)
        w = get(wref, "share (producer handles)", who="worker")
        lad["share"] = {"handles": len(w.handles), "nbytes": w.nbytes, "snapshot_s": get(worker.last_snapshot_s.remote())}
        want = get(worker.checksum.remote())
        if step("open/plain", get(opener.open.remote(wref, T), "open/plain call", timeout=T + 15, who="opener"), lad):
            lad["open/plain_equal"] = lad["open/plain"]["checksum"] == want
            print(f"  open/plain: checksum equal to the worker's: {lad['open/plain_equal']}", flush=True)
        ok = server_ladder(server_level)
        if not ok and server_level and a.retry_without_sleep:
            print("  -> the same ladder on a server without sleep mode", flush=True)
            ray.kill(server)
            time.sleep(3)
            server, server_level = start_server(0), 0
            ok = server_ladder(0)
        if ok and a.ok_file:
            a.ok_file.write_text(json.dumps({"ipc": R["ipc"], "sleep_level": server_level}))
        if ok:
            R["_greedy_ipc"] = greedy()
            box = get(server.__ray_call__.remote(srv_reload, a.repeats, T), "reload alone", timeout=T + 15, who="server")
            if "out" in box:
                o = box["out"]
                R["reload_plan"], R["reload"] = o["plan"], o["vllm"]
                R["plan_status"] = f"{o['status']} (timed paths: {o['plan_path']}, {o['vllm_path']})"
            else:
                step("reload alone", box, R.setdefault("ladder", {}))

    def store_part():
        n = v[0]  # the same version as the last ipc load, through the object store: the same greedy tokens
        S = a.store_timeout
        t0 = time.perf_counter()
        (ref,) = get(worker.host_weights.remote(n), timeout=S, who="worker")
        t1 = time.perf_counter()
        print(f"  store hop 1, the worker's CPU state dict into the object store: {t1 - t0:.2f} s", flush=True)
        got = get(server.load_weights.remote(ref, n), "store hop 2, the server reads the ref and reloads", timeout=S,
                  who="server")
        t2 = time.perf_counter()
        assert got == n
        del ref
        R["store"] = [t2 - t0]
        R["store_hops"] = [t1 - t0, t2 - t1]
        R["store_split"] = get(server.__ray_call__.remote(srv_last_load))
        if "_greedy_ipc" in R:
            R["same_tokens"] = greedy() == R.pop("_greedy_ipc")
        n = next_version()
        get(worker.pretend_elsewhere.remote(True))
        t0 = time.perf_counter()
        box = in_thread(lambda: CudaIpcSync(worker, [server], version=n - 1).push(n), S)
        seconds = time.perf_counter() - t0
        get(worker.pretend_elsewhere.remote(False))
        if "out" not in box:
            raise RuntimeError(f"fallback push: {box.get('error') or 'hung: ' + box.get('stack', '')}")
        R["fallback"] = [seconds]
        print(f"  fallback push (object store once): {R['fallback'][0]:.3f} s", flush=True)
        R["fallback_split"] = get(server.__ray_call__.remote(srv_last_load))

    def sleep_part():
        if server_level == 0:
            raise RuntimeError("the server runs without sleep mode (--sleep-level 0, or the ladder fell back)")
        n = v[0]
        for level in (1, 2):
            get(server.__ray_call__.remote(set_level, level))
            awake = gpu_used_mib()
            t0 = time.perf_counter()
            get(server.sleep.remote(), f"sleep level {level}", who="server")
            s_sleep = time.perf_counter() - t0
            asleep = gpu_used_mib()
            t0 = time.perf_counter()
            if level == 1:
                get(server.wake_up.remote(), "wake_up", who="server")
            elif "ipc" in R:  # level 2 wakes by new weights (the weight phase's step), by IPC
                n = next_version()
                get(server.load_weights.remote(worker.share.remote(n), n), "wake by an IPC load", who="server")
            else:
                n = next_version()
                get(server.load_weights.remote(worker.cpu_state.remote(), n), "wake by a CPU load",
                    timeout=a.store_timeout, who="server")
            s_wake = time.perf_counter() - t0
            R[f"sleep{level}"] = dict(awake=awake, asleep=asleep, woken=gpu_used_mib(), sleep_s=s_sleep, wake_s=s_wake)
        R["after_sleep_tokens"] = len(greedy()[0])

    def ray_part():
        sp = SamplingParams(temperature=1.0, top_k=20, max_tokens=a.new, seed=1)
        counter = iter(range(10**6))

        def reqs(b):
            return [[{"role": "user", "content": f"{next(counter)} Count from one to one hundred."}] for _ in range(b)]

        R["rounds"] = a.rounds
        default = get(server.__ray_call__.remote(lambda self: sys.getswitchinterval()))
        for si in [float(x) for x in a.switch_intervals.split(",")]:
            got = get(server.__ray_call__.remote(set_switch_interval, si))
            for b in map(int, a.batches.split(",")):
                get([server.generate.remote(m, sp) for m in reqs(b)], who="server")  # warm-up at this batch size
                ray_runs, local_runs = [], []
                for _ in range(a.rounds):  # the two paths alternate; best of each (runs of one batch vary ~10-30%)
                    t0 = time.perf_counter()
                    calls = get([server.generate.remote(m, sp) for m in reqs(b)], who="server")
                    ray_runs.append(sum(len(c.completion_ids) for c in calls) / (time.perf_counter() - t0))
                    local = [GenerationRequest(m, sp) for m in reqs(b)]
                    tok_local, t_local = get(server.__ray_call__.remote(in_actor_batch, local), who="server")
                    local_runs.append(tok_local / t_local)
                R[f"ray{b}@{got}"] = (max(ray_runs), max(local_runs))
                print(f"  switch interval {got * 1e3:g} ms, batch {b}: through Ray {[round(x) for x in ray_runs]}, "
                      f"in the actor {[round(x) for x in local_runs]} tokens/s", flush=True)
        get(server.__ray_call__.remote(set_switch_interval, default))

    section("weight sync", sync_part, R)
    if "store" in parts:
        section("object store", store_part, R)
    if "sleep" in parts:
        section("sleep mode", sleep_part, R)
    if "ray" in parts:
        section("through Ray", ray_part, R)
    report(R, nbytes)


def report(R: dict, nbytes: int) -> None:
    gb = nbytes / 1e9
    print(f"\n## Weight sync, {gb:.2f} GB float32 Trainer state -> vLLM bf16 (1.7 B Qwen3-shaped), one H200")
    for name, x in R.get("ladder", {}).items():
        if name.startswith("sleep") and isinstance(x, dict):
            print(f"IPC ladder, server at {name}: " + ", ".join(
                f"{k}: {'ok' if isinstance(y, (dict, list)) else y}" for k, y in x.items()))
        else:
            print(f"IPC ladder, {name}: {json.dumps(x, default=str)}")
    if "raw" in R:
        raw = R["raw"]
        print(f"raw device-to-device copy of the same bytes: {raw * 1e3:.1f} ms ({2 * nbytes / raw / 1e12:.2f} TB/s r+w)")
        print("| path | seconds (each call) | best | best / raw copy |")
        print("|---|---|---|---|")
        for key, name in (("ipc", "CUDA IPC of the parameters, PolicyServer.load_weights"),
                          ("store", "object store, 2 hops (the CPU path)"),
                          ("fallback", "IPC fallback: object store once"),
                          ("reload", "vLLM reload_weights alone, fp32 on its GPU"),
                          ("reload_plan", "the recorded copy plan alone, fp32 on its GPU"),
                          ("snapshot", "  of ipc: the worker's share (synchronize; handles at the first)")):
            if key in R:
                xs = R[key]
                print(f"| {name} | {' / '.join(f'{x:.3f}' for x in xs)} | {min(xs):.3f} | {min(xs) / raw:.1f}x |")
        for key in ("ipc_split", "store_hops", "store_split", "fallback_split"):
            if key in R:
                print(f"{key}: {json.dumps(R[key], default=lambda x: round(x, 3) if isinstance(x, float) else str(x))}")
        if "ipc" in R and "store" in R:
            print(f"ipc vs object store: {min(R['store']) / min(R['ipc']):.1f}x faster; greedy tokens after ipc == "
                  f"after object store of the same version: {R.get('same_tokens')}")
    for level in (1, 2):
        if f"sleep{level}" in R:
            s = R[f"sleep{level}"]
            print(f"sleep level {level}: GPU used {s['awake']} -> {s['asleep']} MiB asleep (frees "
                  f"{(s['awake'] - s['asleep']) / 1024:.1f} GiB) -> {s['woken']} MiB woken; sleep {s['sleep_s']:.2f} s, "
                  f"{'wake_up' if level == 1 else 'wake by a load'} {s['wake_s']:.2f} s")
    if "after_sleep_tokens" in R:
        print(f"greedy completion after the sleeps: {R['after_sleep_tokens']} tokens")
    if "plan_status" in R:
        print(f"copy plan: {R['plan_status']}")
    for k in sorted((k for k in R if k.startswith("ray")), key=lambda k: (float(k.split("@")[1]), int(k[3:].split("@")[0]))):
        via, local = R[k]
        b, si = k[3:].split("@")
        print(f"switch interval {float(si) * 1e3:g} ms, batch {b}: {via:,.0f} tokens/s through Ray (concurrent actor "
              f"calls), {local:,.0f} inside the actor's process (VLLMEngine.generate), best of {R.get('rounds')}: "
              f"{via / local:.2f}x")
    for f in R.get("failed", []):
        print("FAILED", f)


if __name__ == "__main__":
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # timeout(1): end the local Ray cluster on the way out
    try:
        main()
    finally:
        if ray.is_initialized():
            ray.shutdown()
