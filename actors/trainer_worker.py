"""The Trainer's Ray Train workers: the commands they serve and what they answer.

The Trainer actor (actors/trainer.py) puts one `Envelope` per command in every rank's inbox and waits for a
`Reply` from every rank in the shared outbox. Each command is a dataclass, so what a command carries is
named where it is made and where it is served:

    Train(examples)   one RSFT step on an object ref of the full example list (each rank takes its shard)
    Host()            rank 0 puts its CPU state dict in the object store
    Broadcast(spec)   rank 0 sends its weights to the PolicyServer replicas' group (actors/broadcast_sync.py)
    Save(path)        rank 0 writes the full state; in the background with `background`, until `Flush`
    Flush()           waits for a background write (its failure is this command's); a new run's first command
    Load(path), Stop()

A command that changes the learner's state (Train, Load) or ends the run waits for a background write first, so a
checkpoint always holds the state of the step it was begun at.

Rank 0's weights after a change (the first `Reply`, a step that trained, a `Load`) travel as the sync mode
carries them (`Worker.weights`): an object ref of the CPU state dict (put here, read by the servers: the
weights cross the object store once; the ref lives as long as this worker), CUDA IPC handles of its
parameters (weight_sync cuda_ipc on a GPU: whale_ray/policy/cuda_ipc.py), or nothing (broadcast: sent when
asked).
"""

from __future__ import annotations

import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Union

import ray
import torch

from whale_ray.policy.cuda_ipc import Sharer
from whale_ray.policy.weight_broadcast import GroupSpec, Sender, WeightBroadcastError
from whale_ray.rsft import InvalidExamples, RSFTLearner


@dataclass(frozen=True)
class Train:
    examples: Any  # an object ref of the full list of (prompt_ids, completion_ids)


@dataclass(frozen=True)
class Host:
    pass


@dataclass(frozen=True)
class Broadcast:
    spec: GroupSpec


@dataclass(frozen=True)
class Save:
    path: str
    background: bool = False


@dataclass(frozen=True)
class Flush:
    pass


@dataclass(frozen=True)
class Load:
    path: str


@dataclass(frozen=True)
class Stop:
    pass


Command = Union[Train, Host, Broadcast, Save, Flush, Load, Stop]


@dataclass(frozen=True)
class Envelope:
    seq: int  # the "ready" reply answers 0, the Trainer's first command is 1
    command: Command
    sent: float = field(default_factory=time.time)  # wall clock: a step's queue legs are measured across processes


@dataclass(frozen=True)
class Reply:
    rank: int
    seq: int
    step: int | None = None  # the learner's step after the command
    weights: Any = None  # rank 0: see the module docstring
    metrics: dict[str, Any] = field(default_factory=dict)  # Train
    invalid: str | None = None  # Train: the examples were refused before any change (InvalidExamples)
    send_error: str | None = None  # Broadcast: the group failed; the Ray Train run goes on
    error: str | None = None  # the worker failed: the Ray Train run ends


def _ddp_kwargs() -> dict[str, Any]:
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    params = inspect.signature(DistributedDataParallel.__init__).parameters
    return {"forward_sync_buffers": False} if "forward_sync_buffers" in params else {"broadcast_buffers": False}


