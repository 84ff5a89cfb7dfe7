"""Per-episode cgroups: the kernel counts an episode's memory and processes, whatever their kind.

RLIMIT_AS sees only a process's address space. Shared memory, memfd and tmpfs pages, page cache and
kernel memory (inodes, dentries, pipe buffers) are not in it, yet they hold host memory for as long as
the episode lives. A memory cgroup counts all of them, so each episode gets its own, made by the trusted
side before any harness code runs and removed at teardown:

    layer = cgroup_layer()                       # None where cgroups cannot be made (see unavailable())
    cg = layer.create(memory_bytes, max_pids)    # an EpisodeCgroup, empty
    cg.add_tree(bwrap_pid)                       # the sandbox's processes, before the host sends `init`
    ...                                          # the episode
    cg.oom_killed(), cg.peak_bytes()             # the kernel's verdict and count
    cg.remove()                                  # kills what is left, rmdir

v2 (a cgroup2 mount whose cgroup.controllers has memory and pids): `memory.max`, `memory.swap.max` = 0,
`memory.oom.group` = 1 (an OOM kills the whole episode), `pids.max`. v1 (the memory and pids
hierarchies, as on these machines): `memory.limit_in_bytes`, `memory.memsw.limit_in_bytes` where swap
accounting is on, `memory.kmem.limit_in_bytes` where the kernel still honours it (since Linux 5.x kernel
memory is charged to memory.usage_in_bytes anyway, so the memory limit covers it), and `pids.max`.

All episode cgroups live under one `whale-ray` directory at the top of each hierarchy, named
ep-<host pid>-<n>: a worker that died mid-episode leaves cgroups that the next worker to start an
episode on the machine kills and removes (`sweep`).
"""

from __future__ import annotations

import itertools
import os
import secrets
import signal
import threading
import time
from dataclasses import dataclass

PARENT = "whale-ray"
_counter = itertools.count()
_lock = threading.Lock()
_layer: "CgroupLayer | None" = None
_reason: str | None = None  # why there is no layer (None: not probed yet, or there is one)
_probed = False


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _keyed(path: str) -> dict[str, int]:
    """A flat-keyed cgroup file ("oom_kill 3" lines) as a dict; {} when unreadable."""
    out: dict[str, int] = {}
    try:
        for line in _read(path).splitlines():
            k, _, v = line.partition(" ")
            if v.strip().lstrip("-").isdigit():
                out[k] = int(v)
    except OSError:
        pass
    return out


def _mounts() -> tuple[str | None, dict[str, str]]:
    """(the cgroup2 mount point or None, {v1 controller: its mount point}) from /proc/self/mountinfo."""
    v2, v1 = None, {}
    try:
        lines = _read("/proc/self/mountinfo").splitlines()
    except OSError:
        return None, {}
    for line in lines:
        head, _, tail = line.partition(" - ")
        fields, rest = head.split(), tail.split()
        if len(fields) < 5 or len(rest) < 3:
            continue
        point, fstype, opts = fields[4], rest[0], rest[2].split(",")
        if fstype == "cgroup2" and v2 is None:
            v2 = point
        elif fstype == "cgroup":
            for c in ("memory", "pids"):
                if c in opts and c not in v1:
                    v1[c] = point
    return v2, v1


