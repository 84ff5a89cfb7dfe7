"""What an actor that serves the policy starts on after Ray restarts it: the weights on record then.

Ray restarts a dead actor by running its constructor again with the arguments it was first created with, and those
name the weights it first started on; the run may have put newer ones on record since. So an actor that serves the
policy picks its weights with `come_back(first, now, announce)`: `first` (its arguments') on its first start; after
a restart, whatever `now()` finds on record, announced (a restart is a fault its operator wants to hear of), so it
never answers on weights older than the record.

The record is the run directory (whale_ray/loop/run_dir.py): state.json names a checkpoint only once it is
complete, so the weights it names always load (`recorded`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Weights:
    version: int
    path: str  # a checkpoint directory, or the base model (version 0, or a best pair from before any training)


def recorded(run_dir: str | Path, version: int, checkpoint: Optional[str], base_model: str) -> Weights:
    """A weight version as state.json records it: its checkpoint (relative to `run_dir`), or the base model where it
    names none."""
    return Weights(version, str(Path(run_dir) / checkpoint) if checkpoint else base_model)


def restarted() -> bool:
    """Whether this actor is a restart by Ray (False outside an actor)."""
    import ray

    if not ray.is_initialized() or ray.get_runtime_context().get_actor_id() is None:
        return False
    return bool(ray.get_runtime_context().was_current_actor_reconstructed)


def come_back(first: T, now: Callable[[], T], announce: Callable[[T], None]) -> T:
    """The weights to start on: `first` on an actor's first start; after Ray restarted it, `now()`, the weights on
    record at this moment, passed to `announce` (a log line, an event of the run) before they are returned."""
    if not restarted():
        return first
    weights = now()
    announce(weights)
    return weights
