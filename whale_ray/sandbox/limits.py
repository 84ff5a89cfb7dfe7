"""The per-episode limits a caller sets (`SandboxLimits`) and the fixed rlimits the sandbox always has.

Where each limit is enforced:
* wall_s: host deadline on the time the sandbox runs. Time spent inside the host's own `generate` and
  host-tool callbacks is NOT counted (the policy server's queueing must not turn into harness
  timeouts); `EpisodeResult.wall_s` is the total.
* memory_mb: the episode's cgroup (memory.limit_in_bytes / memory.max), which counts what RLIMIT_AS
  cannot see: shared memory, memfd and tmpfs pages, kernel memory; its OOM kill is a memory_limit, and
  `EpisodeResult.peak_memory_bytes` is the kernel's peak. max_processes also caps the cgroup's pids.
* memory_mb, cpu_s, max_processes, file size, open files, core dumps: rlimits that child.py applies to
  itself before the harness is loaded (inherited by anything the harness starts). When the host runs
  as root each concurrent episode runs as its own uid (uid_pool.UID_POOL: SLOT_UID_BASE + slot), so
  RLIMIT_NPROC budgets are per slot and no episode can signal another's processes. A child killed by
  SIGKILL after using its whole CPU budget (SIGXCPU ignored: the hard limit) is a timeout too.
* seccomp and Landlock (bwrap mode): child.py applies them to itself after the rlimits and before the
  domain tools and the harness load (`launcher.layers()` is passed in the LIMITS JSON as "harden");
  failing to apply them is a sandbox_setup_error, never a silent downgrade (Landlock on a kernel
  without it is skipped, and `whale doctor` says so).
* max_output_bytes: stdout + stderr together; over the cap the child is killed: status output_limit
  (output is not returned; a flood is a failure, not a truncation).
* max_rpc_calls (generate + tool requests) and max_message_bytes (any one frame): output_limit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ISOLATIONS = ("auto", "bwrap", "unsafe_none")
FSIZE_BYTES = 64 << 20  # RLIMIT_FSIZE: the largest file the sandbox may write
NOFILE = 256  # RLIMIT_NOFILE


@dataclass(frozen=True)
class SandboxLimits:
    """Per-episode limits; the defaults match whale_ray.config.SandboxConfig."""

    wall_s: float = 20.0
    memory_mb: int = 1024
    max_processes: int = 64
    max_output_bytes: int = 1 << 20
    max_rpc_calls: int = 256
    max_message_bytes: int = 1 << 20
    cpu_s: float | None = None  # None: wall_s
    isolation: str = "auto"  # "auto" (bwrap if it works, else sandbox_setup_error), "bwrap", "unsafe_none"

    def __post_init__(self) -> None:
        if self.isolation not in ISOLATIONS:
            raise ValueError(f"unknown sandbox isolation {self.isolation!r}; choose one of {', '.join(ISOLATIONS)}")
        for name in ("wall_s", "memory_mb", "max_processes", "max_output_bytes", "max_rpc_calls", "max_message_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SandboxLimits.{name} must be positive, got {getattr(self, name)!r}")
        if self.cpu_s is not None and not self.cpu_s > 0:
            raise ValueError(f"SandboxLimits.cpu_s must be positive or None, got {self.cpu_s!r}")

    @property
    def cpu_limit_s(self) -> float:
        return self.wall_s if self.cpu_s is None else self.cpu_s

    @classmethod
    def from_config(cls, cfg: Any, **overrides: Any) -> "SandboxLimits":
        """From a whale_ray.config.SandboxConfig (fields of the same name), with overrides on top."""
        names = ("wall_s", "memory_mb", "max_processes", "max_output_bytes", "max_rpc_calls", "max_message_bytes",
                 "cpu_s", "isolation")
        values = {n: getattr(cfg, n) for n in names if hasattr(cfg, n)}
        values.update(overrides)
        return cls(**values)
