"""Following a run directory: which weights (latest, best θ*) and which harness (h*) it has on record now.

The run directory is the truth (whale_ray/loop/run_dir.py): a checkpoint is written first and put on record by
the atomic rewrite of state.json that follows, so whatever state.json names is complete. Each replica reads
state.json itself (no message from the Coordinator): a `stat` per request tells whether it changed, so a
replica never answers on weights older than those a client has already seen from another replica.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from whale_ray.archive import Archive, ArchiveError
from whale_ray.policy.restart import Weights, recorded
from whale_ray.run_state import RunState

if TYPE_CHECKING:
    from whale_ray.serve.spec import EndpointSpec


@dataclass(frozen=True)
class RunView:
    latest: Weights
    best: Weights
    harness_id: str  # h*: the best pair's harness, else the run's accepted harness ("h0" at the start)


def view_of(state: RunState | None, run_dir: Path, base_model: str) -> RunView:
    if state is None:  # the run has not written its first state yet
        return RunView(Weights(0, base_model), Weights(0, base_model), "h0")
    latest = recorded(run_dir, state.checkpoint_version, state.checkpoint, base_model)
    if state.best is None:
        return RunView(latest, latest, state.accepted_harness)
    b = state.best
    return RunView(latest, recorded(run_dir, b.weight_version, b.checkpoint, base_model), b.harness_id)


class RunFollower:
    """`poll()` gives a new RunView when state.json changed since the last look, else None."""

    def __init__(self, run_dir: str | Path, base_model: str):
        self.run_dir, self.base_model = Path(run_dir), base_model
        self._seen: tuple[int, int, int] | None = None
        self.view = view_of(RunState.load(self.run_dir), self.run_dir, base_model)

    def _stamp(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.run_dir / "state.json")
        except FileNotFoundError:
            return None
        return st.st_ino, st.st_mtime_ns, st.st_size  # an atomic rewrite is a new inode

    def poll(self) -> RunView | None:
        stamp = self._stamp()
        if stamp is None or stamp == self._seen:
            return None
        self.view = view_of(RunState.load(self.run_dir), self.run_dir, self.base_model)
        self._seen = stamp
        return self.view

    def forget(self) -> None:
        """Read state.json again at the next poll (a load from it failed and is to be retried)."""
        self._seen = None

    def harness_source(self, harness_id: str, fallback: Path) -> str:
        """h*'s code from the run's archive; `fallback` (the run's h0 file) before the archive holds it."""
        try:
            return Archive(self.run_dir / "archive", read_only=True).get(harness_id).code
        except (ArchiveError, FileNotFoundError, KeyError):
            if harness_id != "h0":
                raise
            return fallback.read_text()


def wanted(follow: str | None, view: RunView) -> Weights:
    """The weights a model follows (its `follow`: "best" or "latest")."""
    return view.best if follow == "best" else view.latest


def start_weights(spec: EndpointSpec, follower: RunFollower | None) -> dict[str, Weights]:
    """Each model's weights on record now (its fixed checkpoint when not following)."""
    out = {}
    for source in spec.models:
        if follower is None or source.follow is None:
            assert source.path is not None, f"model {source.name}: neither followed nor given a path"
            out[source.name] = Weights(0, source.path)
        else:
            out[source.name] = wanted(source.follow, follower.view)
    return out


def follower_of(spec: EndpointSpec) -> RunFollower | None:
    if not spec.run_dir:
        return None
    follower = RunFollower(spec.run_dir, spec.base_model)
    follower.poll()  # each engine starts on the weights on record now
    return follower


def load_state_dict(checkpoint: str | Path) -> dict[str, torch.Tensor]:
    """The weights of a Hugging Face checkpoint directory (one or several safetensors files)."""
    from safetensors.torch import load_file

    files = sorted(Path(checkpoint).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{checkpoint}: no *.safetensors weights")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(f)))
    return out
