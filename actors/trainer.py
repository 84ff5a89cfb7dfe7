"""The Trainer actor: online RSFT steps on Ray Train workers.

Design. One `TorchTrainer.fit()` costs seconds of start/stop even with an empty training loop
(docs/performance.md), far more than an RSFT step on a small model, so the Trainer
does not run a fit per step. It starts ONE long-lived fit (a "session") the first time it needs the
workers and keeps it until `release_workers()` or `shutdown()`. The fit runs in a background thread of the
actor; each worker builds an `RSFTLearner` (DDP through `ray.train.torch.prepare_model` when num_workers > 1;
gloo on CPU, nccl on GPU) and serves typed commands (actors/trainer_worker.py):

    Trainer --(one ray.util.queue.Queue per rank: Envelope(seq, Train | Host | Broadcast | Save | Load | Stop))--> workers
    workers --(one shared outbox Queue: Reply(rank, seq, ...))--> Trainer

Every rank answers every command, so a call returns only when all ranks are done. For a step, every rank
gets the same object ref of the full example list and takes its own shard (see `RSFTLearner`). The weights
leave by the run's weight sync (actors/weight_sync.py), which asks this actor for them:
- `host_weights(v)`: an object ref of rank 0's CPU state dict, put by rank 0 after each step (weight_sync
  object_store, and cuda_ipc when training on CPU) or when asked (broadcast, and cuda_ipc's fallback for a
  server that cannot see the GPU): the weights cross the object store once, and nobody between fetches them.
  The ref lives as long as rank 0: when the Ray Train run ends the Trainer forgets it, and without a run it
  puts the state it last saved, when that is the current version (no workers start for it).
- `shared_weights(v)` (cuda_ipc, training on a GPU): the CUDA IPC handles of rank 0's parameters themselves
  (`whale_ray.policy.cuda_ipc.SharedWeights`, made once per Ray Train run). They are only good while the Ray
  Train run lives: when it ends (released, failed) the Trainer forgets them, and a `shared_weights` after that
  starts a new run from the last saved state (that same version).
- `broadcast_weights(spec, v)` (broadcast): nothing leaves rank 0 after a step; it sends the weights to the
  PolicyServer replicas over a group of their own while they receive (actors/broadcast_sync.py orchestrates;
  whale_ray/policy/weight_broadcast.py is the group).

`save_checkpoint(path, v, wait=False)` has rank 0 write the checkpoint in the background while the run goes on
(the next step's rollouts); `checkpoint_written(path)` waits for it, and only then is it the state a new run or a
restart starts from. Any call that changes the state (a step, a load, a release) waits for the write first.

`release_workers()` saves the full state (model + optimizer) under `checkpoint_dir/live`, ends the fit
and frees the workers' CPUs/GPUs (e.g. for the harness phase); the next call restarts from that state.

Faults. Every call that depends on the learner's state names the weight version the caller expects the
Trainer to hold (`train_step(examples, version)`: the version before the step), and a Trainer at another
version raises `StaleTrainer` instead of training, saving or handing out the wrong weights. A Ray Train
worker lost mid-step ends the fit: the Trainer starts a new one from its last saved state and, if that is
the expected version, runs the step again (so no optimizer step is lost or taken twice). The actor itself,
restarted by Ray, comes back from the last state it saved (`last_state.json` in its checkpoint_dir).

`LocalTrainer` is the same steps without Ray (one in-process `RSFTLearner`), for tests.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import ray
import torch

from actors.trainer_worker import (
    Broadcast,
    Command,
    Envelope,
    Flush,
    Host,
    Load,
    Reply,
    Save,
    Stop,
    Train,
    train_loop_per_worker,
)
from whale_ray.config import WeightPhaseConfig
from whale_ray.events import EventLog
from whale_ray.policy.cuda_ipc import SharedWeights
from whale_ray.policy.weight_broadcast import GroupSpec, WeightBroadcastError
from whale_ray.resources import ResourcesConfig
from whale_ray.rsft import STATE_FILE, InvalidExamples, RSFTLearner, SFTExample
from whale_ray.rsft_defaults import describe_checkpoint, resolve_weight_phase

log = logging.getLogger(__name__)

DEFAULT_CPUS_PER_WORKER = ResourcesConfig().trainer_worker.num_cpus  # resources.trainer_worker's default
START_TIMEOUT_S = 600.0  # waiting for the workers to be placed and to load the model
POLL_S = 1.0
LAST_STATE = "last_state.json"  # {"path", "step"}: the newest full state this Trainer saved


class StaleTrainer(RuntimeError):
    """The Trainer holds another weight version than the caller expects (it came back from an older state):
    the caller rolls the run back to its last commit."""


def _check_version(have: int, want: int | None, what: str) -> None:
    if want is not None and have != want:
        raise StaleTrainer(f"{what}: the Trainer holds weight version {have}, the run expects {want}")


def _learner_kwargs(w: WeightPhaseConfig, model_path: str, seed: int, max_len: int | None) -> dict[str, Any]:
    """The learner's settings; the optimiser's, where the config leaves them unset, as a run would resolve them
    (whale_ray/rsft_defaults.py; a run's Coordinator has resolved them already)."""
    w = resolve_weight_phase(w, describe_checkpoint(model_path))
    return {"lr": w.learning_rate, "warmup_steps": w.warmup_steps, "max_grad_norm": w.max_grad_norm,
            "precision": w.precision, "micro_batch": w.micro_batch, "epochs_per_step": w.sft_epochs_per_step,
            "seed": seed, "max_len": max_len}


def _examples(examples: list) -> list[SFTExample]:
    return [(list(p), list(c)) for p, c in examples]


def _no_op_metrics(version: int) -> dict[str, Any]:
    return {"trained": False, "n_examples": 0, "n_tokens": 0, "n_truncated": 0, "step": version,
            "version": version, "loss": float("nan"), "last_epoch_loss": float("nan"), "grad_norm": 0.0,
            "clipped": False, "wall_s": 0.0}


def _saved_step(path: Path) -> int | None:
    """The weight version a Trainer checkpoint holds (None: not one)."""
    state = path / STATE_FILE
    return int(json.loads(state.read_text())["step"]) if state.is_file() else None


def _check_checkpoint(path: Path) -> None:
    if not (path / STATE_FILE).is_file():
        raise FileNotFoundError(f"{path}: not a Trainer checkpoint (no {STATE_FILE})")


# ------------------------------------------------------------------------------------ without Ray
class LocalTrainer:
    """The Trainer's steps on one in-process RSFTLearner (no Ray); its weights as a state dict."""

    def __init__(self, model_path: str, cfg: WeightPhaseConfig, checkpoint_dir: str, *, seed: int = 0,
                 device: str | None = None, max_len: int | None = None) -> None:
        self.checkpoint_dir = Path(checkpoint_dir)
        device = device or ("cuda" if cfg.use_gpu else "cpu")
        self.learner = RSFTLearner(model_path, device=device, **_learner_kwargs(cfg, model_path, seed, max_len))
        self._written: str | None = None

    def version(self) -> int:
        return self.learner.step

    def train_step(self, examples: list[SFTExample], version: int | None = None) -> dict:
        _check_version(self.learner.step, version, "train_step")
        t0 = time.perf_counter()
        metrics = self.learner.train_step(_examples(examples))
        return {**metrics, "version": self.learner.step, "wall_s": time.perf_counter() - t0}

    def state_dict(self, version: int | None = None) -> dict[str, torch.Tensor]:
        _check_version(self.learner.step, version, "state_dict")
        return self.learner.state_dict()

    def save_checkpoint(self, path: str, version: int | None = None, *, wait: bool = True) -> str:
        """Written before it returns, `wait` or not: there is no run beside an in-process learner to overlap."""
        _check_version(self.learner.step, version, "save_checkpoint")
        self._written = str(self.learner.save(path))
        return self._written

    def checkpoint_written(self, path: str) -> str:
        if self._written != str(path):
            raise StaleTrainer(f"checkpoint_written: {path} was not saved by this trainer")
        return self._written

    def load_checkpoint(self, path: str) -> None:
        _check_checkpoint(Path(path))
        self.learner.load(path)

    def release_workers(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


def free_orphaned_worker_groups() -> list[str]:
    """Removes the placement groups of Ray Train runs whose controller died without ending them (a Trainer killed
    or lost takes its controller with it, as the owner of its actors); their ids. Ray Train starts a detached
    cleaner for this case, but it asks the state API, which a cluster without a dashboard does not serve (whale
    run's local one, the tests'), and the workers' CPUs and GPUs would stay reserved until the job ends: a Trainer
    restarted by Ray, or the next one of a rolled-back run, could then wait for them for ever. A group whose
    controller is dead serves no one, whichever run it was."""
    from ray._private import state
    from ray.core.generated import gcs_pb2
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    accessor = state.state._connect_and_get_accessor()
    # Whether the creator died is the group's own record; the actor table is another, which need not say DEAD at the
    # same moment, and a start in between would leave the group reserved.
    controllers = set()
    for raw in accessor.get_actor_table(None, None):
        a = gcs_pb2.ActorTableData.FromString(raw)
        if a.class_name == "TrainController":
            controllers.add(a.actor_id)
    freed = []
    for raw in accessor.get_placement_group_table():
        g = gcs_pb2.PlacementGroupTableData.FromString(raw)
        if (g.state != gcs_pb2.PlacementGroupTableData.REMOVED and not g.is_detached and g.creator_actor_dead
                and g.creator_actor_id in controllers):
            try:  # Ray Train's cleaner, where it works, or the GCS at its job's end may be removing it too
                remove_placement_group(PlacementGroup(ray.PlacementGroupID(g.placement_group_id)))
            except Exception as e:
                log.warning("placement group %s of a dead Ray Train run: not removed (%s)", g.placement_group_id.hex(), e)
                continue
            freed.append(g.placement_group_id.hex())
    return freed


# ------------------------------------------------------------------------------------ the actor
class _Session:
    """One long-lived TorchTrainer.fit() and its queues."""

    def __init__(self, trainer_cfg: dict, scaling_config: Any, torch_config: Any, storage_path: Path,
                 resume: str | None) -> None:
        from ray.train import FailureConfig, RunConfig
        from ray.train.torch import TorchTrainer
        from ray.util.queue import Queue

        n = scaling_config.num_workers
        self.world = n
        self.inboxes = [Queue(actor_options={"num_cpus": 0}) for _ in range(n)]
        self.outbox = Queue(actor_options={"num_cpus": 0})
        self.seq = 0
        self.error: BaseException | None = None
        fit = TorchTrainer(
            train_loop_per_worker,
            train_loop_config={**trainer_cfg, "inboxes": self.inboxes, "outbox": self.outbox, "resume": resume},
            scaling_config=scaling_config,
            torch_config=torch_config,
            run_config=RunConfig(name=f"rsft-{uuid.uuid4().hex[:8]}", storage_path=str(storage_path),
                                 failure_config=FailureConfig(max_failures=0, max_preemption_failures=0)),
        )
        self.thread = threading.Thread(target=self._fit, args=(fit,), name="rsft-fit", daemon=True)
        self.thread.start()

    def _fit(self, fit: Any) -> None:
        try:
            fit.fit()
        except BaseException as e:  # surfaced to the caller by `collect`
            self.error = e

    def send(self, command: Command) -> int:
        self.seq += 1
        for q in self.inboxes:
            q.put(Envelope(self.seq, command))
        return self.seq

    def collect(self, seq: int, timeout: float | None = None) -> Reply:
        """Wait for every rank's reply to command `seq`; return rank 0's. Raises if a worker failed."""
        from ray.util.queue import Empty

        replies: dict[int, Reply] = {}
        deadline = None if timeout is None else time.monotonic() + timeout
        while len(replies) < self.world:
            try:
                msg = self.outbox.get(timeout=POLL_S)
            except Empty:
                if not self.thread.is_alive():
                    raise RuntimeError(f"Ray Train run ended unexpectedly: {self.error!r}") from self.error
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"no reply from the Ray Train workers within {timeout:.0f}s")
                continue
            if msg.error is not None:
                raise RuntimeError(f"Ray Train worker failed: {msg.error}")
            if msg.seq == seq:
                replies[msg.rank] = msg
        if replies[0].invalid is not None:
            raise InvalidExamples(replies[0].invalid)
        return replies[0]

    def close(self, timeout: float = 120.0) -> None:
        try:
            if self.thread.is_alive():
                self.collect(self.send(Stop()), timeout=timeout)
        except Exception as e:  # the run already failed or hangs: nothing more to ask of it
            log.warning("trainer session did not stop cleanly: %s", e)
        self.thread.join(timeout=timeout)
        if self.thread.is_alive():
            log.warning("Ray Train run still running after %.0fs", timeout)
        for q in [*self.inboxes, self.outbox]:
            q.shutdown(force=True)


@ray.remote(num_cpus=0)
class Trainer:
    """RSFT on Ray Train workers (DDP over `cfg["num_workers"]`). Methods are called one at a time.

    The weight version is the learner's step: +1 for every `train_step` that trained, restored by
    `load_checkpoint`. Paths should be absolute (workers run in their own directories)."""

    def __init__(self, model_path: str, cfg: WeightPhaseConfig, checkpoint_dir: str, *, seed: int = 0,
                 resources_per_worker: dict[str, float] | None = None, max_len: int | None = None,
                 events_dir: str | None = None, policy_gpu_share: float = 0.0) -> None:
        from ray.train import ScalingConfig
        from ray.train.torch import TorchConfig

        w = cfg
        self.checkpoint_dir = Path(checkpoint_dir).resolve()
        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        resources = dict(resources_per_worker or {"CPU": DEFAULT_CPUS_PER_WORKER})
        if w.use_gpu:
            resources.setdefault("GPU", 1)
        self._scaling = ScalingConfig(num_workers=w.num_workers, use_gpu=w.use_gpu, resources_per_worker=resources)
        self._torch_config = TorchConfig(backend="nccl" if w.use_gpu else "gloo")
        self._trainer_cfg = {"model_path": str(Path(model_path).resolve()),
                             "learner": _learner_kwargs(cfg, model_path, seed, max_len),
                             "weight_sync": w.sync_mode, "policy_gpu_share": policy_gpu_share}
        self._session: _Session | None = None
        self._resume: str | None = None  # where a new session starts from (None: model_path)
        self._hosted: tuple[int, Any] | None = None  # (version, object ref of its CPU state dict)
        self._shared: SharedWeights | None = None  # rank 0's parameters by CUDA IPC, while its session lives
        self._version = 0
        self._broken: str | None = None
        self._closed = False
        self._group: tuple[Any, tuple] | None = None  # (session, GroupSpec.key) of the broadcast group rank 0 holds
        self._events = EventLog(events_dir) if events_dir else None
        self._start_s = 0.0  # seconds spent starting Ray Train runs that no step has reported yet
        self._writing: tuple[str, _Session | None] | None = None  # (path, its run): rank 0 writes it in the background
        if ray.get_runtime_context().was_current_actor_reconstructed:
            self._come_back()

    def _come_back(self) -> None:
        """Restarted by Ray: resume from the newest state this Trainer saved (else the base model)."""
        last = self.checkpoint_dir / LAST_STATE
        where = "the base model"
        if last.is_file():
            saved = json.loads(last.read_text())
            if (Path(saved["path"]) / STATE_FILE).is_file():
                self._resume, self._version = saved["path"], int(saved["step"])
                where = f"{saved['path']} (version {self._version})"
        self._emit("actor_restarted", f"the Trainer was restarted by Ray and resumes from {where}", actor="Trainer",
                   version=self._version)

    def _emit(self, kind: str, message: str, **data: Any) -> None:
        if self._events is not None:
            self._events.emit(kind, message, **data)
        else:
            log.warning("%s: %s", kind, message)

    def _saved(self, path: str) -> None:
        """`path` now holds the full state at the current version: a new session or a restart starts there."""
        self._resume = path
        tmp = self.checkpoint_dir / (LAST_STATE + ".tmp")
        tmp.write_text(json.dumps({"path": path, "step": self._version}))
        tmp.replace(self.checkpoint_dir / LAST_STATE)

    # ---------------------------------------------------------------------------------- session
    def _start(self) -> _Session:
        if self._closed:
            raise RuntimeError("Trainer was shut down")
        if self._broken is not None:
            raise RuntimeError(f"Trainer failed earlier ({self._broken}); call load_checkpoint(path) to resume")
        if self._session is None:
            t0 = time.perf_counter()
            self._free_orphans()
            session = _Session(self._trainer_cfg, self._scaling, self._torch_config,
                               self.checkpoint_dir / "ray_train", self._resume)
            try:
                ready = session.collect(0, timeout=START_TIMEOUT_S)
                # a new run's first command takes seconds to reach its workers (the first step's to_worker_s): the
                # start sends one, beside the run's first rollouts, so that the first step does not
                session.collect(session.send(Flush()), timeout=START_TIMEOUT_S)
            except BaseException:
                session.close(timeout=10)
                raise
            self._session = session
            self._adopt(ready)
            self._start_s += time.perf_counter() - t0
        return self._session

    def _free_orphans(self) -> None:
        try:  # a clean-up on the way: a GCS that does not answer it must not stop the Trainer's own work
            freed = free_orphaned_worker_groups()
        except Exception as e:
            log.warning("looking for placement groups of dead Ray Train runs failed: %s", e)
            return
        if freed:
            self._emit("trainer_workers_freed", f"freed {len(freed)} placement group(s) of Ray Train runs whose "
                       "controller died with its Trainer", actor="Trainer", groups=freed)

    def _adopt(self, reply: Reply) -> None:
        """The learner's step and rank 0's weights, where the reply carries them."""
        if reply.step is not None:
            self._version = int(reply.step)
        if isinstance(reply.weights, SharedWeights):
            self._shared = reply.weights
        elif reply.weights is not None:
            self._hosted = (self._version, reply.weights)

    def _end_session(self) -> _Session | None:
        """Forget the session, and what lives in its workers' memory: IPC handles, the refs rank 0 put."""
        session, self._session = self._session, None
        self._hosted = self._shared = None
        return session

    def _call(self, command: Command) -> Reply:
        session = self._start()
        try:
            return session.collect(session.send(command))
        except InvalidExamples:
            raise  # nothing changed on the workers: the session stays usable
        except BaseException as e:
            self._broken = (str(e).splitlines() or [repr(e)])[0][:300]
            self._end_session()
            session.close(timeout=30)
            raise

    def _call_again_on_loss(self, command: Command) -> Reply:
        """`_call`, and if the Ray Train run fails (a worker lost), a new run from the last saved state and the
        same command once more, provided that state is the version the command was meant for."""
        version, kind = self._version, type(command).__name__
        try:
            return self._call(command)
        except InvalidExamples:
            raise
        except Exception as e:
            self._emit("trainer_workers_lost", f"the Ray Train run failed during {kind!r} ({self._broken}); "
                       f"starting a new one from {self._resume or 'the base model'}", actor="Trainer", error=str(e)[:300])
        self._broken = None
        if self._resume is None:
            self._version = 0
        self._start()
        _check_version(self._version, version, f"{kind} after the Ray Train run was restarted")
        self._emit("trainer_workers_restarted", f"a new Ray Train run is up at version {self._version}; "
                   f"running {kind!r} again", actor="Trainer", version=self._version)
        return self._call(command)

    # ------------------------------------------------------------------------------- public API
    def train_step(self, examples: list[SFTExample], version: int | None = None) -> dict:
        """One RSFT step on the accepted examples, from weight `version`; metrics include "version" (the
        weights' version after it)."""
        self._finish_writing()
        _check_version(self._version, version, "train_step")
        if not examples:
            return _no_op_metrics(self._version)
        t0 = time.perf_counter()
        reply = self._call_again_on_loss(Train(ray.put(_examples(examples))))
        metrics = dict(reply.metrics)
        to_trainer = time.time() - metrics.pop("replied_at")  # wall clock: the reply was stamped by rank 0's worker
        self._adopt(reply)
        started, self._start_s = self._start_s, 0.0
        return {**metrics, "to_trainer_s": to_trainer, "version": self._version, "wall_s": time.perf_counter() - t0,
                "workers_start_s": started}

    def start_workers(self) -> float:
        """Starts the Ray Train run now, if none is up, rather than in the first step that needs it; the seconds it
        took (0: one was up). A Coordinator calls it without waiting as it makes the Trainer, so the start overlaps the
        other actors' starts and the run's first evaluation; a start that fails is raised again by the next call that
        needs the workers."""
        if self._session is not None:
            return 0.0
        t0 = time.perf_counter()
        try:
            self._start()
        except Exception as e:
            log.warning("the Ray Train run did not start ahead of the first step: %s", e)
        self._start_s = 0.0  # spent beside the evaluation, not in a step
        return time.perf_counter() - t0

    def host_weights(self, version: int | None = None) -> list:
        """[an object ref of the CPU state dict of weight `version`] (see the module docstring): pass the ref
        straight on to `PolicyServer.load_weights.remote(ref, v)`; nobody between needs to fetch it."""
        _check_version(self._version, version, "host_weights")
        if self._hosted is None or self._hosted[0] != self._version:
            self._hosted = (self._version, self._host())
        return [self._hosted[1]]

    def _host(self) -> Any:
        if self._session is None and self._resume is not None and _saved_step(Path(self._resume)) == self._version:
            from transformers import AutoModelForCausalLM

            saved = AutoModelForCausalLM.from_pretrained(self._resume, dtype=torch.float32)  # the learner's dtype
            return ray.put(saved.state_dict())
        self._start()  # a new run's first reply carries them (object_store)
        if self._hosted is not None and self._hosted[0] == self._version:
            return self._hosted[1]
        return self._call(Host()).weights

    def shared_weights(self, version: int) -> SharedWeights:
        """The CUDA IPC handles of rank 0's parameters at weight `version` (weight_sync cuda_ipc on a GPU)."""
        if self._shared is None:
            self._start()
        _check_version(self._version, version, "shared_weights")
        if self._shared is None:
            raise RuntimeError(f"shared_weights: rank 0 shares no CUDA IPC handles under weight_sync "
                               f"{self._trainer_cfg['weight_sync']!r} (cuda_ipc needs weight.use_gpu)")
        return self._shared

    def broadcast_group(self) -> tuple | None:
        """The `GroupSpec.key` of the broadcast group that rank 0 of the current Ray Train run holds (None: none;
        a new run, after a release or a lost worker, starts without)."""
        if self._group is None or self._session is None or self._group[0] is not self._session:
            return None
        return self._group[1]

    def broadcast_weights(self, spec: GroupSpec, version: int) -> None:
        """Rank 0 sends weight `version` to the group of `spec` (building it first if it holds another), while every
        replica receives (actors/broadcast_sync.py). Raises `WeightBroadcastError` naming what failed; the Ray
        Train run goes on either way."""
        self._start()
        _check_version(self._version, version, "broadcast_weights")
        self._group = None
        error = self._call(Broadcast(spec)).send_error
        if error:
            raise WeightBroadcastError(error)
        self._group = (self._session, spec.key)

    def version(self) -> int:
        return self._version

    def save_checkpoint(self, path: str, version: int | None = None, *, wait: bool = True) -> str:
        """HF-format model (+ tokenizer files) + optimizer state + rsft_state.json of weight `version`;
        returns the path. With `wait=False` it returns once rank 0 has begun writing: see `checkpoint_written`."""
        self._finish_writing()
        _check_version(self._version, version, "save_checkpoint")
        path = str(Path(path).resolve())
        self._call_again_on_loss(Save(path, background=not wait))
        if wait:
            self._saved(path)
        else:
            self._writing = (path, self._session)
        return path

    def checkpoint_written(self, path: str) -> str:
        """Waits until the checkpoint `save_checkpoint(path, wait=False)` began is on disk whole; returns its path.
        A Trainer that is not writing it (restarted by Ray since, or its workers lost: the write died with them)
        raises rather than let the run put on record a checkpoint that may be cut short."""
        path = str(Path(path).resolve())
        writing = self._writing and self._writing[0]
        if writing != path:
            raise StaleTrainer(f"checkpoint_written: the Trainer is not writing {path} (writing: {writing}); "
                               "it was restarted since the write began")
        self._finish_writing()
        return path

    def _finish_writing(self) -> None:
        """The background write, if one was begun, waited for; then it is the state a new run starts from. A write
        whose Ray Train run has ended since is lost with its rank 0 (StaleTrainer): no new run can finish it."""
        if self._writing is None:
            return
        (path, session), self._writing = self._writing, None
        if session is not self._session:
            raise StaleTrainer(f"the checkpoint {path} was being written by a Ray Train run that has ended")
        self._call(Flush())
        self._saved(path)

    def load_checkpoint(self, path: str) -> None:
        """Restore model, optimizer and version from a `save_checkpoint` directory (exact resume). Without a Ray
        Train run up it is only recorded: the next run starts from it when a call first needs the workers, so a
        relaunch with no step ahead starts none."""
        p = Path(path).resolve()
        _check_checkpoint(p)
        self._writing = None  # a load replaces the state being written; the worker waits for the write first
        self._hosted = None  # the weights put so far are another state's
        if self._session is None:  # the next session starts straight from it, when a call first needs the workers
            self._broken, self._resume, self._version = None, str(p), _saved_step(p)
        else:
            self._adopt(self._call(Load(str(p))))
        self._saved(str(p))

    def release_workers(self) -> None:
        """Save the full state under checkpoint_dir/live and end the Ray Train run, freeing its CPUs/GPUs.
        The next call starts a new run from that state (costs one fit start-up)."""
        self._finish_writing()
        if self._session is None:
            return
        live = str(self.checkpoint_dir / "live")
        self._call_again_on_loss(Save(live))
        self._saved(live)
        self._end_session().close()

    def shutdown(self) -> None:
        """End the Ray Train run and free its workers and queues, and any group an earlier Trainer of the run left
        (one restarted by Ray starts its run before its predecessor's controller is known dead). Idempotent."""
        self._closed = True
        session = self._end_session()
        if session is not None:
            session.close()
        self._free_orphans()