def alive(pid: int) -> bool:
    """Whether process `pid` exists (it may belong to another user)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _children(pids: set[int]) -> set[int]:
    """Every live process whose parent is in `pids` (a /proc scan: no CONFIG_PROC_CHILDREN needed)."""
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = _read(f"/proc/{entry}/stat")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid in pids:
            found.add(int(entry))
    return found


@dataclass
class CgroupLayer:
    version: int  # 1 or 2
    roots: dict[str, str]  # controller ("memory", "pids"; v2: "unified") -> <mount>/whale-ray
    kmem: bool  # v1: memory.kmem.limit_in_bytes can be set
    memsw: bool  # v1: swap accounting (memory.memsw.*) is on

    def describe(self) -> str:
        if self.version == 2:
            return (f"cgroup v2 at {self.roots['unified']}: memory.max, memory.swap.max=0, memory.oom.group, "
                    "pids.max per episode")
        parts = [f"cgroup v1: memory ({self.roots['memory']}: memory.limit_in_bytes"
                 + (", memory.memsw.limit_in_bytes" if self.memsw else ", no swap accounting")
                 + (", memory.kmem.limit_in_bytes" if self.kmem else ", kernel memory charged to memory.usage")
                 + ")"]
        parts.append(f"pids ({self.roots['pids']}: pids.max)" if "pids" in self.roots
                     else "no pids controller: processes bounded by RLIMIT_NPROC only")
        return ", ".join(parts)

    def create(self, memory_bytes: int, max_pids: int) -> "EpisodeCgroup":
        name = f"ep-{os.getpid()}-{next(_counter)}-{secrets.token_hex(3)}"
        cg = EpisodeCgroup(self, {c: os.path.join(r, name) for c, r in self.roots.items()})
        try:
            for d in cg.dirs.values():
                os.mkdir(d, 0o700)
            if self.version == 2:
                d = cg.dirs["unified"]
                _write(f"{d}/memory.max", str(memory_bytes))
                _write(f"{d}/memory.swap.max", "0")
                _write(f"{d}/memory.oom.group", "1")
                _write(f"{d}/pids.max", str(max_pids))
            else:
                d = cg.dirs["memory"]
                _write(f"{d}/memory.limit_in_bytes", str(memory_bytes))
                if self.memsw:  # after limit_in_bytes: memsw may never be below it
                    _write(f"{d}/memory.memsw.limit_in_bytes", str(memory_bytes))
                if self.kmem:
                    _write(f"{d}/memory.kmem.limit_in_bytes", str(memory_bytes))
                if "pids" in cg.dirs:
                    _write(f"{cg.dirs['pids']}/pids.max", str(max_pids))
        except OSError:
            cg.remove()
            raise
        return cg

    def sweep(self) -> None:
        """Kill and remove the episode cgroups of workers that are gone (a crash mid-episode)."""
        for root in self.roots.values():
            try:
                names = os.listdir(root)
            except OSError:
                continue
            for name in names:
                parts = name.split("-")
                if len(parts) == 4 and parts[0] == "ep" and parts[1].isdigit() and not alive(int(parts[1])):
                    EpisodeCgroup(self, {"x": os.path.join(root, name)}).remove()


class EpisodeCgroup:
    """One episode's cgroup (one directory per v1 hierarchy, one in v2)."""

    def __init__(self, layer: CgroupLayer, dirs: dict[str, str]):
        self.layer = layer
        self.dirs = dirs

    def _procs(self) -> set[int]:
        pids: set[int] = set()
        for d in self.dirs.values():
            try:
                pids.update(int(p) for p in _read(f"{d}/cgroup.procs").split())
            except (OSError, ValueError):
                pass
        return pids

    def procs_files(self) -> list[str]:
        """The cgroup.procs files a process writes its own pid to, to enter this cgroup."""
        return [f"{d}/cgroup.procs" for d in self.dirs.values()]

    def add(self, pid: int) -> None:
        for d in self.dirs.values():
            _write(f"{d}/cgroup.procs", str(pid))

    def add_tree(self, root_pid: int) -> None:
        """Move `root_pid` and all its descendants in, top-down, until a pass finds none left outside.
        A process forked while its parent moves either exists when the next /proc scan looks (and is
        moved) or is forked after the move and inherits the cgroup: the kernel serialises fork and
        migration. Call it while the tree cannot run untrusted code (before the host sends `init`)."""
        moved: set[int] = set()
        todo = {root_pid}
        while todo:
            for pid in sorted(todo):
                try:
                    self.add(pid)
                except ProcessLookupError:
                    pass  # exited meanwhile
                except OSError as e:
                    if alive(pid):
                        raise
                    del e
                moved.add(pid)
            todo = _children(moved) - moved

    def oom_killed(self) -> bool:
        """True when the kernel's OOM killer acted in this cgroup (its memory limit was reached)."""
        if self.layer.version == 2:
            return _keyed(f"{self.dirs['unified']}/memory.events").get("oom_kill", 0) > 0
        return _keyed(f"{self.dirs['memory']}/memory.oom_control").get("oom_kill", 0) > 0

    def pids_limited(self) -> bool:
        """True when a fork failed at pids.max."""
        d = self.dirs.get("pids") or self.dirs.get("unified")
        return d is not None and _keyed(f"{d}/pids.events").get("max", 0) > 0

    def peak_bytes(self) -> int | None:
        """The most memory the episode held at once, as the kernel counted it."""
        d = self.dirs.get("memory") or self.dirs.get("unified")
        name = "memory.peak" if self.layer.version == 2 else "memory.max_usage_in_bytes"
        try:
            return int(_read(f"{d}/{name}"))
        except (OSError, ValueError, TypeError):
            return None

    def kill(self) -> None:
        d2 = self.dirs.get("unified")
        if d2 is not None:
            try:
                _write(f"{d2}/cgroup.kill", "1")  # Linux >= 5.14
            except OSError:
                pass
        for pid in self._procs():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass

    def remove(self, timeout: float = 5.0) -> bool:
        """Kill whatever is left and remove the directories; False if one could not be removed in time."""
        deadline = time.monotonic() + timeout
        ok = True
        for d in self.dirs.values():
            while True:
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError:  # EBUSY: processes still in it (being killed, or not yet reaped)
                    if time.monotonic() > deadline:
                        ok = False
                        break
                    self.kill()
                    time.sleep(0.01)
        return ok


