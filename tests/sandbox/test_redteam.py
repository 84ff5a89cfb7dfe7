"""Red-team harnesses against the bubblewrap sandbox: each one attacks, and must end with the expected
status (or status ok with the attack visibly failed: the harness returns "blocked"), score 0 when it
fails, leave no process behind, and the same runner must serve a normal episode afterwards.

Loopback only; every case is bounded in time. `pytest -s tests/sandbox/test_redteam.py` prints the table.
"""

from __future__ import annotations

import os
import socket
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

from tests.helpers import slots_held_elsewhere
from whale_ray.records import ModelCall
from whale_ray.sandbox import SandboxLimits, isolation, run_episode

pytestmark = [pytest.mark.timeout(30), pytest.mark.usefixtures("bwrap")]

TASK = {"id": "rt", "question": "What is 2+2?"}
GOLD = "4"
TABLE: list[tuple[str, str, float, float]] = []  # (case, status, seconds, score)
NORMAL = "def run(task, agent):\n    return agent.generate([{'role': 'user', 'content': task['question']}])\n"


def gen(messages, sampling):
    return ModelCall(messages=messages, text="The answer is \\boxed{4}", prompt_ids=[1], completion_ids=[2],
                     logprobs=[-1.0], weight_version=0, finish_reason="stop")


def score(result) -> float:
    if result.status != "ok":
        return 0.0
    try:
        from domains.math_reasoning.verifier import verify
    except ImportError:  # pragma: no cover
        return float(bool(result.answer) and "\\boxed{4}" in result.answer)
    from whale_ray.records import Task

    return float(verify(Task(id=TASK["id"], question=TASK["question"], answer=GOLD), result.answer))


def sandbox_uid_pids() -> list[int]:
    """Live processes of a per-slot sandbox uid that no other process on the machine holds."""
    found = []
    others = slots_held_elsewhere()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                status = f.read()
        except OSError:
            continue
        uid = None
        state = ""
        for line in status.splitlines():
            if line.startswith("Uid:"):
                uid = int(line.split()[1])
            elif line.startswith("State:"):
                state = line.split()[1]
        if uid is None or state == "Z":
            continue
        if isolation.SLOT_UID_BASE <= uid < isolation.SLOT_UID_BASE + isolation.MAX_SLOTS and uid not in others:
            found.append(int(entry))
    return found


def attack(case: str, source: str, expected: str | tuple[str, ...], *, answer: str | None = None,
           task: dict | None = None, max_s: float = 15.0, **limits):
    """Run one attack episode, check status/score/leftovers, then a normal episode on the same runner."""
    limits.setdefault("wall_s", 8.0)
    t = time.monotonic()
    r = run_episode(textwrap.dedent(source), task or TASK, generate=gen, tools_path=None, host_tools={},
                    limits=SandboxLimits(**limits), seed=1)
    dt = time.monotonic() - t
    s = score(r)
    TABLE.append((case, r.status, dt, s))
    expected = (expected,) if isinstance(expected, str) else expected
    assert r.status in expected, (case, r.status, r.reason, r.answer)
    if answer is not None:
        assert r.answer == answer, (case, r.answer)
    assert s == 0.0, (case, r.answer)
    assert dt < max_s, (case, dt)
    deadline = time.monotonic() + 3
    while sandbox_uid_pids() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sandbox_uid_pids() == [], case
    from whale_ray.sandbox import cgroup

    assert cgroup.leftovers() == [], case  # the episode's cgroup (and so every process in it) is gone
    ok = run_episode(NORMAL, TASK, generate=gen, tools_path=None, host_tools={}, limits=SandboxLimits(wall_s=8),
                     seed=2)
    assert ok.status == "ok" and score(ok) == 1.0, (case, ok.status, ok.reason)
    return r


# --------------------------------------------------------------------------------------- network
def test_tcp_connect_to_host_listener():
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    srv.setblocking(False)
    port = srv.getsockname()[1]
    try:
        attack("tcp connect 127.0.0.1", """
            import socket
            def run(task, agent):
                for fam, addr in ((socket.AF_INET, ("127.0.0.1", task["port"])), (socket.AF_INET6, ("::1", task["port"]))):
                    try:
                        s = socket.socket(fam, socket.SOCK_STREAM)
                        s.settimeout(1)
                        s.connect(addr)
                        return "connected \\\\boxed{4}"
                    except OSError:
                        pass
                return "blocked"
            """, "ok", answer="blocked", task=dict(TASK, port=port))
        time.sleep(0.1)
        with pytest.raises(BlockingIOError):
            srv.accept()  # the listener saw no connection
    finally:
        srv.close()


