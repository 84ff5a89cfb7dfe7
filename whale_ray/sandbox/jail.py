"""The harness sandbox's layers for a jailed command that is not a harness (the agent-cli proposer's agent).

    jail = CommandJail(network=False)
    try:
        argv = jail.wrap(bwrap_argv)      # bwrap's argv ending in `-- COMMAND...`, layered
        proc = jail.popen(argv, stdout=PIPE, stderr=PIPE)
        ...                               # communicate, kill on timeout
    finally:
        jail.close()                      # cgroup removed (what is left in it killed), uid slot released

The layers, as for a harness episode: a per-slot uid (root only: uid_pool.UID_POOL, so RLIMIT_NPROC and
signals are per jail; the writable trees are lent to that uid for the session), a cgroup of its own
(memory and pids; the jail is moved in before the command runs), and seccomp and Landlock applied by
child.py's `--exec` mode to itself right before it execs the command. Landlock allows writes only under
the argv's --bind destinations (the workspace), /tmp and /dev. With `network` on, seccomp also allows IP
and netlink sockets and Landlock adds no TCP rules; with it off the jail has no network of its own
(bwrap --unshare-net) and IP sockets are refused as well. Bind sources the slot uid cannot reach (a run directory under a 0700
parent) are first bound by root at a staging path it can reach.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from typing import Any

from whale_ray.sandbox import isolation
from whale_ray.sandbox.cgroup import EpisodeCgroup, cgroup_layer
from whale_ray.sandbox.mounts import bind_mount, detach

JAIL_MEMORY_BYTES = 8 << 30  # an agent CLI (node, its tools) needs far more than a harness
JAIL_PIDS = 1024
SHIM_DIR = "/.whale"  # where child.pyc is bound inside the jail
_AF_UNIX, _AF_INET, _AF_INET6, _AF_NETLINK = 1, 2, 10, 16


class CommandJail:
    def __init__(self, *, network: bool):
        self.network = network
        self.uid: int | None = None
        self.cgroup: EpisodeCgroup | None = None
        self.notes: list[str] = []
        self._staged: list[str] = []  # host-side bind mounts of sources the slot uid cannot reach
        self._go: tuple[int, int] | None = None
        self._shim_dir: str | None = None
        self._lent: list[str] = []

    # -------------------------------------------------------------------------------- building
    def layers(self, writable_inside: list[str]) -> dict[str, Any]:
        families = [_AF_UNIX] + ([_AF_INET, _AF_INET6, _AF_NETLINK] if self.network else [])
        return {"seccomp": True, "socket_families": families,
                "landlock": {"ro": ["/"], "rw": [*writable_inside, "/tmp"], "dev": ["/dev"], "tcp": self.network}}

    def wrap(self, argv: list[str]) -> list[str]:
        """`argv` (bwrap ... -- COMMAND...) with the python runtime and the shim bound in, binds made reachable
        by the slot uid, and COMMAND run through child.py's --exec mode."""
        from whale_ray.sandbox.episode import CHILD_BYTES, CHILD_NAME
        from whale_ray.sandbox.uid_pool import UID_POOL

        cut = argv.index("--")
        opts, command = argv[:cut], argv[cut + 1:]
        if isolation.running_as_root():
            self.uid = UID_POOL.acquire()
        self._shim_dir = tempfile.mkdtemp(prefix="whale-jail-")
        os.chmod(self._shim_dir, 0o755)
        with open(os.path.join(self._shim_dir, CHILD_NAME), "wb") as f:
            f.write(CHILD_BYTES)
        python = isolation.bwrap_launcher()  # the harness sandbox's interpreter (a mirror at /python)
        inside_writable = []
        out: list[str] = []
        i = 0
        while i < len(opts):
            a = opts[i]
            if a in ("--bind", "--ro-bind") and i + 2 < len(opts):
                src, dest = opts[i + 1], opts[i + 2]
                if a == "--bind":
                    inside_writable.append(dest)
                    self._lend(src)
                out += self._bind(a, src, dest)
                i += 3
                continue
            out.append(a)
            i += 1
        extra = [*python.python_binds(), "--ro-bind", self._shim_dir, SHIM_DIR]
        at = next((k for k in range(len(out) - 1) if out[k:k + 2] == ["--remount-ro", "/"]), len(out))
        out[at:at] = extra  # before / turns read-only: the mount points are made in it
        r, w = os.pipe()
        self._go = (r, w)
        out += ["--", python.python_exe, *python.python.flags, f"{SHIM_DIR}/{CHILD_NAME}", "--exec", str(r),
                json.dumps(self.layers(inside_writable)), "--", *command]
        return out

    def _bind(self, flag: str, src: str, dest: str) -> list[str]:
        if self.uid is None or isolation.reachable_by_others(src) or not os.path.exists(src):
            return [flag, src, dest]
        # bwrap runs as the slot uid and must walk to its sources: one under a 0700 parent (a run directory
        # in a private tree) is first bound, by root, at a path it can reach (detached in close()).
        stage = os.path.join(self._shim_dir, f"bind{len(self._staged)}")
        if os.path.isdir(src):
            os.mkdir(stage, 0o755)
        else:
            open(stage, "w").close()
        bind_mount(src, stage)
        self._staged.append(stage)
        return [flag, stage, dest]

    def _lend(self, tree: str) -> None:
        """Make a writable tree the slot uid's for the session (given back to root in close())."""
        if self.uid is None:
            return
        for root, dirs, files in os.walk(tree):
            for name in [root, *(os.path.join(root, n) for n in dirs + files)]:
                os.lchown(name, self.uid, self.uid)
        self._lent.append(tree)

    # -------------------------------------------------------------------------------- running
    def popen(self, argv: list[str], **kwargs: Any) -> subprocess.Popen:
        assert self._go is not None, "wrap() first"
        r, w = self._go
        layer = cgroup_layer()
        if layer is not None:
            self.cgroup = layer.create(JAIL_MEMORY_BYTES, JAIL_PIDS)
        user = {"user": self.uid, "group": self.uid, "extra_groups": []} if self.uid is not None else {}
        proc = subprocess.Popen(argv, pass_fds=(r,), start_new_session=True, **user, **kwargs)
        os.close(r)
        go = b"1"
        if self.cgroup is not None:
            try:
                self.cgroup.add_tree(proc.pid)  # before the go byte: the command has not started yet
            except OSError as e:
                self.notes.append(f"cannot move the jail into its cgroup ({e}): not started")
                go = b"0"
        if self.cgroup is None:
            self.notes.append("no cgroup layer: the agent's memory and processes are not capped by the kernel")
        try:
            os.write(w, go)
        except OSError:
            pass
        os.close(w)
        self._go = None
        return proc

    def close(self) -> None:
        from whale_ray.sandbox.mounts import rmtree
        from whale_ray.sandbox.uid_pool import UID_POOL

        if self.cgroup is not None:
            self.cgroup.remove()
        if self._go is not None:
            for fd in self._go:
                os.close(fd)
            self._go = None
        for stage in reversed(self._staged):
            try:
                detach(stage)
            except OSError:
                pass
        self._staged.clear()
        for tree in self._lent:  # what the agent wrote is root's again before the trusted side reads it
            for root, dirs, files in os.walk(tree):
                for name in [root, *(os.path.join(root, n) for n in dirs + files)]:
                    try:
                        os.lchown(name, 0, 0)
                    except OSError:
                        pass
        self._lent.clear()
        if self.uid is not None:
            UID_POOL.release(self.uid)  # kills anything still running as the slot uid
            self.uid = None
        if self._shim_dir is not None:
            rmtree(self._shim_dir)
            self._shim_dir = None
