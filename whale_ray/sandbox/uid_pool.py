"""Per-slot unprivileged uids for concurrent sandboxes (harness episodes and jailed commands) when the host
runs as root: RLIMIT_NPROC budgets are per slot and no sandbox can signal another's processes."""

from __future__ import annotations

import os
import signal
import tempfile
import threading
import time

from whale_ray.sandbox import isolation


def _uids_of_processes(uid: int) -> list[int]:
    """Pids of processes whose real uid is `uid` (a /proc scan), zombies left out: a zombie runs nothing and
    no signal reaches it; only its parent's wait removes it."""
    found = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status", "rb") as f:
                status = f.read()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith(b"State:") and b"Z" in line:
                break
            if line.startswith(b"Uid:"):
                fields = line.split()
                if len(fields) > 1 and fields[1] == str(uid).encode():
                    found.append(int(entry))
                break
    return found


class UidPool:
    """Per-slot unprivileged uids for concurrent episodes (only used when the host runs as root).

    Slot N is uid = gid = SLOT_UID_BASE + N. A slot is held by this process (a lock) and, across
    processes on the same machine (several Ray workers), by an flock on a per-slot file in a root-only
    directory: the kernel drops the flock when a holder dies, so a crashed worker never leaks a slot.
    Before a slot is given back, any process still running as its uid is killed (a /proc scan), unless the
    caller knows that none is: an episode whose pid namespace was emptied and its init reaped.
    """

    def __init__(self, base: int = isolation.SLOT_UID_BASE, size: int = isolation.MAX_SLOTS):
        self.base = base
        self.size = size
        self._lock = threading.Lock()
        self._held: dict[int, int | None] = {}  # slot -> flock fd (None: no lock directory)
        self._dir: str | None = None
        self._dir_checked = False

    def _lock_dir(self) -> str | None:
        if self._dir_checked:
            return self._dir
        self._dir_checked = True
        d = os.path.join(tempfile.gettempdir(), f"whale-ray-uid-slots-u{os.geteuid()}")
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            pass
        except OSError:
            return None
        try:
            st = os.lstat(d)
        except OSError:
            return None
        import stat as _stat
        if _stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o077:
            self._dir = d
        return self._dir

    def acquire(self) -> int:
        """A free slot's uid; RuntimeError when all slots are taken."""
        import fcntl

        with self._lock:
            d = self._lock_dir()
            for slot in range(self.size):
                if slot in self._held:
                    continue
                fd = None
                if d is not None:
                    try:
                        fd = os.open(os.path.join(d, str(self.base + slot)), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                                     0o600)
                    except OSError:
                        continue
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except OSError:
                        os.close(fd)
                        continue  # another process holds this slot
                self._held[slot] = fd
                uid = self.base + slot
                break
            else:
                raise RuntimeError(f"all {self.size} sandbox uid slots are in use")
        return uid

    def release(self, uid: int, reap: bool = True) -> None:
        """`reap`: first kill whatever still runs as the uid (a /proc scan); False when the caller knows that
        nothing does (a sandbox whose pid namespace was emptied and reaped)."""
        if reap:
            self._reap(uid)
        with self._lock:
            fd = self._held.pop(uid - self.base, None)
            if fd is not None:
                os.close(fd)

    def in_use(self) -> list[int]:
        with self._lock:
            return sorted(self.base + s for s in self._held)

    @staticmethod
    def _reap(uid: int) -> None:
        for _ in range(3):
            pids = _uids_of_processes(uid)
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            time.sleep(0.05)


UID_POOL = UidPool()