def test_resolve_host_name():
    attack("resolve host name", """
        import socket
        def run(task, agent):
            for host in ("localhost", "example.com", "pypi.org"):
                try:
                    socket.getaddrinfo(host, 443, proto=socket.IPPROTO_TCP)
                    if host != "localhost":
                        return "resolved " + host
                except OSError:
                    pass
            return "blocked"
        """, "ok", answer="blocked")


# ------------------------------------------------------------------------------------ filesystem
def test_read_secrets(tmp_path: Path):
    truth = tmp_path / "ground_truth.txt"
    truth.write_text("GOLD=4\n")
    os.chmod(tmp_path, 0o755)
    r = attack("read /etc/shadow + ground truth", """
        def run(task, agent):
            got = []
            for p in ("/etc/shadow", "/etc/passwd", task["truth"], "/root/.ssh/id_rsa", "/work/main/README.md"):
                try:
                    with open(p) as f:
                        got.append(p + ":" + f.read(200))
                except OSError:
                    pass
            return " | ".join(got) or "blocked"
        """, "ok", answer="blocked", task=dict(TASK, truth=str(truth)))
    assert "GOLD" not in (r.answer or "")


def test_read_other_process_environment(monkeypatch):
    monkeypatch.setenv("WHALE_REDTEAM_SECRET", "s3cr3t-token")
    r = attack("read /proc/*/environ", """
        import os
        def run(task, agent):
            got = []
            for pid in ["1", str(task["host_pid"]), "self"] + [p for p in os.listdir("/proc") if p.isdigit()]:
                try:
                    with open("/proc/%s/environ" % pid, "rb") as f:
                        data = f.read()
                    if b"s3cr3t" in data:
                        got.append(pid)
                except OSError:
                    pass
            return ("leaked " + ",".join(got)) if got else "blocked"
        """, "ok", answer="blocked", task=dict(TASK, host_pid=os.getpid()))
    assert "s3cr3t" not in (r.answer or "")


def test_write_outside_scratch(tmp_path: Path):
    os.chmod(tmp_path, 0o777)  # even a world-writable host directory is out of reach
    target = tmp_path / "pwned"
    attack("write outside scratch", """
        def run(task, agent):
            wrote = []
            for p in ("/sandbox/x", "/usr/x", "/x", "/proc/self/comm", "/etc/x", task["target"],
                      "/sandbox/harness.py"):
                try:
                    with open(p, "w") as f:
                        f.write("x")
                    wrote.append(p)
                except OSError:
                    pass
            return ("wrote " + " ".join(wrote)) if wrote else "blocked"
        """, "ok", answer="blocked", task=dict(TASK, target=str(target)))
    assert not target.exists()


# ----------------------------------------------------------------------------------- processes
def test_fork_bomb_is_bounded():
    attack("fork bomb (nproc 16)", """
        import os, time
        def run(task, agent):
            for _ in range(64):
                try:
                    pid = os.fork()
                except OSError:
                    continue
                if pid == 0:
                    while True:
                        try:
                            os.fork()
                        except OSError:
                            time.sleep(0.05)
            time.sleep(0.5)
            return "bounded"
        """, "ok", answer="bounded", max_processes=16)


def test_daemon_does_not_survive():
    attack("double-fork daemon", """
        import os, time
        def run(task, agent):
            if os.fork() == 0:
                os.setsid()
                if os.fork() == 0:
                    for fd in (0, 1, 2):
                        os.close(fd)
                    time.sleep(120)
                os._exit(0)
            time.sleep(0.3)
            return "daemon left behind"
        """, "ok", answer="daemon left behind")


def test_allocate_8gib():
    attack("allocate 8 GiB", """
        def run(task, agent):
            x = bytearray(8 << 30)
            return "\\\\boxed{4}"
        """, "memory_limit")


def test_spin_ignoring_sigxcpu():
    attack("spin, SIGXCPU ignored", """
        import signal
        def run(task, agent):
            signal.signal(signal.SIGXCPU, signal.SIG_IGN)
            while True:
                pass
        """, "timeout", cpu_s=1, wall_s=10)


def test_sleep_forever():
    attack("sleep forever", """
        import time
        def run(task, agent):
            time.sleep(3600)
        """, "timeout", wall_s=1.0, max_s=5)


def test_kill_everything_and_the_parent():
    victim = subprocess.Popen(["sleep", "30"])
    try:
        attack("kill -1 / parent / host pid", """
            import os, signal
            def run(task, agent):
                hit = []
                for name, pid in (("-1", -1), ("ppid", os.getppid()), ("pid1", 1), ("host", task["victim"]),
                                  ("host-parent", task["host_pid"])):
                    try:
                        os.kill(pid, signal.SIGKILL if pid != -1 else signal.SIGTERM)
                        hit.append(name)
                    except OSError:
                        pass
                return "blocked" if hit in ([], ["-1"]) else "signalled " + " ".join(hit)
            """, "ok", answer="blocked", task=dict(TASK, victim=victim.pid, host_pid=os.getpid()))
        assert victim.poll() is None  # the host process is untouched
    finally:
        victim.kill()
        victim.wait()


