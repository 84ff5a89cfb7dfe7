"""Weight sync by broadcast over NCCL (`weight.weight_sync: broadcast`), against NVLink's own copy rate measured in
the same run: issue 16's table.

A Qwen3-1.7B-shaped state dict with random weights (float32, as the Trainer holds it: 6.9 GB; `--dtype
bfloat16` halves it) on GPU 0 is sent by `whale_ray.policy.weight_broadcast.Sender` (what the Trainer's rank 0
runs) to `Receiver`s on GPUs 1..R (what each PolicyServer replica runs), one process per GPU, for R in
`--replicas` (default 1 and 3, those that fit the visible GPUs). One version's time runs from the go signal (the
processes are started and the group is built and warmed up by a first version before) until the last member's
buckets are complete on its GPU, `--rounds` versions each; each received version is checked bit for bit
against the sent one once. The reference rate is a plain device-to-device copy of the same bytes, GPU 0 to
GPU 1 (over NVLink where the GPUs have it), timed in this process first.

What it leaves out: the Ray calls around a broadcast (a few ms: actors/broadcast_sync.py) and the engine's
load of the received buffers (vLLM's copy plan: benchmarks/gpu_weight_sync.py measured 5 ms for this model).

    python benchmarks/gpu_broadcast.py [--replicas 1,3] [--rounds 5] [--bucket-mb 512] [--dtype float32]

Prints a markdown table and one `RESULTS {json}` line. Fewer than 2 visible GPUs: says so and exits 0.
"""

from __future__ import annotations

import os

os.environ["NCCL_NVLS_ENABLE"] = "0"  # NVLink multicast stays off on the lent machines (device README)

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from whale_ray.policy.weight_broadcast import GroupSpec, Receiver, Sender, plan  # noqa: E402

# Qwen3-1.7B's shapes (its config.json); the weights are random
QWEN3_1_7B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True)


def model_state(device: torch.device, dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    """Every tensor of the model's state dict, random, on `device`; the tied lm_head shares the embedding."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    with torch.device("meta"):
        shapes = Qwen3ForCausalLM(Qwen3Config(**QWEN3_1_7B)).state_dict(keep_vars=True)  # a tie is one object
    gen = torch.Generator(device=device).manual_seed(seed)
    made: dict[int, torch.Tensor] = {}
    state = {}
    for name, t in shapes.items():
        if id(t) not in made:  # a tied tensor is the same object on the meta model
            made[id(t)] = torch.randn(t.shape, generator=gen, device=device, dtype=torch.float32).to(dtype)
        state[name] = made[id(t)]
    return state


def copy_rate(nbytes: int, rounds: int) -> tuple[float, float]:
    """Seconds and GB/s of copying `nbytes` from GPU 0 to GPU 1, best of `rounds`."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")
    dst.copy_(src)  # warm: peer access set up
    torch.cuda.synchronize("cuda:0"), torch.cuda.synchronize("cuda:1")
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize("cuda:0"), torch.cuda.synchronize("cuda:1")
        best = min(best, time.perf_counter() - t0)
    del src, dst
    torch.cuda.empty_cache()
    return best, nbytes / best / 1e9


def member(rank: int, spec: GroupSpec, dtype_name: str, rounds: int, out: "mp.Queue") -> None:
    """One process on GPU `rank`: rank 0 sends, the others receive; each timed version's end time to `out`."""
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    store = torch.distributed.TCPStore(spec.host, spec.port, is_master=False)
    dtype = getattr(torch, dtype_name)
    state = model_state(device, dtype) if rank == 0 else None
    peer = Sender() if rank == 0 else Receiver()
    try:
        for version in range(rounds + 1):  # version 0 builds the group and warms NCCL up, untimed
            store.wait([f"go/{spec.generation}/{version}"])
            start = time.time()
            if rank == 0:
                peer.send(spec, state, version)
            else:
                got = peer.receive(spec, rank, version)
            torch.cuda.synchronize(device)
            end = time.time()
            if rank != 0 and version == 1:  # bit for bit once: the same random state, made here on this GPU
                sent = model_state(device, dtype)
                bad = [k for k in sent if not torch.equal(got[k], sent[k])]
                del sent
                torch.cuda.empty_cache()
                if bad:
                    raise RuntimeError(f"rank {rank}: received tensors differ from those sent: {bad[:3]}")
            out.put({"rank": rank, "version": version, "start": start, "end": end})
    except BaseException as e:
        out.put({"rank": rank, "error": f"{type(e).__name__}: {e}"})
        raise