def _probe() -> tuple[CgroupLayer | None, str | None]:
    if os.geteuid() != 0:
        return None, (f"whale-ray runs as uid {os.geteuid()}, not root: it cannot create cgroups (without a "
                      "delegated subtree), so an episode's shared memory, tmpfs pages and kernel memory are "
                      "bounded only by the tmpfs size caps, and its processes only by RLIMIT_NPROC")
    v2, v1 = _mounts()
    layer = None
    if v2 is not None:
        try:
            controllers = _read(f"{v2}/cgroup.controllers").split()
        except OSError:
            controllers = []
        if "memory" in controllers and "pids" in controllers:
            root = os.path.join(v2, PARENT)
            try:
                _write(f"{v2}/cgroup.subtree_control", "+memory +pids")
                os.makedirs(root, mode=0o755, exist_ok=True)
                _write(f"{root}/cgroup.subtree_control", "+memory +pids")
                layer = CgroupLayer(2, {"unified": root}, kmem=False, memsw=False)
            except OSError as e:
                return None, f"cgroup v2 at {v2} has memory and pids, but whale-ray cannot use it: {e}"
    if layer is None and "memory" in v1:
        roots = {}
        try:
            for c, point in v1.items():
                roots[c] = os.path.join(point, PARENT)
                os.makedirs(roots[c], mode=0o755, exist_ok=True)
        except OSError as e:
            return None, f"cannot create {roots[c]} ({e.strerror}): the cgroup file system is not writable here"
        mem = roots["memory"]
        layer = CgroupLayer(1, roots, kmem=False, memsw=os.path.exists(f"{mem}/memory.memsw.limit_in_bytes"))
        layer.kmem = _kmem_works(layer)
    if layer is None:
        return None, ("no memory cgroup controller is mounted (neither cgroup v2 with memory and pids nor the "
                      "v1 memory hierarchy)")
    layer.sweep()
    return layer, None


def _kmem_works(layer: CgroupLayer) -> bool:
    """v1: does memory.kmem.limit_in_bytes take a value? (Linux >= 6.1 accepts writes and ignores them.)"""
    path = os.path.join(layer.roots["memory"], f"probe-{os.getpid()}-{secrets.token_hex(3)}")
    try:
        os.mkdir(path)
    except OSError:
        return False
    try:
        _write(f"{path}/memory.kmem.limit_in_bytes", str(64 << 20))
        return int(_read(f"{path}/memory.kmem.limit_in_bytes")) == 64 << 20
    except (OSError, ValueError):
        return False
    finally:
        try:
            os.rmdir(path)
        except OSError:
            pass


def cgroup_layer() -> CgroupLayer | None:
    """The machine's cgroup layer (probed once per process), or None: see unavailable()."""
    global _layer, _reason, _probed
    with _lock:
        if not _probed:
            _layer, _reason = _probe()
            _probed = True
        return _layer


def unavailable() -> str | None:
    """Why there is no cgroup layer and what is then unbounded; None when there is one."""
    cgroup_layer()
    return _reason


def leftovers() -> list[str]:
    """Episode cgroups of this process that still exist (tests: none after teardown)."""
    layer = cgroup_layer()
    if layer is None:
        return []
    prefix = f"ep-{os.getpid()}-"
    return sorted(os.path.join(r, n) for r in layer.roots.values() for n in os.listdir(r) if n.startswith(prefix))