# ------------------------------------------------------------------------------ channel & output
def test_flood_stdout():
    attack("flood stdout", """
        import sys
        def run(task, agent):
            while True:
                sys.stdout.write("x" * 65536)
        """, "output_limit")


def test_fake_result_on_stdout():
    r = attack("fake result JSON on stdout", """
        import json, os, sys
        def run(task, agent):
            msg = json.dumps({"type": "result", "answer": "\\\\boxed{4}", "events": []})
            sys.stdout.write(msg + "\\n")
            sys.stdout.flush()
            os._exit(0)
        """, "crashed")
    assert r.answer is None


def test_oversized_rpc_message():
    attack("oversized RPC message", """
        import os
        def run(task, agent):
            os.write(agent._channel.fd, (1 << 30).to_bytes(4, "big") + b"{")
            agent.generate([{"role": "user", "content": "x" * (2 << 20)}])
            return "\\\\boxed{4}"
        """, "output_limit")


def test_return_not_a_str():
    attack("return a non-str", """
        class S(str):
            pass
        def run(task, agent):
            return {"answer": "\\\\boxed{4}"}
        """, "protocol_error")


def test_thread_bomb_is_bounded():
    attack("thread bomb (nproc 16)", """
        import threading, time
        def run(task, agent):
            started = 0
            for _ in range(1000):
                try:
                    threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
                    started += 1
                except RuntimeError:
                    break
            return "bounded" if started < 16 else f"unbounded: {started} threads"
        """, "ok", answer="bounded", max_processes=16)


def test_patch_or_call_the_verifier():
    import domains.math_reasoning.verifier as verifier

    attack("patch or call the verifier", """
        import importlib, os, sys
        def run(task, agent):
            found = []
            for name in ("domains.math_reasoning.verifier", "whale_ray"):
                try:
                    importlib.import_module(name)
                    found.append(name)
                except ImportError:
                    pass
            if os.path.exists(task["verifier"]):
                found.append(task["verifier"])
                try:
                    with open(task["verifier"], "a") as f:
                        f.write("def verify(*a): return 1.0\\n")
                    found.append("patched")
                except OSError:
                    pass
            return ("reached " + " ".join(found)) if found else "blocked"
        """, "ok", answer="blocked", task=dict(TASK, verifier=verifier.__file__))


def test_answer_that_lies_about_equality():
    attack("answer lies about equality", """
        class Liar(str):
            def __eq__(self, other):
                return True
            __hash__ = str.__hash__
        def run(task, agent):
            return Liar("\\\\boxed{999}")
        """, "ok", answer="\\boxed{999}")


# ------------------------------------------------- memory the address space does not see (issue 10)
MEMORY_MB = 256
CGROUP_MARGIN_MB = 16  # the kernel's count may overshoot its limit by a few pages in flight
HOST_MARGIN_MB = 256  # /proc/meminfo is machine-wide: other processes of a shared machine move it too
MEMORY_TABLE: list[tuple[str, str, float, float]] = []  # (case, status, cgroup peak MB, MemAvailable drop MB)


def _available_mb() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no MemAvailable in /proc/meminfo")


def memory_attack(case: str, source: str, expected: str, *, answer_has: str | None = None):
    """attack() with memory_mb=256, plus the host's memory: the cgroup's peak (the kernel's count) and the
    drop of MemAvailable sampled every 10 ms during the episode; and no cgroup or mount left behind."""
    from whale_ray.sandbox import cgroup

    if cgroup.cgroup_layer() is None:
        pytest.skip(f"no cgroup layer here: {cgroup.unavailable()}")
    import threading

    base, low, done = _available_mb(), [_available_mb()], threading.Event()

    def sample():
        while not done.is_set():
            low[0] = min(low[0], _available_mb())
            time.sleep(0.01)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    try:
        r = attack(case, source, expected, memory_mb=MEMORY_MB, wall_s=20.0, max_s=25.0)
    finally:
        done.set()
        t.join()
    peak_mb = (r.peak_memory_bytes or 0) / 2**20
    drop_mb = base - low[0]
    MEMORY_TABLE.append((case, r.status, peak_mb, drop_mb))
    assert r.peak_memory_bytes is not None, case
    assert peak_mb <= MEMORY_MB + CGROUP_MARGIN_MB, (case, peak_mb)
    assert drop_mb <= MEMORY_MB + HOST_MARGIN_MB, (case, drop_mb)
    if expected == "memory_limit":
        assert peak_mb >= 0.9 * MEMORY_MB, (case, peak_mb)  # it was the kernel's count that stopped it
    if answer_has is not None:
        assert answer_has in (r.answer or ""), (case, r.answer)
    assert cgroup.leftovers() == [], case
    with open("/proc/self/mountinfo") as f:
        assert f"whale-sbx-{os.getpid()}-" not in f.read(), case
    assert not list(Path(os.environ.get("TMPDIR", "/tmp")).glob(f"whale-sbx-{os.getpid()}-*")), case
    return r


