"""Weights from the Trainer's GPU to the PolicyServer's without a copy in between, where both are on one host.

The Trainer's rank-0 worker sends CUDA IPC handles of its parameters themselves (`Sharer`): no snapshot. The
parameters never move (optimizer steps and checkpoint loads write into them in place), so the handles are
made once per Ray Train run (torch.multiprocessing's `reduce_tensor`, keyed by the GPU's UUID) and every
version sends the same few tens of kilobytes with a new version number and the same `key`. The PolicyServer
opens them once (`SharedReader`: views of the Trainer's memory, kept while the key stays the same) and its
engine copies them into its own weights in place (the cast to its dtype included); nothing passes through
host memory, and per version the only copy is the engine's own.

What this asks of the caller, and why it holds in the weight phase: the server reads the Trainer's live
parameters, so a version must be loaded (the engine's copies finished: `PolicyService.load_weights_now`
synchronizes) before the Trainer steps again. The weight sync (actors/weight_sync.py's `CudaIpcSync`) loads
every server after each step before the loop trains again, and brings a restarted server to the weights on
record between steps. And the server lets go of the Trainer's memory (`SharedReader.close`, the sync's
`release`) before the Trainer's workers end (`release_workers`): views opened through IPC must not outlive
the process that exported them (torch's Note [Sharing CUDA tensors]), and a server that kept them would hold
a finished run's memory mapped for nothing.

A consumer that cannot see that GPU (another host, or a GPU not visible to its process) raises `Unreachable`;
the sync then sends it the weights through the object store, once (the Trainer's `host_weights`). CPU
training never makes `SharedWeights`: its weights go through the object store.

What a version costs this way, and against the object store: docs/performance.md (benchmarks/gpu_weight_sync.py).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SharedWeights:
    """A state dict on one GPU, by CUDA IPC handle (see the module docstring)."""

    version: int
    gpu_uuid: str
    key: str  # the same for every version of one producer's tensors: a reader keeps what it opened
    handles: tuple[tuple[str, tuple], ...]  # (name, rebuild_cuda_tensor's arguments from reduce_tensor)
    nbytes: int  # bytes of the distinct tensors


class Unreachable(ValueError):
    """The shared weights lie on a GPU this process cannot see: they have to come another way."""


def gpu_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def _device_of(state: dict[str, torch.Tensor]) -> torch.device:
    devices = {t.device for t in state.values()}
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        raise ValueError(f"share: the state dict must lie on one CUDA device, got {sorted(map(str, devices))}")
    return next(iter(devices))


class Sharer:
    """The producer's side (the Trainer's rank 0): handles of `state`'s tensors, made on the first `share` and
    again only if a tensor has moved (another address: new handles, a new key)."""

    def __init__(self) -> None:
        self._made: tuple | None = None  # (addresses, SharedWeights without its version)

    def share(self, state: dict[str, torch.Tensor], version: int) -> SharedWeights:
        from torch.multiprocessing.reductions import reduce_tensor

        device = _device_of(state)
        where = tuple((name, t.data_ptr(), tuple(t.shape), t.dtype) for name, t in state.items())
        if self._made is None or self._made[0] != where:
            handles = tuple((name, reduce_tensor(t.detach())[1]) for name, t in state.items())
            distinct = {t.data_ptr(): t.numel() * t.element_size() for t in state.values()}  # a tied head once
            self._made = (where, SharedWeights(-1, gpu_uuid(device.index or 0), uuid.uuid4().hex, handles,
                                               sum(distinct.values())))
        torch.cuda.synchronize(device)  # the step's writes are done before any reader copies
        made = self._made[1]
        return SharedWeights(int(version), made.gpu_uuid, made.key, made.handles, made.nbytes)


def local_device(w: SharedWeights) -> int | None:
    """The index, in this process, of the GPU that holds `w`; None where this process cannot see it."""
    if not torch.cuda.is_available():
        return None
    for i in range(torch.cuda.device_count()):
        if gpu_uuid(i) == w.gpu_uuid:
            return i
    return None


class SharedReader:
    """The consumer's side: a producer's tensors opened once, on local GPU `device`, and kept while its key
    stays the same (views of the producer's memory: `close` before the producer ends)."""

    def __init__(self) -> None:
        self.key: str | None = None
        self._views: dict[str, torch.Tensor] = {}

    def read(self, w: SharedWeights, device: int) -> dict[str, torch.Tensor]:
        if w.key != self.key:
            self.close()
            self._views = _open(w, device)
            self.key = w.key
        return self._views

    def close(self) -> None:
        self._views, self.key = {}, None


def _open(w: SharedWeights, device: int) -> dict[str, torch.Tensor]:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    views = {}
    with torch.cuda.device(device):
        for name, args in w.handles:
            args = list(args)
            args[6] = device  # the device index as the producer's process numbered it; the GPU is the same (UUID)
            views[name] = rebuild_cuda_tensor(*args)
        # Opening a handle makes only this thread's current stream wait for the producer's IPC event; the
        # engine reads on a stream of its own (vLLM's engine thread has a dedicated one), so wait here.
        torch.cuda.current_stream(device).synchronize()
    return views


def materialize(weights: dict[str, torch.Tensor] | SharedWeights, version: int,
                reader: SharedReader | None = None) -> dict[str, torch.Tensor]:
    """What an engine's load_weights takes: a state dict as it is, or `SharedWeights` read here through `reader`
    (a reader of its own if none is given); `Unreachable` where this process cannot see their GPU."""
    if not isinstance(weights, SharedWeights):
        return weights
    if weights.version != version:
        raise ValueError(f"load_weights: the shared weights are version {weights.version}, not {version}")
    device = local_device(weights)
    if device is None:
        raise Unreachable(f"load_weights: the weights lie on GPU {weights.gpu_uuid}, which this process cannot see")
    return (reader or SharedReader()).read(weights, device)