def run_replicas(replicas: int, args: argparse.Namespace, nbytes: int, generation: int) -> dict:
    ctx = mp.get_context("spawn")
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    spec = GroupSpec("127.0.0.1", store.port, generation, replicas + 1, "nccl", args.timeout_s, args.bucket_mb << 20)
    out = ctx.Queue()
    procs = [ctx.Process(target=member, args=(r, spec, args.dtype, args.rounds, out)) for r in range(replicas + 1)]
    for p in procs:
        p.start()
    seconds = []
    try:
        for version in range(args.rounds + 1):
            store.set(f"go/{generation}/{version}", "1")
            marks = [out.get(timeout=args.timeout_s * 3 + 600) for _ in procs]
            errors = [m["error"] for m in marks if "error" in m]
            if errors:
                raise RuntimeError("; ".join(errors))
            start = next(m["start"] for m in marks if m["rank"] == 0)
            if version:  # version 0 built the group
                seconds.append(max(m["end"] for m in marks) - start)
            else:
                first = max(m["end"] for m in marks) - start
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    best = min(seconds)
    return {"replicas": replicas, "bytes": nbytes, "first_s": first, "seconds": seconds, "best_s": best,
            "gb_s": nbytes / best / 1e9}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", default="1,3", help="replica counts, each on GPUs of its own (1..R)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--bucket-mb", type=int, default=512)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--timeout-s", type=float, default=120.0)
    args = ap.parse_args()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < 2:
        print(f"gpu_broadcast: skipped: it needs at least 2 visible GPUs (a sender and a replica), this machine "
              f"shows {gpus}")
        return 0
    counts = [r for r in (int(x) for x in args.replicas.split(",")) if r + 1 <= gpus]
    skipped = [r for r in (int(x) for x in args.replicas.split(",")) if r + 1 > gpus]
    state = model_state(torch.device("cuda:0"), getattr(torch, args.dtype))
    nbytes = sum(plan(state, args.bucket_mb << 20).sizes)
    n_params = sum(t.numel() for t in {id(t): t for t in state.values()}.values())
    del state
    torch.cuda.empty_cache()
    copy_s, copy_gb_s = copy_rate(nbytes, args.rounds)
    print(f"{n_params / 1e9:.2f} B parameters, {nbytes / 1e9:.2f} GB of {args.dtype} in buckets of {args.bucket_mb} MiB; "
          f"{gpus} GPUs; NCCL_NVLS_ENABLE={os.environ['NCCL_NVLS_ENABLE']}")
    rows = [run_replicas(r, args, nbytes, generation=i + 1) for i, r in enumerate(counts)]
    print("\n| weight sync, GPU 0 -> replicas | seconds (best; all) | GB/s | of the copy rate |")
    print("|---|---|---|---|")
    print(f"| device-to-device copy GPU 0 -> 1, same bytes | {copy_s:.4f} | {copy_gb_s:.1f} | 1.00 |")
    for row in rows:
        print(f"| broadcast to {row['replicas']} | {row['best_s']:.4f}; {' '.join(f'{s:.4f}' for s in row['seconds'])} "
              f"(first, with the group's build: {row['first_s']:.2f}) | {row['gb_s']:.1f} | {row['gb_s'] / copy_gb_s:.2f} |")
    for r in skipped:
        print(f"(broadcast to {r} replicas left out: it needs {r + 1} GPUs, {gpus} visible)")
    print("RESULTS " + json.dumps({"gpus": gpus, "dtype": args.dtype, "bytes": nbytes, "copy_s": copy_s,
                                   "copy_gb_s": copy_gb_s, "broadcast": rows, "left_out": skipped}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
