"""Weights from the Trainer's GPU to the PolicyServer's without the object store, where both are on one host.

The Trainer's rank-0 worker copies its parameters into a few flat GPU buckets (`share`: one device-to-device
copy, so the optimizer steps that follow cannot change what the server reads) and sends `SharedWeights`: the
buckets' CUDA IPC handles (torch.multiprocessing's `reduce_tensor`, keyed by the GPU's UUID) and where each
tensor lies in them, a few kilobytes. The PolicyServer opens the handles (`open_shared`: tensors that are
views of the Trainer's memory) and its engine copies them into its own weights in place; nothing passes
through host memory.

The buckets are allocated once and overwritten by each new version (`share(..., buckets=...)`): a snapshot
that no consumer ever opens (a server on another host) is then never left pinned by torch's IPC reference
counts, and the Trainer holds one snapshot, not one per version. So a version must be loaded before the
next one is shared: the weight phase loads after every step before it trains again, and a restarted
PolicyServer asks the Trainer actor, which answers between steps.

A consumer that cannot see that GPU (another host, or a GPU not visible to its process) gets the weights
through the object store, once: `materialize` asks the `fallback` (the Trainer actor) for an object ref that
rank 0 put there. CPU training never makes `SharedWeights`: its weights go through the object store as before.

On an H200 (benchmarks/gpu_weight_sync.py, 6.88 GB of float32 state of a 1.7 B model, through the PolicyServer
actor): 0.026-0.029 s a version from the driver's call (the snapshot 9-12 ms, opening the handles 5-8 ms, the
engine's copy plan 5 ms), against 4 ms for a raw copy of the bytes and 78 s through the object store; whole
`whale run`s with `weight.weight_sync: cuda_ipc` finished there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

BUCKET_BYTES = 1 << 30  # a few large IPC allocations instead of one per tensor (each open costs a driver call)


@dataclass(frozen=True)
class Slot:
    name: str
    bucket: int
    offset: int  # bytes into the bucket
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class SharedWeights:
    """A state dict on one GPU, by CUDA IPC handle (see the module docstring)."""

    version: int
    gpu_uuid: str
    slots: tuple[Slot, ...]
    handles: tuple[tuple, ...]  # per bucket: rebuild_cuda_tensor's arguments (from reduce_tensor)
    nbytes: int  # bytes of the distinct tensors
    fallback: Any = None  # an actor with host_weights(version) -> [object ref of a CPU state dict]


def gpu_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def share(state: dict[str, torch.Tensor], version: int, *, buckets: list[torch.Tensor] | None = None,
          fallback: Any = None, bucket_bytes: int = BUCKET_BYTES) -> tuple[SharedWeights, list[torch.Tensor]]:
    """A snapshot of `state` (CUDA tensors, one device) in flat buckets, and its handles. The caller keeps the
    returned buckets alive and hands them back with the next version, which overwrites them (where the layout
    is the same; else new ones are allocated)."""
    from torch.multiprocessing.reductions import reduce_tensor

    devices = {t.device for t in state.values()}
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        raise ValueError(f"share: the state dict must lie on one CUDA device, got {sorted(map(str, devices))}")
    device = next(iter(devices))
    # Tensors that share storage (a tied lm_head) are copied once; their names point at the same slot.
    plan: list[tuple[str, torch.Tensor]] = []
    alias: dict[str, str] = {}
    first: dict[tuple, str] = {}
    for name, t in state.items():
        key = (t.data_ptr(), tuple(t.shape), t.dtype)
        if key in first:
            alias[name] = first[key]
        else:
            first[key] = name
            plan.append((name, t))
    old = buckets
    layout: list[list[tuple[str, torch.Tensor, int]]] = [[]]
    used = 0
    for name, t in plan:
        n = _aligned(t.numel() * t.element_size())
        if used and used + n > bucket_bytes:
            layout.append([])
            used = 0
        layout[-1].append((name, t, used))
        used += n
    sizes = [max(off + _aligned(t.numel() * t.element_size()) for _, t, off in items) for items in layout]
    if old and [f.numel() for f in old] == sizes and all(f.device == device for f in old):
        flats = list(old)
    else:
        flats = [torch.empty(n, dtype=torch.uint8, device=device) for n in sizes]
    slots: dict[str, Slot] = {}
    dst, src = [], []
    for b, items in enumerate(layout):
        for name, t, off in items:
            dst.append(_view(flats[b], off, tuple(t.shape), t.dtype))
            src.append(t.detach())
            slots[name] = Slot(name, b, off, tuple(t.shape), t.dtype)
    torch._foreach_copy_(dst, src)  # one launch group, not a copy kernel per tensor
    for name, target in alias.items():
        s = slots[target]
        slots[name] = Slot(name, s.bucket, s.offset, s.shape, s.dtype)
    torch.cuda.synchronize(device)  # the copies are done before any consumer reads
    handles = tuple(reduce_tensor(f)[1] for f in flats)
    nbytes = sum(t.numel() * t.element_size() for _, t in plan)
    ordered = tuple(slots[name] for name in state)
    return SharedWeights(int(version), gpu_uuid(device.index or 0), ordered, handles, nbytes, fallback), flats


def local_device(w: SharedWeights) -> int | None:
    """The index, in this process, of the GPU that holds `w`; None where this process cannot see it."""
    if not torch.cuda.is_available():
        return None
    for i in range(torch.cuda.device_count()):
        if gpu_uuid(i) == w.gpu_uuid:
            return i
    return None


def open_shared(w: SharedWeights, device: int) -> dict[str, torch.Tensor]:
    """The state dict as views of the producer's buckets, on local GPU `device` (see `local_device`)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    flats = []
    with torch.cuda.device(device):
        for args in w.handles:
            args = list(args)
            args[6] = device  # the device index as the producer's process numbered it; the GPU is the same (UUID)
            flats.append(rebuild_cuda_tensor(*args))
        # Opening a handle makes only this thread's current stream wait for the producer's copy (its IPC event);
        # the engine reads on a stream of its own (vLLM's engine thread has a dedicated one), so wait here.
        torch.cuda.current_stream(device).synchronize()
    return {s.name: _view(flats[s.bucket], s.offset, s.shape, s.dtype) for s in w.slots}


def materialize(weights: Any, version: int) -> dict[str, torch.Tensor]:
    """What an engine's load_weights takes: a state dict as it is, or `SharedWeights` opened here (same host)
    or else fetched once through the object store from its fallback."""
    if not isinstance(weights, SharedWeights):
        return weights
    if weights.version != version:
        raise ValueError(f"load_weights: the shared weights are version {weights.version}, not {version}")
    device = local_device(weights)
    if device is not None:
        return open_shared(weights, device)
    if weights.fallback is None:
        raise ValueError(f"load_weights: the weights lie on GPU {weights.gpu_uuid}, which this process cannot "
                         "see, and they name no fallback to fetch them from")
    import ray

    (ref,) = ray.get(weights.fallback.host_weights.remote(version))
    return ray.get(ref)


def _aligned(n: int) -> int:
    return (n + 255) // 256 * 256  # every tensor starts 256-byte aligned, as the caching allocator gives them


def _view(flat: torch.Tensor, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    n = 1
    for d in shape:
        n *= d
    nbytes = n * torch.empty((), dtype=dtype).element_size()
    return flat[offset:offset + nbytes].view(dtype).view(shape)
