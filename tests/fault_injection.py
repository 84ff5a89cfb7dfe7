"""Real faults for a running Coordinator: SIGKILL of an actor's worker process, or `ray.kill` (restartable),
fired when the run directory's committed state reaches a point. Used by tests/cluster/test_faults.py and by
benchmarks/fault_recovery.py (the kill table).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import ray

TARGETS = ("policy_server", "evaluator", "trainer", "train_worker", "retriever", "proposer")


@dataclass
class Fault:
    target: str  # one of TARGETS
    how: str  # "sigkill" (the actor's worker process) or "ray_kill" (ray.kill(..., no_restart=False))
    phase: str  # "weight" or "harness": fires inside that phase...
    cycle: int = 0  # ...of this cycle (0-based)...
    after_units: int = 1  # ...once this many of its steps / iterations are on record
    fired_at: float | None = None
    state_at_kill: dict = field(default_factory=dict)
    pid: int | None = None


def committed(run_dir: Path) -> dict:
    try:
        return json.loads((Path(run_dir) / "state.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def _due(fault: Fault, state: dict) -> bool:
    p = state.get("phase") or {}
    return (p.get("kind") == fault.phase and p.get("cycle") == fault.cycle and not p.get("done")
            and p.get("units_done", 0) >= fault.after_units)


def _pid(handle: "ray.actor.ActorHandle") -> int:
    return ray.get(handle.__ray_call__.remote(lambda self: os.getpid()), timeout=60)


def train_worker_pids() -> list[int]:
    """The pids of the live Ray Train workers of the cluster this process is connected to, from the GCS's actor
    table (the public state API needs the dashboard, which the tests' clusters run without): another Ray on the
    machine may run Train workers too, and killing one of those would strike the wrong run."""
    from ray.core.generated import gcs_pb2

    pids = []
    for raw in ray._private.state.state._connect_and_get_accessor().get_actor_table(None, None):
        a = gcs_pb2.ActorTableData.FromString(raw)
        if a.class_name == "RayTrainWorker" and gcs_pb2.ActorTableData.ActorState.Name(a.state) == "ALIVE" and a.pid:
            pids.append(a.pid)
    return sorted(pids)


def strike(coordinator: Any, fault: Fault) -> None:
    if fault.target == "train_worker":
        pids = train_worker_pids()
        assert pids, "no Ray Train worker is running to kill"
        fault.pid = pids[-1]
        os.kill(fault.pid, signal.SIGKILL)
        return
    handle = {"policy_server": lambda: coordinator.policies[0], "trainer": lambda: coordinator.trainer,
              "evaluator": lambda: coordinator.pool.actors[0], "proposer": lambda: coordinator.proposer,
              "retriever": lambda: coordinator.services["retriever"]}[fault.target]()
    if fault.how == "sigkill":
        fault.pid = _pid(handle)
        os.kill(fault.pid, signal.SIGKILL)
    else:
        ray.kill(handle, no_restart=False)


class Injector:
    """Fires each fault once, in order, from a thread that watches the run directory."""

    def __init__(self, coordinator: Any, run_dir: Path, faults: list[Fault], on_fire: Callable[[Fault], None] | None = None):
        self.coordinator, self.run_dir, self.faults, self.on_fire = coordinator, Path(run_dir), list(faults), on_fire
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True, name="fault-injector")

    def __enter__(self) -> "Injector":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _watch(self) -> None:
        pending = list(self.faults)
        while pending and not self._stop.is_set():
            state = committed(self.run_dir)
            if state and _due(pending[0], state):
                fault = pending.pop(0)
                try:
                    strike(self.coordinator, fault)
                except BaseException as e:  # reported by the test, not lost in this thread
                    self.errors.append(e)
                fault.fired_at, fault.state_at_kill = time.time(), state
                if self.on_fire is not None:
                    self.on_fire(fault)
            time.sleep(0.05)
