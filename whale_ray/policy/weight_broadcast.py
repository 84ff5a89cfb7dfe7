"""Weights by broadcast (`weight.weight_sync: broadcast`): the Trainer's rank-0 worker sends each new version to
every PolicyServer replica over a process group of their own, in a few flat buckets; no object store.

The group. Trainer rank 0 is group rank 0, replica i is rank i + 1; it is not Ray Train's default group (that
one holds the Trainer's workers only and lives and dies with a Ray Train run). It is made without
`init_process_group` (which allows one default group per process): a `TCPStore` client and a
ProcessGroupGloo (training on CPU) or ProcessGroupNCCL (on GPU) constructed directly over a `PrefixStore`
named by the group's generation. The store's server is hosted by whoever orchestrates the broadcasts
(actors/broadcast_sync.py: the Coordinator's process), so its address is known before any member starts
and outlives any member: a rebuilt group is the same store under the next generation's prefix.

One broadcast. Rank 0 packs its parameters into its buckets (one grouped copy), then broadcasts a header
(version, a digest of the layout) and each bucket. The layout (name, bucket, offset, shape, dtype of every
tensor; tensors sharing storage, a tied lm_head, are sent once) is rank 0's, published in the store when the
group is built; a replica allocates its receive buckets from it once per group and hands the engine views of
them (`load_weights` copies them into the model, so the buckets are free again for the next version).
Rank 0 and every replica keep their buckets between versions: one more copy of the state each (6.9 GB for a
1.7 B model in float32), on the GPU with nccl. That is meant for roles on GPUs of their own; on one shared
GPU, `cuda_ipc` needs no copy on the receiving side.

Faults. Every member's wait is bounded by the group's timeout: a member that is gone or never joins makes
the others raise `WeightBroadcastError` (naming the rank and the cause) within it instead of hanging, and a
failed member forgets its group, so the next broadcast builds a new one. Who is gone, by name, is the
orchestrator's to say: it sees every member's call.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

import torch

Backend = Literal["gloo", "nccl"]
ALIGN = 256  # bytes: every tensor starts where the caching allocator would start one


class WeightBroadcastError(RuntimeError):
    """A broadcast of weights did not complete; the message names who failed and why."""


@dataclass(frozen=True)
class GroupSpec:
    """Where and how the members of one generation of the group meet (every member gets the same one)."""

    host: str  # the store's address
    port: int
    generation: int  # the store prefix: a rebuilt group is the next generation
    world: int  # 1 + the replicas
    backend: Backend
    timeout_s: float
    bucket_bytes: int

    @property
    def key(self) -> tuple[str, int, int]:
        """Which group: its store and generation (another orchestrator's store numbers its generations anew)."""
        return self.host, self.port, self.generation


@dataclass(frozen=True)
class Slot:
    name: str
    bucket: int
    offset: int  # bytes into the bucket
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class Layout:
    slots: tuple[Slot, ...]  # every name of the state dict, aliases included, in its order
    sizes: tuple[int, ...]  # bytes per bucket

    def digest(self) -> int:
        """63 bits of a hash of the layout: the header carries it, so a replica never reads a bucket as the wrong
        tensors."""
        text = json.dumps(self.to_json(), sort_keys=True).encode()
        return int.from_bytes(hashlib.sha256(text).digest()[:8], "little") >> 1

    def to_json(self) -> dict:
        return {"sizes": list(self.sizes),
                "slots": [[s.name, s.bucket, s.offset, list(s.shape), str(s.dtype).removeprefix("torch.")]
                          for s in self.slots]}

    @classmethod
    def from_json(cls, data: dict) -> "Layout":
        slots = tuple(Slot(n, b, o, tuple(shape), getattr(torch, d)) for n, b, o, shape, d in data["slots"])
        return cls(slots, tuple(data["sizes"]))


def plan(state: dict[str, torch.Tensor], bucket_bytes: int) -> Layout:
    """Tensors packed in order into buckets of at most `bucket_bytes` (a larger tensor gets a bucket of its own)."""
    slots: dict[str, Slot] = {}
    first: dict[tuple, str] = {}
    sizes = [0]
    for name, t in state.items():
        key = (t.data_ptr(), tuple(t.shape), t.dtype)
        if key in first:  # shares storage with a tensor already placed: sent once
            s = slots[first[key]]
            slots[name] = Slot(name, s.bucket, s.offset, s.shape, s.dtype)
            continue
        first[key] = name
        n = _aligned(t.numel() * t.element_size())
        if sizes[-1] and sizes[-1] + n > bucket_bytes:
            sizes.append(0)
        slots[name] = Slot(name, len(sizes) - 1, sizes[-1], tuple(t.shape), t.dtype)
        sizes[-1] += n
    return Layout(tuple(slots.values()), tuple(sizes))


class _Member:
    """What the sender and a receiver share: the group of one generation, and the buckets laid out for it."""

    role = "member"

    def __init__(self) -> None:
        self.spec: GroupSpec | None = None
        self.rank = -1
        self.store: torch.distributed.Store | None = None
        self.pg = None
        self.layout: Layout | None = None
        self.buckets: list[torch.Tensor] = []
        self.tried = -1  # the generation last joined or tried: an error names it even before the group is up

    def group(self) -> tuple[str, int, int] | None:
        """The `GroupSpec.key` of the group this member holds, None if none (new, or after a failure)."""
        return None if self.spec is None else self.spec.key

    def _join(self, spec: GroupSpec, rank: int, device: torch.device) -> None:
        self.leave()
        self.rank, self.tried = rank, spec.generation
        timeout = timedelta(seconds=spec.timeout_s)
        client = torch.distributed.TCPStore(spec.host, spec.port, is_master=False, timeout=timeout)
        store = torch.distributed.PrefixStore(f"whale-weights/{spec.generation}", client)
        if spec.backend == "gloo":
            pg = torch.distributed.ProcessGroupGloo(store, rank, spec.world, timeout)
        else:
            if device.type != "cuda":
                raise WeightBroadcastError(f"{self._who(rank)}: the nccl backend needs a CUDA device, got {device}")
            # every member present first, within the timeout: NCCL's own rendezvous (at the first collective) waits
            # for a missing rank without one
            store.set(f"joined/{rank}", "1")
            store.wait([f"joined/{r}" for r in range(spec.world)], timeout)
            opts = torch.distributed.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            # A timed-out collective aborts this group's communicator and raises in wait(); torch's default (3)
            # would end the whole process, the Trainer's worker or the PolicyServer with it. Read at construction.
            before = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
            os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "2"
            try:
                pg = torch.distributed.ProcessGroupNCCL(store, rank, spec.world, opts)
            finally:
                if before is None:
                    os.environ.pop("TORCH_NCCL_ASYNC_ERROR_HANDLING")
                else:
                    os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = before
        self.spec, self.store, self.pg = spec, store, pg

    def leave(self) -> None:
        """Forget the group (its peers see this member gone); the next broadcast builds a new one."""
        if self.pg is not None and hasattr(self.pg, "abort"):
            try:
                self.pg.abort()
            except Exception:  # already broken: nothing left to release
                pass
        self.spec, self.store, self.pg, self.layout, self.buckets = None, None, None, None, []

    def _broadcast(self, tensors: list[torch.Tensor]) -> None:
        opts = torch.distributed.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        works = [self.pg.broadcast([t], opts) for t in tensors]  # queued at once: the backend pipelines them
        for w in works:
            w.wait()
        if tensors[0].is_cuda:  # nccl's wait() only orders this thread's stream; an engine reads on its own
            torch.cuda.synchronize(tensors[0].device)

    def _header(self, version: int, device: torch.device) -> torch.Tensor:
        return torch.tensor([version, self.layout.digest(), len(self.buckets)], dtype=torch.int64, device=device)

    def _who(self, rank: int | None = None) -> str:
        return f"weight broadcast, {self.role} (rank {self.rank if rank is None else rank})"

    def _failed(self, what: str, e: BaseException) -> WeightBroadcastError:
        self.leave()
        cause = (str(e).strip().splitlines() or [""])[0][:300]
        return WeightBroadcastError(f"{self._who()}: {what} failed in group generation {self.tried}: "
                                    f"{type(e).__name__}: {cause}")


class Sender(_Member):
    """Rank 0: the Trainer's rank-0 worker."""

    role = "Trainer rank 0"

    def send(self, spec: GroupSpec, state: dict[str, torch.Tensor], version: int) -> int:
        """Broadcast `state` as `version` to the group of `spec` (built first if this member does not hold it);
        returns the bytes sent."""
        device = next(iter(state.values())).device
        try:
            if self.group() != spec.key:
                self._join(spec, 0, device)
                self.layout = plan(state, spec.bucket_bytes)
                self.buckets = [torch.empty(n, dtype=torch.uint8, device=device) for n in self.layout.sizes]
                self.store.set("layout", json.dumps(self.layout.to_json()))
            dst, src, seen = [], [], set()
            for s in self.layout.slots:
                if (s.bucket, s.offset) not in seen:
                    seen.add((s.bucket, s.offset))
                    dst.append(_view(self.buckets[s.bucket], s))
                    src.append(state[s.name].detach())
            torch._foreach_copy_(dst, src)  # one grouped copy, not one per tensor
            self._broadcast([self._header(version, device), *self.buckets])
        except WeightBroadcastError:
            self.leave()
            raise
        except Exception as e:
            raise self._failed(f"sending version {version}", e) from e
        return sum(self.layout.sizes)


class Receiver(_Member):
    """Rank 1..N: a PolicyServer replica."""

    role = "PolicyServer replica"

    def receive(self, spec: GroupSpec, rank: int, version: int) -> dict[str, torch.Tensor]:
        """Join the broadcast of `version` as `rank` (building the group of `spec` first if this member does not
        hold it); the state dict as views of this member's buckets (on its GPU for nccl, else on the CPU), valid
        until the next receive."""
        device = torch.device("cuda", torch.cuda.current_device()) if spec.backend == "nccl" else torch.device("cpu")
        try:
            if self.group() != spec.key or self.rank != rank:
                self._join(spec, rank, device)
                self.layout = Layout.from_json(json.loads(self.store.get("layout")))
                self.buckets = [torch.empty(n, dtype=torch.uint8, device=device) for n in self.layout.sizes]
            header = torch.zeros(3, dtype=torch.int64, device=device)
            self._broadcast([header])
            got, digest, n = (int(x) for x in header.tolist())
            expected = self._header(version, device).tolist()
            if [got, digest, n] != expected:
                raise WeightBroadcastError(
                    f"{self._who()}: expected version {version} in the layout this replica holds (digest {expected[1]}, "
                    f"{expected[2]} buckets), rank 0 sent version {got} (digest {digest}, {n} buckets)")
            self._broadcast(self.buckets)
        except WeightBroadcastError:
            self.leave()
            raise
        except Exception as e:
            raise self._failed(f"receiving version {version}", e) from e
        return {s.name: _view(self.buckets[s.bucket], s) for s in self.layout.slots}


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _view(flat: torch.Tensor, s: Slot) -> torch.Tensor:
    n = 1
    for d in s.shape:
        n *= d
    nbytes = n * torch.empty((), dtype=s.dtype).element_size()
    return flat[s.offset:s.offset + nbytes].view(s.dtype).view(s.shape)
