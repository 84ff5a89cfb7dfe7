"""An episode's file systems as host-side tmpfs mounts (root only): byte AND inode caps, no host paths.

bubblewrap's own `--tmpfs` takes a size but no inode count, and a harness that makes millions of empty
files spends kernel memory (inodes, dentries) that no byte cap sees. When the host runs as root, the
trusted side mounts each of the episode's file systems itself, with `size=` and `nr_inodes=`, inside the
episode directory, and bwrap binds them in:

    <episode dir>/files    read-only at /sandbox inside (child.pyc, tools.py, the harness)
    <episode dir>/scratch  /scratch (HOME and cwd)    <episode dir>/tmp  /tmp    <episode dir>/shm  /dev/shm

Each is the root of its own tmpfs, so /proc/self/mountinfo inside shows "/" as its root, never the
host's episode path. `EpisodeMounts.close()` detaches them all; a worker that died mid-episode leaves
mounts that the next one on the machine detaches (`sweep_stale`, by the pid in the directory's name).
Without root the episode directory is a plain directory and bwrap makes the tmpfs mounts (sizes only).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import tempfile
import threading
from typing import Any, Callable

from whale_ray.sandbox import isolation
from whale_ray.sandbox.cgroup import alive

_MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 2, 4, 8
_MNT_DETACH = 2
PREFIX = "whale-sbx-"
FILES_BYTES, FILES_INODES = 16 << 20, 64  # the episode's own files: a few, never written by the sandbox
# (name inside the episode dir, where the sandbox sees it, bytes, inodes)
WRITABLE = (("scratch", isolation.SCRATCH, isolation.SCRATCH_BYTES, isolation.SCRATCH_INODES),
            ("tmp", "/tmp", isolation.TMP_BYTES, isolation.TMP_INODES),
            ("shm", "/dev/shm", isolation.SHM_BYTES, isolation.SHM_INODES))

_libc = None
_swept = False
_sweep_lock = threading.Lock()


def _syscalls():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc


def mount_tmpfs(target: str, size: int, inodes: int, mode: int, uid: int, gid: int, noexec: bool) -> None:
    opts = f"size={size},nr_inodes={inodes},mode={mode:o},uid={uid},gid={gid}".encode()
    flags = _MS_NOSUID | _MS_NODEV | (_MS_NOEXEC if noexec else 0)
    if _syscalls().mount(b"tmpfs", target.encode(), b"tmpfs", ctypes.c_ulong(flags), opts) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"mount tmpfs on {target}: {os.strerror(e)}")


def bind_mount(source: str, target: str) -> None:
    """mount --bind source target (root): a path another uid can reach for a source it cannot."""
    if _syscalls().mount(source.encode(), target.encode(), None, ctypes.c_ulong(4096), None) != 0:  # MS_BIND
        e = ctypes.get_errno()
        raise OSError(e, f"bind {source} on {target}: {os.strerror(e)}")


def detach(target: str) -> None:
    if _syscalls().umount2(target.encode(), _MNT_DETACH) != 0:
        e = ctypes.get_errno()
        if e not in (22, 2):  # EINVAL: not a mount point (any more), ENOENT: gone
            raise OSError(e, f"umount {target}: {os.strerror(e)}")


def host_mounts_available() -> bool:
    return isolation.running_as_root()


class EpisodeMounts:
    """The episode directory and, as root, its tmpfs mounts; `binds` is what BwrapLauncher.command takes."""

    def __init__(self, uid: int | None, tmpfs: bool = True):
        """`tmpfs`: mount (bwrap mode, root); else the episode directory is a plain one (unsafe_none)."""
        sweep_stale()
        self.dir = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-")
        self.mounted: list[str] = []
        self.binds: dict[str, str] | None = None
        try:
            os.chmod(self.dir, 0o755)
            if not (tmpfs and host_mounts_available()):
                self.files = self.dir
                return
            self.files = os.path.join(self.dir, "files")
            os.mkdir(self.files, 0o755)
            mount_tmpfs(self.files, FILES_BYTES, FILES_INODES, 0o755, 0, 0, noexec=True)
            self.mounted.append(self.files)
            owner = isolation.SANDBOX_UID if uid is None else uid
            self.binds = {"files": self.files}
            for name, _inside, size, inodes in WRITABLE:
                path = os.path.join(self.dir, name)
                os.mkdir(path, 0o700)
                mount_tmpfs(path, size, inodes, 0o755, owner, owner, noexec=False)
                self.mounted.append(path)
                self.binds[name] = path
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for path in reversed(self.mounted):
            try:
                detach(path)
            except OSError:
                pass
        self.mounted.clear()
        _remove(self.dir)


def _remove(path: str) -> None:

    if os.path.lexists(path):
        rmtree(path)


    return True


def sweep_stale() -> None:
    """Detach and remove episode mounts of dead workers (once per process)."""
    global _swept
    with _sweep_lock:
        if _swept or not host_mounts_available():
            return
        _swept = True
    root = tempfile.gettempdir().rstrip("/") + "/" + PREFIX
    try:
        with open("/proc/self/mountinfo") as f:
            points = [line.split()[4] for line in f]
    except OSError:
        return
    stale: set[str] = set()
    for p in points:
        if p.startswith(root):
            episode = p[: p.index("/", len(root)) if "/" in p[len(root):] else len(p)]
            pid = episode[len(root):].split("-", 1)[0]
            if pid.isdigit() and not alive(int(pid)):
                detach(p)
                stale.add(episode)
    for episode in stale:
        shutil.rmtree(episode, ignore_errors=True)


def rmtree(path: str) -> None:
    """Remove an episode directory, even where a harness (unsafe_none) took the permissions off its files."""

    def fix(func: Callable[..., Any], p: str, exc: Any) -> None:
        try:
            os.chmod(os.path.dirname(p), 0o700)
            if os.path.isdir(p) and not os.path.islink(p):
                os.chmod(p, 0o700)
            func(p)
        except OSError:
            pass

    shutil.rmtree(path, onerror=fix)
    if os.path.lexists(path):
        shutil.rmtree(path, ignore_errors=True)
