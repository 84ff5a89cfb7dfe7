"""The per-episode cgroup layer (whale_ray/sandbox/cgroup.py) and the host-side tmpfs mounts (mounts.py) on
this machine's kernel: limits written, processes moved in, the kernel's verdict read back, nothing left; a
worker that died mid-episode leaves nothing the next one does not clean up."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from whale_ray.sandbox import cgroup, mounts

layer = cgroup.cgroup_layer()
needs_layer = pytest.mark.skipif(layer is None, reason=f"no cgroup layer: {cgroup.unavailable()}")


@needs_layer
def test_a_cgroup_counts_a_process_tree_and_reports_its_oom_kill():
    cg = layer.create(64 << 20, 16)
    try:
        # the child waits for a go line (as child.py waits for init), forks, and both hold memfd memory
        proc = subprocess.Popen([sys.executable, "-c", """
import os, sys
sys.stdin.readline()
pid = os.fork()
fd = os.memfd_create("x")
for _ in range(64):
    os.write(fd, b"x" * (1 << 20))
os.waitpid(pid, 0) if pid else None
"""], stdin=subprocess.PIPE)
        cg.add_tree(proc.pid)
        proc.stdin.write(b"go\n")
        proc.stdin.close()
        proc.wait(timeout=30)
        assert cg.oom_killed()
        assert 60 << 20 <= cg.peak_bytes() <= (64 << 20) + (1 << 20)
    finally:
        assert cg.remove()
    assert cgroup.leftovers() == []


@needs_layer
def test_a_dead_workers_cgroups_are_swept():
    # a worker pid that is gone: a process that has exited (its pid is not reused this quickly)
    dead = subprocess.Popen(["true"])
    dead.wait()
    orphan = cgroup.EpisodeCgroup(layer, {c: os.path.join(r, f"ep-{dead.pid}-0-abcdef") for c, r in layer.roots.items()})
    for d in orphan.dirs.values():
        os.mkdir(d)
    sleeper = subprocess.Popen(["sleep", "60"])
    orphan.add(sleeper.pid)
    layer.sweep()
    assert sleeper.wait(timeout=10) == -9  # killed with its cgroup
    assert not any(os.path.exists(d) for d in orphan.dirs.values())


@pytest.mark.skipif(not mounts.host_mounts_available(), reason="host-side tmpfs mounts need root")
def test_episode_mounts_have_byte_and_inode_caps_and_go_away():
    m = mounts.EpisodeMounts(None)
    try:
        with open("/proc/self/mountinfo") as f:
            info = [line for line in f if m.dir in line]
        assert len(info) == 4 and all("nr_inodes=" in line and "size=" in line for line in info)
        n = 0
        with pytest.raises(OSError, match="No space left"):
            for n in range(100000):
                open(os.path.join(m.binds["shm"], f"f{n}"), "w").close()
        assert n < 2048
    finally:
        m.close()
    assert not os.path.exists(m.dir)
    with open("/proc/self/mountinfo") as f:
        assert m.dir not in f.read()


def test_without_root_there_is_no_layer_and_the_doctor_says_what_is_unbounded(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    found, why = cgroup._probe()
    assert found is None
    assert "not root" in why and "shared memory, tmpfs pages and kernel memory" in why and "RLIMIT_NPROC" in why


def test_zz_no_leftovers():
    time.sleep(0.1)
    assert cgroup.leftovers() == []