class Worker:
    """One rank's learner and what it answers to each command."""

    def __init__(self, config: dict, rank: int, learner: RSFTLearner) -> None:
        self.rank, self.learner = rank, learner
        self.mode, self.policy_gpu_share = config["weight_sync"], config["policy_gpu_share"]
        self.sharer = Sharer()  # rank 0: its parameters' IPC handles, made once for this run (cuda_ipc.py)
        self.sender = Sender()  # rank 0, weight_sync broadcast: its group with the replicas, kept between versions
        self.writing: tuple[threading.Thread, list[BaseException]] | None = None  # rank 0: a background Save

    def write(self, path: str) -> None:
        """Rank 0 writes the full state to `path` in a thread; the commands that follow read it (Host, Broadcast)
        or wait for it (`finish_write`)."""
        failure: list[BaseException] = []

        def save() -> None:
            try:
                self.learner.save(path)
            except BaseException as e:  # raised again by the command that waits for it
                failure.append(e)

        thread = threading.Thread(target=save, name=f"checkpoint {path}", daemon=True)
        thread.start()
        self.writing = (thread, failure)

    def finish_write(self) -> None:
        """Waits for the background write, if one runs; its failure is raised here."""
        if self.writing is None:
            return
        (thread, failure), self.writing = self.writing, None
        thread.join()
        if failure:
            raise failure[0]

    def host(self) -> Any:
        if self.rank != 0:
            return None
        return ray.put(self.learner.state_dict())

    def weights(self) -> Any:
        if self.rank != 0 or self.mode == "broadcast":
            return None
        if self.mode == "cuda_ipc" and self.learner.device.type == "cuda":
            return self.sharer.share(self.learner.model.state_dict(), self.learner.step)
        return self.host()

    def mallocs(self) -> int:
        """The memory segments the caching allocator has taken from the driver so far (cudaMalloc calls)."""
        if self.learner.device.type != "cuda":
            return 0
        return torch.cuda.memory_stats(self.learner.device).get("num_device_alloc", 0)

    def make_room(self) -> bool:
        """Hands the step's cached memory back to the driver if a sleeping vLLM on this GPU could not wake into what
        is free (`policy_gpu_share` of the GPU); whether it did. Kept otherwise: the next step would pay for
        allocating it all again, several times the step's own arithmetic (benchmarks/gpu_learner_steps.py)."""
        if not self.policy_gpu_share or self.learner.device.type != "cuda":
            return False
        free, total = torch.cuda.mem_get_info(self.learner.device)
        if free >= self.policy_gpu_share * total:
            return False
        torch.cuda.empty_cache()
        return True

    def serve(self, command: Command) -> dict[str, Any]:
        """The reply's fields for one command."""
        learner = self.learner
        if not isinstance(command, (Host, Broadcast)):
            self.finish_write()
        match command:
            case Train(examples):
                t0, mallocs_before = time.perf_counter(), self.mallocs()
                try:
                    metrics = learner.train_step(ray.get(examples))
                except InvalidExamples as e:  # every rank checks the same full list before any change
                    return {"invalid": str(e)}
                t1, mallocs = time.perf_counter(), self.mallocs() - mallocs_before
                weights = self.weights() if metrics["trained"] else None
                t2 = time.perf_counter()
                emptied = self.make_room()
                # where a step's time goes on the worker, beside the Trainer's wall_s (the queues and the actor)
                timing = {"worker_step_s": t1 - t0, "worker_share_s": t2 - t1,
                          "worker_free_s": time.perf_counter() - t2, "cache_emptied": emptied, "cuda_mallocs": mallocs}
                return {"metrics": {**metrics, **timing}, "weights": weights, "step": learner.step}
            case Host():
                return {"weights": self.host()}
            case Broadcast(spec):
                if self.rank == 0:
                    try:
                        self.sender.send(spec, learner.model.state_dict(), learner.step)
                    except WeightBroadcastError as e:
                        return {"send_error": str(e)}
                return {}
            case Save(path, background):
                if self.rank == 0 and background:
                    self.write(path)
                elif self.rank == 0:
                    learner.save(path)
                return {}
            case Flush():
                return {}
            case Load(path):
                learner.load(path)
                return {"step": learner.step, "weights": self.weights()}
        raise TypeError(f"the Trainer's workers serve no command {command!r}")


def train_loop_per_worker(config: dict) -> None:
    """One Ray Train worker: build the learner, then serve commands from this rank's inbox until `Stop`."""
    import ray.train
    import ray.train.torch

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    inbox, outbox = config["inboxes"][rank], config["outbox"]
    seq = 0
    try:
        wrap = None
        if world > 1:  # no buffer sync in forward: ranks may run different numbers of forward passes per step
            def wrap(m):
                return ray.train.torch.prepare_model(m, parallel_strategy_kwargs=_ddp_kwargs())
        learner = RSFTLearner(config["model_path"], device=ray.train.torch.get_device(), rank=rank,
                              world_size=world, wrap_model=wrap, **config["learner"])
        if config.get("resume"):
            learner.load(config["resume"])
        if learner.device.type == "cuda":
            learner.warm_up()  # a fresh CUDA context's first pass, paid by the start rather than the first step
        worker = Worker(config, rank, learner)
        outbox.put(Reply(rank, seq, step=learner.step, weights=worker.weights()))
        while True:
            envelope: Envelope = inbox.get()
            seq = envelope.seq
            if isinstance(envelope.command, Stop):
                worker.finish_write()
                outbox.put(Reply(rank, seq))
                return
            received = time.time()
            fields = worker.serve(envelope.command)
            if "metrics" in fields:  # a step's legs through the queues; the Trainer ends the second (train_step)
                fields["metrics"].update(to_worker_s=received - envelope.sent, replied_at=time.time())
            outbox.put(Reply(rank, seq, **fields))
    except BaseException as e:
        outbox.put(Reply(rank, seq, error=f"rank {rank}: {e!r}\n{traceback.format_exc()}"))
        raise