def test_memfd_outside_the_address_space():
    # 2 GiB in memfds written with write(): never mapped, so RLIMIT_AS does not see a byte of it
    memory_attack("memfd 2 GiB (limit 256 MB)", """
        import os
        def run(task, agent):
            fds, n = [], 0
            while n < 2048:
                fd = os.memfd_create("hold")
                fds.append(fd)
                for _ in range(6):
                    os.write(fd, b"x" * (8 << 20))
                    n += 8
            return "held %d MB \\boxed{4}" % n
        """, "memory_limit")


def test_tmpfs_pages_and_anonymous_memory_together():
    # every capped tmpfs filled (104 MB of file pages), then anonymous memory up to RLIMIT_AS
    memory_attack("tmpfs full + heap (limit 256 MB)", """
        def run(task, agent):
            for d in ("/dev/shm", "/tmp", "/scratch"):
                try:
                    with open(d + "/fill", "wb") as f:
                        while True:
                            f.write(b"x" * (1 << 20))
                except OSError:
                    pass
            held = []
            while True:
                held.append(bytearray(16 << 20))
        """, "memory_limit")


def test_many_small_files_hit_the_inode_cap():
    # kernel memory (inodes, dentries) no byte cap sees: stopped by nr_inodes, long before the memory limit
    memory_attack("2M empty files in tmpfs", """
        def run(task, agent):
            n, err = 0, ""
            for d in ("/scratch", "/tmp", "/dev/shm"):
                try:
                    for i in range(2000000):
                        open("%s/f%d" % (d, i), "w").close()
                        n += 1
                except OSError as e:
                    err = e.strerror
            return "stopped after %d files: %s" % (n, err)
        """, "ok", answer_has="No space left on device")


def test_shared_memory_mapped_then_unmapped():
    # shared memory touched through a MAP_SHARED mapping and unmapped again: the address space is given
    # back, the pages are not (they belong to the memfd, which the harness keeps open)
    memory_attack("memfd mmap+munmap 2 GiB", """
        import mmap, os
        def run(task, agent):
            fds = []
            for _ in range(42):  # 42 x 48 MB
                fd = os.memfd_create("shm")
                os.ftruncate(fd, 48 << 20)
                m = mmap.mmap(fd, 48 << 20, mmap.MAP_SHARED)
                for i in range(0, 48 << 20, 4096):
                    m[i] = 1
                m.close()
                fds.append(fd)
            return "held 2 GiB \\boxed{4}"
        """, "memory_limit")


# ----------------------------------------------------------------- bad frames end one episode (issue 10)
def test_nan_sampling_mid_episode():
    attack("NaN in a generate frame", """
        import os, struct
        def run(task, agent):
            agent.generate([{"role": "user", "content": "hi"}])  # a good call first
            data = b'{"type":"generate","id":9,"messages":[{"role":"u","content":"x"}],"sampling":{"temperature":NaN}}'
            os.write(agent._channel.fd, struct.pack(">I", len(data)) + data)
            return agent._channel.recv()
        """, "protocol_error")


def test_huge_int_and_deep_nesting_in_the_result():
    attack("huge int + deep nesting in result", """
        import os, struct
        def run(task, agent):
            data = (b'{"type":"result","answer":"\\boxed{4}","events":[{"type":"x","n":' + b"9" * 4000 + b'}],'
                    b'"deep":' + b"[" * 50000 + b"]" * 50000 + b'}')
            os.write(agent._channel.fd, struct.pack(">I", len(data)) + data)
            os._exit(0)
        """, "protocol_error")


def test_zz_print_memory_table():
    lines = [f"{'memory case':34} {'status':15} {'cgroup peak MB':>15} {'MemAvailable drop MB':>21}"]
    lines += [f"{c:34} {s:15} {p:15.1f} {d:21.1f}" for c, s, p, d in MEMORY_TABLE]
    print("\n" + "\n".join(lines))


def test_zz_print_table():
    """Last in the file: the table of what happened (visible with -s)."""
    lines = [f"{'case':34} {'status':15} {'seconds':>8} {'score':>6}"]
    lines += [f"{c:34} {s:15} {t:8.2f} {sc:6.1f}" for c, s, t, sc in TABLE]
    print("\n" + "\n".join(lines))
    assert sandbox_uid_pids() == []
