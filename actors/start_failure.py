"""An actor whose constructor failed: the input's fault or the cluster's?

A constructor that raises one of whale-ray's bad-input errors (a checkpoint, config, data set, harness or proposer
setting that cannot work) fails the same way on every start, so the Coordinator ends the run at once, naming the
input, instead of rolling it back again and again. Any other constructor error counts as a fault the first time
and as the input's the second time in a row with the same type and message.

Ray keeps only the text of a constructor's exception (`ActorDiedError` with `actor_init_failed`: the remote
traceback, whose last block ends in "module.Type: message"), so the type is read back from that text.
"""

from __future__ import annotations

import importlib
import re
import sys
from dataclasses import dataclass

from ray.exceptions import RayActorError

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_OURS = ("whale_ray.", "actors.", "domains.")


def input_error_types() -> tuple[type[BaseException], ...]:
    """The errors that mean bad input: what `whale run` checks up front raises these, and so do the actors'
    constructors when the same input reaches them. A safetensors file that cannot be parsed is the checkpoint's."""
    from safetensors import SafetensorError

    from whale_ray.config import ConfigError
    from whale_ray.domain import DataError
    from whale_ray.harness import HarnessError
    from whale_ray.launch import InputError
    from whale_ray.policy.checkpoint import CheckpointError
    from whale_ray.proposers.base import ProposerError
    from whale_ray.resources import ResourceError

    return (CheckpointError, ConfigError, DataError, HarnessError, InputError, ProposerError, ResourceError,
            SafetensorError)


def _exception_type(name: str) -> type | None:
    module, _, qualname = name.rpartition(".")
    mod = sys.modules.get(module or "builtins")
    if mod is None and module.startswith(_OURS):
        try:
            mod = importlib.import_module(module)
        except ImportError:
            return None
    obj = getattr(mod, qualname, None) if mod is not None else None
    return obj if isinstance(obj, type) and issubclass(obj, BaseException) else None


def constructor_error(error: BaseException) -> tuple[str, str] | None:
    """(the exception type's qualified name, its message) of the exception an actor's constructor raised, read
    from Ray's error; None when `error` is not a constructor's failure."""
    if not isinstance(error, RayActorError) or not error.actor_init_failed:
        return None
    lines = _ANSI.sub("", str(error)).splitlines()
    frames = [i for i, line in enumerate(lines) if line.startswith('  File "')]
    if not frames:
        return None
    # after the last frame come its source lines (indented), then "Type: message", which may span lines
    rest = lines[frames[-1] + 1:]
    start = next((i for i, line in enumerate(rest) if line and not line.startswith(" ")), None)
    if start is None:
        return None
    name, _, message = "\n".join(rest[start:]).strip().partition(": ")
    return name.strip(), message.strip()


@dataclass(eq=False)
class StartFailure(Exception):
    """An actor of the run could not be constructed. `input` names what it was started on, when one thing is."""

    role: str
    type_name: str
    message: str
    input: str | None = None

    def __str__(self) -> str:
        return f"{self.type_name}: {self.message}"

    @property
    def is_input_error(self) -> bool:
        cls = _exception_type(self.type_name)
        return cls is not None and issubclass(cls, input_error_types())

    def same_as(self, other: "StartFailure | None") -> bool:
        return other is not None and (self.role, self.type_name, self.message) == (other.role, other.type_name,
                                                                                 other.message)

    def line(self, repeated: bool) -> str:
        """One line for the user, naming the actor, what it was started on and what is wrong (whale-ray's errors
        name their input themselves; another library's gets its type's name)."""
        message = " ".join(self.message.split())
        on = f" on {self.input}" if self.input and self.input not in message else ""
        why = " (the same error on two starts in a row: the input, not the cluster)" if repeated else ""
        what = message if self.type_name.startswith(_OURS) else f"{self.type_name.rpartition('.')[2]}: {message}"
        return f"the {self.role} could not start{on}{why}: {what}"


def start_failure(role: str, error: BaseException, input: str | None = None) -> StartFailure | None:
    """`error` as a StartFailure of `role`, or None when it is not a constructor's failure."""
    found = constructor_error(error)
    return StartFailure(role, *found, input=input) if found is not None else None
