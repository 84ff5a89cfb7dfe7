"""The sandbox that runs one episode of an untrusted harness (whale_ray/sandbox/).

Real subprocesses under bubblewrap; each test is bounded in time.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from whale_ray.records import STATUSES, ModelCall
from whale_ray.sandbox import SandboxLimits, isolation, run_episode

pytestmark = [pytest.mark.timeout(30), pytest.mark.usefixtures("bwrap")]

TASK = {"id": "t1", "question": "What is 2+2?"}

TOOLS_PY = textwrap.dedent(
    '''
    TOOL_SPECS = {
        "double": {"description": "Doubles a number.",
                   "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}},
    }

    def double(x):
        return str(2 * int(x))
    '''
)


class Recorder:
    """The caller's generate callback: echoes the last message and records what it was asked."""

    def __init__(self):
        self.seen = []
        self.lock = threading.Lock()

    def __call__(self, messages, sampling):
        with self.lock:
            self.seen.append((messages, sampling))
            n = len(self.seen)
        text = f"echo{n}:{messages[-1]['content']}"
        return ModelCall(messages=messages, text=text, prompt_ids=[1, 2], completion_ids=[3, n],
                         logprobs=[-0.5, -0.25], weight_version=7, finish_reason="stop" if n % 2 else "length")


def lookup(key: str) -> str:
    """Looks a key up on the host."""
    return f"value-of-{key}"


def explode() -> str:
    raise ValueError("kaboom")


def run(source: str, *, gen=None, tools_path=None, host_tools=None, seed=1, task=TASK, **limits):
    limits.setdefault("wall_s", 10.0)
    return run_episode(
        textwrap.dedent(source), task, generate=gen or Recorder(), tools_path=tools_path,
        host_tools=host_tools if host_tools is not None else {"lookup": lookup},
        limits=SandboxLimits(**limits), seed=seed,
    )


def procs_with(marker: str) -> list[int]:
    """Pids of live processes whose command line contains `marker` (a /proc scan, no psutil)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read()
            with open(f"/proc/{entry}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue
        if marker.encode() in cmd and state != b"Z":
            found.append(int(entry))
    return found


@pytest.fixture
def tools_py(tmp_path: Path) -> Path:
    p = tmp_path / "tools.py"
    p.write_text(TOOLS_PY)
    return p


# ------------------------------------------------------------------------------------- happy path
def test_ok_episode_generate_tools_and_events(tools_py):
    gen = Recorder()
    r = run(
        """
        def run(task, agent):
            a = agent.generate([{"role": "user", "content": task["question"]}], max_tokens=8, temperature=0.5,
                               top_k=5, top_p=0.9, stop=["\\n"])
            r1 = agent.last_finish_reason
            b = agent.generate([{"role": "user", "content": a}])
            r2 = agent.last_finish_reason
            d = agent.tool("double", x=21)
            h = agent.tool("lookup", key="k")
            agent.log("step", a=a, b=b, d=d, h=h, reasons=[r1, r2], specs=sorted(agent.tool_specs), seed=agent.seed)
            return "\\\\boxed{" + d + "}"
        """,
        gen=gen, tools_path=tools_py, seed=42,
    )
    assert r.status == "ok", r.reason
    assert r.answer == "\\boxed{42}"
    assert [c.text for c in r.calls] == ["echo1:What is 2+2?", "echo2:echo1:What is 2+2?"]
    assert r.calls[0].completion_ids == [3, 1] and r.calls[1].weight_version == 7
    assert r.turns == 2
    assert gen.seen[0][0] == [{"role": "user", "content": "What is 2+2?"}]
    sp = gen.seen[0][1]
    assert (sp.max_tokens, sp.temperature, sp.top_k, sp.top_p, sp.stop) == (8, 0.5, 5, 0.9, ("\n",))
    (ev,) = r.events
    assert ev == {"type": "step", "a": "echo1:What is 2+2?", "b": "echo2:echo1:What is 2+2?", "d": "42",
                  "h": "value-of-k", "reasons": ["stop", "length"], "specs": ["double", "lookup"], "seed": 42}
    assert r.wall_s > 0


def test_tool_specs_merge_local_and_host(tools_py):
    r = run(
        """
        def run(task, agent):
            agent.log("specs", specs=agent.tool_specs)
            return None
        """,
        tools_path=tools_py,
    )
    assert r.status == "ok" and r.answer is None
    specs = r.events[0]["specs"]
    assert specs["double"]["parameters"]["required"] == ["x"]
    assert specs["lookup"]["description"] == "Looks a key up on the host."
    assert specs["lookup"]["parameters"]["properties"] == {"key": {"type": "string"}}


def test_tool_errors_are_catchable(tools_py):
    r = run(
        """
        def run(task, agent):
            out = []
            for name, kw in [("nope", {}), ("double", {"y": 1}), ("lookup", {}), ("lookup", {"key": 1, "z": 2}),
                             ("explode", {})]:
                try:
                    agent.tool(name, **kw)
                    out.append("no error")
                except agent.ToolError as e:
                    out.append(str(e))
            return "|".join(out)
        """,
        tools_path=tools_py, host_tools={"lookup": lookup, "explode": explode},
    )
    assert r.status == "ok", r.reason
    unknown, bad_local, bad_host, bad_host2, exploded = r.answer.split("|")
    assert unknown.startswith("unknown tool 'nope'")
    assert bad_local.startswith("bad arguments for tool 'double'")
    assert bad_host.startswith("bad arguments for tool 'lookup'")
    assert bad_host2.startswith("bad arguments for tool 'lookup'")
    assert exploded == "tool 'explode' raised ValueError: kaboom"
    # The trusted record of host tool calls: what the harness asked and got, whatever it logs itself.
    assert [(c["name"], "error" in c) for c in r.tool_calls] == [("lookup", True), ("lookup", True), ("explode", True)]
    assert r.tool_calls[2]["error"] == exploded


def test_host_tool_calls_are_recorded_on_the_trusted_side():
    r = run(
        """
        def run(task, agent):
            agent.tool("lookup", key="a")
            return agent.tool("lookup", key="b")
        """,
    )
    assert r.status == "ok", r.reason
    assert r.tool_calls == [{"name": "lookup", "args": {"key": "a"}, "output": "value-of-a"},
                            {"name": "lookup", "args": {"key": "b"}, "output": "value-of-b"}]


def test_an_episode_says_where_its_time_went():
    """The model's and the host tools' time is what the host spent in them, the start is before any harness code ran,
    and the parts add up to no more than the episode's wall time; a harness's own sleep is in none of them."""
    def slow_model(messages, sampling):
        time.sleep(0.2)
        return Recorder()(messages, sampling)

    def slow_lookup(key: str) -> str:
        time.sleep(0.1)
        return key

    r = run(
        """
        import time

        def run(task, agent):
            agent.generate([{"role": "user", "content": "a"}])
            agent.generate([{"role": "user", "content": "b"}])
            time.sleep(0.3)
            return agent.tool("lookup", key="x")
        """,
        gen=slow_model, host_tools={"lookup": slow_lookup},
    )
    assert r.status == "ok", r.reason
    t = r.timings
    assert 0.4 <= t["model"] < 0.4 + 0.2 and 0.1 <= t["tools"] < 0.1 + 0.2
    assert 0 < t["start"] and 0 <= t["teardown"]
    assert sum(t.values()) + 0.3 <= r.wall_s + 0.01  # the harness's own sleep is the rest


def test_generate_validates_messages():
    r = run(
        """
        def run(task, agent):
            out = []
            for bad in ([], "hi", [{"role": "user"}], [{"role": "user", "content": 3}], [{"role": "u", "content": "x", "name": "n"}]):
                try:
                    agent.generate(bad)
                    out.append("accepted")
                except ValueError:
                    out.append("ValueError")
            try:
                agent.generate([{"role": "user", "content": "x"}], max_tokens=0)
            except ValueError:
                out.append("ValueError")
            return ",".join(out)
        """
    )
    assert r.status == "ok", r.reason
    assert r.answer == ",".join(["ValueError"] * 6)
    assert r.calls == []


# ---------------------------------------------------------------------------------- harness errors
def test_harness_exception_names_the_line():
    gen = Recorder()
    r = run(
        """
        def helper(x):
            return x / 0

        def run(task, agent):
            agent.generate([{"role": "user", "content": "first"}])
            agent.log("before")
            return helper(1)
        """,
        gen=gen,
    )
    assert r.status == "harness_exception"
    assert r.reason == "harness raised ZeroDivisionError: division by zero at harness.py line 3"
    assert [c.text for c in r.calls] == ["echo1:first"]  # calls survive the failure
    assert r.answer is None
    assert r.events[0] == {"type": "before"}
    assert "ZeroDivisionError" in r.events[-1]["traceback"] and r.events[-1]["type"] == "error_traceback"


def test_syntax_error():
    r = run("x = 1\n\ndef run(task, agent)\n    return 'x'\n")
    assert r.status == "harness_exception"
    assert r.reason.startswith("SyntaxError in harness.py line 3:"), r.reason


def test_no_run_function():
    r = run("def walk(task, agent):\n    return 'x'\n")
    assert r.status == "harness_exception"
    assert r.reason == "no run(task, agent) function in harness.py"


def test_module_level_error_and_custom_name():
    r = run_episode("import json\nraise KeyError('boom')\n", TASK, generate=Recorder(), tools_path=None,
                    host_tools={}, limits=SandboxLimits(wall_s=10), seed=0, harness_name="cand_007.py")
    assert r.status == "harness_exception"
    assert r.reason == "harness raised KeyError: 'boom' at cand_007.py line 2"


def test_run_returning_int_is_protocol_error():
    r = run("def run(task, agent):\n    return 42\n")
    assert r.status == "protocol_error"
    assert r.reason == "run() returned int, expected str or None"


def test_sys_exit_and_hard_exit():
    r = run("import sys\ndef run(task, agent):\n    sys.exit(3)\n")
    assert r.status == "harness_exception" and "SystemExit: 3" in r.reason
    r = run("import os\ndef run(task, agent):\n    agent.generate([{'role': 'user', 'content': 'x'}])\n    os._exit(5)\n")
    assert r.status == "crashed" and "code 5" in r.reason and len(r.calls) == 1
    r = run("import os, signal\ndef run(task, agent):\n    os.kill(os.getpid(), signal.SIGSEGV)\n")
    assert r.status == "crashed" and "SIGSEGV" in r.reason


# ----------------------------------------------------------------------------------------- limits
def test_sleep_forever_times_out_and_leaves_no_process():
    marker = f"whale-marker-{uuid.uuid4().hex}"
    seen: list[int] = []
    stop = threading.Event()

    def watch():  # proves the /proc scan does see the harness's processes while the episode runs
        while not stop.wait(0.1):
            seen.append(len(procs_with(marker)))

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        r = run(
            f"""
            import subprocess, sys, time
            def run(task, agent):
                subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1000)", "{marker}"])
                subprocess.Popen(["sh", "-c", "sleep 1000; :", "{marker}"], start_new_session=True)
                time.sleep(1000)
            """,
            wall_s=1.5,
        )
    finally:
        stop.set()
        watcher.join()
    assert r.status == "timeout", r.reason
    assert r.reason == "wall-clock limit of 1.5 s exceeded"
    assert max(seen) == 2
    assert procs_with(marker) == []  # gone by the time run_episode returns, no waiting


def test_background_processes_die_with_an_ok_episode():
    marker = f"whale-marker-{uuid.uuid4().hex}"
    r = run(
        f"""
        import os, subprocess, sys, time
        def run(task, agent):
            subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1000)", "{marker}"])
            if os.fork() == 0:
                os.setsid()
                os.execv("/bin/sh", ["sh", "-c", "sleep 1000; :", "{marker}"])
            time.sleep(0.3)
            return "spawned"
        """
    )
    assert r.status == "ok" and r.answer == "spawned"
    assert procs_with(marker) == []


def test_scratch_directory_is_removed_even_if_locked_down():
    before = set(Path(os.environ.get("TMPDIR", "/tmp")).glob(f"whale-sbx-{os.getpid()}-*"))
    r = run(
        """
        import os
        def run(task, agent):
            os.makedirs("a/b")
            open("a/b/f", "w").close()
            os.chmod("a/b", 0)
            os.chmod("a", 0)
            return os.getcwd()
        """
    )
    assert r.status == "ok"
    assert set(Path(os.environ.get("TMPDIR", "/tmp")).glob(f"whale-sbx-{os.getpid()}-*")) <= before


def test_busy_loop_times_out():
    r = run("def run(task, agent):\n    while True:\n        pass\n", wall_s=1.0)
    assert (r.status, r.reason) == ("timeout", "wall-clock limit of 1 s exceeded")


def test_cpu_limit():
    r = run("def run(task, agent):\n    while True:\n        pass\n", wall_s=10.0, cpu_s=1.0)
    assert r.status == "timeout"
    assert "CPU time" in r.reason


def test_wall_clock_excludes_host_generate_time():
    def slow_gen(messages, sampling):
        time.sleep(0.6)
        return Recorder()(messages, sampling)

    r = run(
        "def run(task, agent):\n    for _ in range(3):\n        agent.generate([{'role': 'user', 'content': 'x'}])\n    return 'done'\n",
        gen=slow_gen, wall_s=1.0,
    )
    assert r.status == "ok", r.reason
    assert r.wall_s > 1.5


def test_allocating_4gib_is_memory_limit():
    r = run("def run(task, agent):\n    x = bytearray(4 << 30)\n    return 'no'\n")
    assert r.status == "memory_limit"
    assert "MemoryError" in r.reason and "harness.py line 2" in r.reason and "1024 MB" in r.reason


def test_gradual_allocation_is_memory_limit():
    r = run(
        """
        def run(task, agent):
            agent.log("start")
            chunks = []
            while True:
                chunks.append(bytearray(8 << 20))
        """,
        memory_mb=256,
    )
    assert r.status == "memory_limit", r.reason
    assert r.events[0] == {"type": "start"}


def test_process_limit():
    r = run(
        """
        import os, time
        def run(task, agent):
            n = 0
            try:
                while n < 200:
                    pid = os.fork()
                    if pid == 0:
                        time.sleep(3)
                        os._exit(0)
                    n += 1
            except OSError as e:
                return f"{n} {e.errno}"
            return f"{n} none"
        """,
        max_processes=8,
    )
    assert r.status == "ok", r.reason
    n, err = r.answer.split()
    assert int(n) < 8 and err == "11"  # EAGAIN


def test_stdout_flood_is_output_limit():
    r = run(
        "import sys\ndef run(task, agent):\n    while True:\n        sys.stdout.write('x' * 65536)\n",
        max_output_bytes=1 << 20,
    )
    assert r.status == "output_limit"
    assert "stdout/stderr" in r.reason


def test_moderate_output_is_fine():
    r = run("def run(task, agent):\n    for i in range(1000):\n        print('line', i)\n    return 'ok'\n")
    assert r.status == "ok" and r.answer == "ok"


def test_too_many_generate_calls_is_output_limit():
    gen = Recorder()
    r = run(
        "def run(task, agent):\n    while True:\n        agent.generate([{'role': 'user', 'content': 'x'}])\n",
        gen=gen, max_rpc_calls=5,
    )
    assert r.status == "output_limit"
    assert "more than 5 RPC calls" in r.reason
    assert len(r.calls) == 5


def test_oversized_message_is_output_limit():
    r = run("def run(task, agent):\n    return 'x' * 200000\n", max_message_bytes=100000)
    assert r.status == "output_limit"


def test_garbage_on_the_socket_is_protocol_error():
    r = run(
        """
        import os, sys, time
        def run(task, agent):
            os.write(int(sys.argv[1]), b"\\x00\\x00\\x00\\x05hello")
            time.sleep(5)
        """
    )
    assert r.status == "protocol_error"
    assert "malformed" in r.reason


def test_forged_messages_are_protocol_errors():
    r = run(
        """
        import json, os, sys, time
        def run(task, agent):
            data = json.dumps({"type": "launch_missiles"}).encode()
            os.write(int(sys.argv[1]), len(data).to_bytes(4, "big") + data)
            time.sleep(5)
        """
    )
    assert r.status == "protocol_error" and "unknown RPC message type" in r.reason
    r = run(
        """
        import json, os, sys, time
        def run(task, agent):
            data = json.dumps({"type": "result", "answer": 5, "events": []}).encode()
            os.write(int(sys.argv[1]), len(data).to_bytes(4, "big") + data)
            time.sleep(5)
        """
    )
    assert r.status == "protocol_error" and r.reason == "run() returned int, expected str or None"


def test_broken_tools_module_is_setup_error_and_cannot_be_forged(tmp_path):
    broken = tmp_path / "tools.py"
    broken.write_text("TOOL_SPECS = {}\nraise RuntimeError('tools broke')\n")
    r = run("def run(task, agent):\n    return 'x'\n", tools_path=broken)
    assert r.status == "sandbox_setup_error"
    assert r.reason == "the domain tools module raised RuntimeError: tools broke at tools.py line 2"
    r = run(
        """
        import json, os, sys, time
        def run(task, agent):
            data = json.dumps({"type": "error", "kind": "setup", "error": "fake", "traceback": ""}).encode()
            os.write(int(sys.argv[1]), len(data).to_bytes(4, "big") + data)
            time.sleep(5)
        """
    )
    assert r.status == "protocol_error"


# -------------------------------------------------------------------------------------- isolation
def test_network_is_unreachable():
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    try:
        r = run(
            f"""
            import socket
            def run(task, agent):
                try:
                    s = socket.create_connection(("127.0.0.1", {port}), timeout=2)
                    s.sendall(b"hello")
                    return "connected"
                except OSError as e:
                    return "blocked"
            """
        )
        assert r.status == "ok", r.reason
        assert r.answer == "blocked"
        with pytest.raises(BlockingIOError):
            listener.accept()
    finally:
        listener.close()


def test_host_secrets_are_not_visible(monkeypatch):
    monkeypatch.setenv("WHALE_TEST_SECRET", "hunter2")
    r = run(
        """
        import os
        def run(task, agent):
            env = dict(os.environ)
            agent.log("env", env=env)
            return "leak" if any("hunter2" in v for v in env.values()) or "WHALE_TEST_SECRET" in env else "clean"
        """
    )
    assert r.status == "ok" and r.answer == "clean"
    assert set(r.events[0]["env"]) <= {"PATH", "HOME", "TMPDIR", "LANG", "PYTHONDONTWRITEBYTECODE", "PYTHONHASHSEED", "PWD",
                                          "LD_LIBRARY_PATH"}  # a mirrored interpreter: /python/lib


def test_filesystem_is_confined(tmp_path):
    outside = tmp_path / "outside.txt"
    repo = Path(__file__).resolve().parents[2]
    r = run(
        f"""
        import errno, os, sys
        def try_write(p, n=1):
            try:
                with open(p, "wb") as f:
                    f.write(b"x" * n)
                return "written"
            except OSError as e:
                return errno.errorcode.get(e.errno, str(e.errno))

        def run(task, agent):
            denied = {{p: try_write(p) for p in ["{outside}", "/usr/pwned", "/etc/pwned", "{repo}/pwned",
                                               sys.prefix + "/pwned", "/pwned", "/dev/pwned", "/sandbox/pwned",
                                               "/sandbox/harness.py", "/sandbox/.whale/child.py"]}}
            allowed = {{p: try_write(p) for p in ["/scratch/f", "/tmp/f", "/dev/shm/f", "f"]}}
            filled = [try_write(f"/scratch/big{{i}}", 16 << 20) for i in range(6)]
            seen = {{p: os.path.exists(p) for p in ["{repo}", "/work", "/root/.cache", "/etc/passwd", "{tmp_path}",
                     os.path.join(sys.prefix, "lib", "python%d.%d" % sys.version_info[:2], "site-packages")]}}
            agent.log("fs", denied=denied, allowed=allowed, filled=filled, seen=seen, cwd=os.getcwd(),
                      home=os.environ["HOME"], harness=open("/sandbox/harness.py").read()[:20])
            return "done"
        """
    )
    assert r.status == "ok", r.reason
    ev = r.events[0]
    assert all(v in ("EROFS", "EACCES", "ENOENT", "EPERM") for v in ev["denied"].values()), ev["denied"]
    assert set(ev["allowed"].values()) == {"written"}, ev["allowed"]
    assert ev["filled"][:3] == ["written"] * 3 and "ENOSPC" in ev["filled"], ev["filled"]  # /scratch is capped
    assert not any(ev["seen"].values()), ev["seen"]
    assert ev["cwd"] == ev["home"] == "/scratch"
    assert ev["harness"].strip().startswith("import errno")
    assert not outside.exists()
    assert not (repo / "pwned").exists()


def test_hash_seed_follows_episode_seed():
    src = "def run(task, agent):\n    return str(hash('whale'))\n"
    a, b, c = run(src, seed=5), run(src, seed=5), run(src, seed=6)
    assert a.answer == b.answer != c.answer


def test_runs_as_unprivileged_user():
    r = run("import os\ndef run(task, agent):\n    return f'{os.getuid()} {os.getgid()}'\n")
    assert r.status == "ok"
    if os.geteuid() == 0:
        uid, gid = map(int, r.answer.split())
        assert uid == gid and isolation.SLOT_UID_BASE <= uid < isolation.SLOT_UID_BASE + isolation.MAX_SLOTS


# ------------------------------------------------------------------------------- hardening layers
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="per-slot uids need root")


@needs_root
def test_concurrent_episodes_get_their_own_uids_and_a_fork_bomb_stays_in_its_slot():
    from whale_ray.sandbox.uid_pool import UID_POOL

    bomb = """
        import os, time
        def run(task, agent):
            agent.generate([{"role": "user", "content": str(os.getuid())}])
            n = 0
            try:
                while n < 500:
                    if os.fork() == 0:
                        time.sleep(30)
                        os._exit(0)
                    n += 1
            except OSError as e:
                return f"{os.getuid()} {n} {e.errno}"
            return f"{os.getuid()} {n} none"
        """
    quiet = """
        import os, subprocess, sys
        def run(task, agent):
            agent.generate([{"role": "user", "content": str(os.getuid())}])
            out = subprocess.run([sys.executable, "-c", "print(1)"], capture_output=True, text=True)
            return f"{os.getuid()} {out.stdout.strip()}"
        """
    barrier = threading.Barrier(2, timeout=10)

    def gen(messages, sampling):
        barrier.wait()  # both episodes hold their slot at the same time
        return ModelCall(messages=messages, text="x", prompt_ids=[1], completion_ids=[2], logprobs=[-1.0],
                         weight_version=0, finish_reason="stop")

    with ThreadPoolExecutor(2) as pool:
        fa = pool.submit(run, bomb, gen=gen, max_processes=16)
        fb = pool.submit(run, quiet, gen=gen, max_processes=16)
        a, b = fa.result(), fb.result()
    assert a.status == "ok" and b.status == "ok", (a.reason, b.reason)
    uid_a, n, err = a.answer.split()
    uid_b, one = b.answer.split()
    assert uid_a != uid_b and int(uid_a) >= isolation.SLOT_UID_BASE and int(uid_b) >= isolation.SLOT_UID_BASE
    assert int(n) < 16 and err == "11" and one == "1"
    assert UID_POOL.in_use() == []
    assert not [p for p in procs_with("child.py") if _uid_of(p) in (int(uid_a), int(uid_b))]



# Run in a process of its own: a subreaper is one for good, and pytest's process must not become one.
_REAP_PROBE = r"""
import json, os, sys
from whale_ray.records import ModelCall
from whale_ray.sandbox import SandboxLimits, isolation, run_episode
from whale_ray.sandbox.episode import become_subreaper
from whale_ray.sandbox.uid_pool import UID_POOL, UidPool

isolation.bwrap_launcher()  # as the SandboxEvaluator does: the launcher's probe before becoming a subreaper
subreaper = sys.argv[1] == "1" and become_subreaper()
scans = []
real_reap = UidPool._reap
UidPool._reap = staticmethod(lambda uid: (scans.append(uid), real_reap(uid)))
plain = "import os\ndef run(task, agent):\n    agent.generate([{'role': 'user', 'content': 'hi'}])\n    return str(os.getuid())\n"
# leaves a process behind in the sandbox, which the teardown's kill of the namespace must take along
daemon = plain.replace("    return", "    import subprocess, sys\n    subprocess.Popen([sys.executable, '-c', "
                       "'import time; time.sleep(30) # whale-reap-probe'], start_new_session=True)\n    return")
gen = lambda messages, sampling: ModelCall(messages=messages, text="x", prompt_ids=[1], completion_ids=[2],
                                           logprobs=[-1.0], weight_version=0, finish_reason="stop")
episodes = []
for seed, harness in enumerate([plain, daemon, plain, daemon]):
    before = len(scans)
    r = run_episode(harness, {"id": "t", "question": "q"}, generate=gen, tools_path=None, host_tools={},
                    limits=SandboxLimits(wall_s=10.0), seed=seed)
    assert r.status == "ok", r.reason
    episodes.append({"uid": int(r.answer), "scanned": len(scans) > before})
left = []  # this process's zombies, and the daemons of the episodes above, alive
for entry in filter(str.isdigit, os.listdir("/proc")):
    try:
        status = open(f"/proc/{entry}/status").read()
        cmdline = open(f"/proc/{entry}/cmdline", "rb").read()
    except OSError:
        continue
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    zombie = fields["State"].strip().startswith("Z")
    if int(entry) == os.getpid():
        continue
    if (zombie and int(fields["PPid"]) == os.getpid()) or (not zombie and b"whale-reap-probe" in cmdline):
        left.append((int(entry), fields["State"].strip(), fields["Name"].strip()))
print(json.dumps({"subreaper": subreaper, "episodes": episodes, "left": left, "in_use": UID_POOL.in_use()}))
"""


@needs_root
@pytest.mark.parametrize("subreaper", [True, False])
def test_a_slot_uid_comes_back_with_nothing_left_running_as_it(subreaper):
    """bwrap's outer process can exit before reaping the sandbox's pid-namespace init. A subreaper (what the
    SandboxEvaluator is) reaps that init itself: the uid goes back without a /proc scan and not even a zombie
    of the episode is left under it. Without one, the uid pool's scan runs (the orphaned init lingers as the
    host pid 1's zombie, which runs nothing); either way nothing of the episode is left alive."""
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", _REAP_PROBE, "1" if subreaper else "0"], capture_output=True,
                         text=True, timeout=120, cwd=root, env={**os.environ, "PYTHONPATH": str(root)})
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["subreaper"] is subreaper and got["in_use"] == [] and got["left"] == [], got
    assert all(e["uid"] >= isolation.SLOT_UID_BASE for e in got["episodes"])
    if subreaper:
        assert not any(e["scanned"] for e in got["episodes"]), got

def _uid_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Uid:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def test_uid_pool_is_thread_safe():
    from whale_ray.sandbox.uid_pool import UidPool

    pool = UidPool(base=900000, size=64)
    got: list[int] = []
    lock = threading.Lock()

    def take():
        uid = pool.acquire()
        with lock:
            got.append(uid)

    threads = [threading.Thread(target=take) for _ in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(got)) == 32 and all(900000 <= u < 900064 for u in got)
    for u in got:
        pool.release(u)
    assert pool.in_use() == []


def test_seccomp_denies_sockets_ptrace_and_namespaces_but_rpc_and_tools_work(tools_py):
    r = run(
        """
        import ctypes, errno, json, os, socket
        def run(task, agent):
            out = {}
            for name, fam in (("inet", socket.AF_INET), ("inet6", socket.AF_INET6), ("netlink", socket.AF_NETLINK)):
                try:
                    socket.socket(fam, socket.SOCK_DGRAM if fam == socket.AF_NETLINK else socket.SOCK_STREAM)
                    out[name] = "open"
                except PermissionError:
                    out[name] = "EPERM"
                except OSError as e:
                    out[name] = errno.errorcode.get(e.errno, str(e.errno))
            a, b = socket.socketpair()
            a.sendall(b"hi"); out["unix"] = b.recv(2).decode()
            libc = ctypes.CDLL(None, use_errno=True)
            for name, call in (("ptrace", lambda: libc.ptrace(16, 1, 0, 0)),
                               ("unshare", lambda: libc.unshare(0x20000)),
                               ("setns", lambda: libc.setns(0, 0)),
                               ("mount", lambda: libc.mount(b"none", b"/scratch", b"tmpfs", 0, None)),
                               ("chroot", lambda: libc.chroot(b"/scratch")),
                               ("bpf", lambda: libc.syscall(321, 0, 0, 0)),
                               ("keyctl", lambda: libc.syscall(250, 0, 0, 0))):
                rc = call()
                out[name] = "EPERM" if rc == -1 and ctypes.get_errno() == errno.EPERM else f"rc={rc}"
            out["gen"] = agent.generate([{"role": "user", "content": "hi"}])
            out["tool"] = agent.tool("double", x=4)
            out["host"] = agent.tool("lookup", key="k")
            out["layers"] = agent.sandbox
            return json.dumps(out)
        """,
        tools_path=tools_py,
    )
    assert r.status == "ok", r.reason
    out = json.loads(r.answer)
    for name in ("inet", "inet6", "netlink", "ptrace", "unshare", "setns", "mount", "chroot", "bpf", "keyctl"):
        assert out[name] == "EPERM", (name, out)
    assert out["unix"] == "hi" and out["gen"] == "echo1:hi" and out["tool"] == "8" and out["host"] == "value-of-k"
    assert out["layers"]["seccomp"] is True


def test_math_python_tool_works_under_the_filters():
    repo = Path(__file__).resolve().parents[2]
    tools = repo / "domains" / "math_reasoning" / "tools.py"
    if not tools.exists():
        pytest.skip("no math domain")
    r = run(
        """
        def run(task, agent):
            a = agent.tool("python", code="print(6 * 7)")
            b = agent.tool("python", code="import socket\\ntry:\\n    socket.create_connection(('127.0.0.1', 1))\\n"
                                          "except OSError as e:\\n    print(type(e).__name__)")
            return a.strip() + " " + b.strip()
        """,
        tools_path=tools, host_tools={},
    )
    assert r.status == "ok", r.reason
    assert r.answer == "42 PermissionError"


def test_landlock_confines_writes_and_signals():
    from whale_ray.sandbox import child

    abi = child.landlock_abi()
    if abi < 1:
        pytest.skip("no Landlock on this kernel")
    r = run(
        """
        import json, os, signal
        def run(task, agent):
            out = {"abi": agent.sandbox["landlock_abi"]}
            for path in ("/proc/self/comm", "/dev/shm/ok", "/tmp/ok", "/scratch/ok"):
                try:
                    with open(path, "w") as f:
                        f.write("x")
                    out[path] = "written"
                except OSError as e:
                    out[path] = type(e).__name__
            try:
                os.kill(1, signal.SIGTERM)  # bwrap's init: outside the Landlock domain
                out["kill1"] = "sent"
            except OSError as e:
                out["kill1"] = type(e).__name__
            return json.dumps(out)
        """
    )
    assert r.status == "ok", r.reason
    out = json.loads(r.answer)
    assert out["abi"] == abi
    assert out["/proc/self/comm"] == "PermissionError"
    assert out["/dev/shm/ok"] == out["/tmp/ok"] == out["/scratch/ok"] == "written"
    if abi >= 6:
        assert out["kill1"] == "PermissionError"


# ----------------------------------------------------------------------------- host and lifecycle
def test_auto_without_bwrap_is_setup_error(tmp_path):
    """A process whose bubblewrap is missing ($WHALE_BWRAP names a file that is not there): each episode is a
    sandbox_setup_error saying what to install, and the harness never runs unsandboxed."""
    marker = tmp_path / "ran"
    script = textwrap.dedent(f"""
        import json
        from whale_ray.sandbox import SandboxLimits, run_episode
        harness = "def run(task, agent):\\n    open({str(marker)!r}, 'w').write('x')\\n    return 'x'\\n"
        r = run_episode(harness, {{"id": "t", "question": "q"}}, generate=None, tools_path=None, host_tools={{}},
                        limits=SandboxLimits(isolation="auto"), seed=1)
        print(json.dumps({{"status": r.status, "reason": r.reason}}))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**os.environ, isolation.BWRAP_ENV: str(tmp_path / "no-such-bwrap")})
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["status"] == "sandbox_setup_error"
    assert "install bubblewrap" in r["reason"] and "unsafe_none" in r["reason"] and "no-such-bwrap" in r["reason"]
    assert not marker.exists()
    assert run("def run(task, agent):\n    return 'x'\n").status == "ok"  # this process's bwrap still works


def test_unsafe_none_runs_without_isolation():
    r = run("import os\ndef run(task, agent):\n    return agent.generate([{'role': 'user', 'content': 'u'}])\n",
            isolation="unsafe_none")
    assert r.status == "ok" and r.answer == "echo1:u"


def test_generate_callback_failure_is_raised():
    def broken(messages, sampling):
        raise RuntimeError("policy server down")

    with pytest.raises(RuntimeError, match="policy server down"):
        run("def run(task, agent):\n    agent.generate([{'role': 'user', 'content': 'x'}])\n", gen=broken)


def test_bad_limits_and_arguments_raise():
    with pytest.raises(ValueError):
        SandboxLimits(isolation="docker")
    with pytest.raises(ValueError):
        SandboxLimits(wall_s=0)
    with pytest.raises(ValueError):
        run("def run(task, agent):\n    return 'x'\n", task={"id": object()})


def test_runner_serves_another_episode_after_a_failure():
    assert run("def run(task, agent):\n    while True:\n        pass\n", wall_s=0.5).status == "timeout"
    r = run("def run(task, agent):\n    return agent.generate([{'role': 'user', 'content': 'again'}])\n")
    assert r.status == "ok" and r.answer == "echo1:again"


def test_concurrent_episodes_from_threads(tools_py):
    src = textwrap.dedent(
        """
        def run(task, agent):
            a = agent.generate([{"role": "user", "content": task["question"]}])
            return a + "|" + agent.tool("double", x=int(task["id"])) + "|" + agent.tool("lookup", key=task["id"])
        """
    )

    def one(i):
        return run_episode(src, {"id": str(i), "question": f"q{i}"}, generate=Recorder(), tools_path=tools_py,
                           host_tools={"lookup": lookup}, limits=SandboxLimits(wall_s=20), seed=i)

    fds_before = len(os.listdir("/proc/self/fd"))
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(8)))
    for i, r in enumerate(results):
        assert r.status == "ok", r.reason
        assert r.answer == f"echo1:q{i}|{2 * i}|value-of-{i}"
    assert len(os.listdir("/proc/self/fd")) <= fds_before  # no leaked sockets, pipes or pidfds


def test_limits_from_config_match_defaults():
    from whale_ray.config import SandboxConfig

    assert SandboxLimits.from_config(SandboxConfig()) == SandboxLimits()
    lim = SandboxLimits.from_config(SandboxConfig(wall_s=5, memory_mb=256, isolation="unsafe_none"), max_rpc_calls=9)
    assert (lim.wall_s, lim.memory_mb, lim.isolation, lim.cpu_limit_s, lim.max_rpc_calls) == (5, 256, "unsafe_none", 5, 9)


def test_every_status_is_a_known_one():
    assert {"ok", "timeout", "memory_limit", "output_limit", "protocol_error", "harness_exception",
            "sandbox_setup_error", "crashed", "sandbox_error"} == set(STATUSES)


def test_doctor_reports_every_layer():
    from whale_ray.doctor import doctor_report, format_doctor

    rows = doctor_report()
    names = [r[0] for r in rows]
    for layer in ("bubblewrap", "user namespaces", "unprivileged uid drop", "per-slot uids", "rlimits", "seccomp",
                  "Landlock", "wall-clock kill", "output/RPC caps"):
        assert layer in names
    assert all(isinstance(n, str) and isinstance(a, bool) and isinstance(w, str) and w for n, a, w in rows)
    by = {n: a for n, a, _ in rows}
    assert by["bubblewrap"] and by["seccomp"] and by["wall-clock kill"] and by["rlimits"]
    text = format_doctor(rows)
    assert text.count("\n") == len(rows) and "layers active" in text


def test_mountinfo_shows_no_host_paths(bwrap):
    r = run("def run(task, agent):\n    return ''.join(open(f).read() for f in ('/proc/self/mountinfo', "
            "'/proc/self/mounts', '/proc/self/cgroup'))\n")
    assert r.status == "ok"
    prefix = os.path.realpath(sys.base_prefix)
    leaks = ["whale-sbx-", "/work", "whale-ray/ep-"] + ([prefix] if not prefix.startswith("/usr") else [])
    if isolation.running_as_root():  # host-side tmpfs: the episode's files are the root of their own mount
        assert " / /sandbox " in r.answer and "nr_inodes=" in r.answer
        leaks.append("/root")
    assert [leak for leak in leaks if leak in r.answer] == []


def test_a_host_failure_is_that_episodes_sandbox_error_and_the_chunk_goes_on(bwrap):
    """EpisodeRunner's defence in depth: whatever raises on the trusted side for one episode (here the policy
    callback, for one task only) becomes that episode's sandbox_error with the traceback; the others score."""
    from actors.sandbox_evaluator import EpisodeJob, EpisodeRunner
    from whale_ray.records import Task

    def generate(messages, sampling):
        if "boom" in messages[-1]["content"]:
            raise ZeroDivisionError("the host broke on this one")
        return Recorder()(messages, sampling)

    runner = EpisodeRunner("math_reasoning", generate, SandboxLimits(wall_s=10), slots=3)
    harness = "def run(task, agent):\n    return agent.generate([{'role': 'user', 'content': task['question']}])\n"
    jobs = [EpisodeJob(Task(id=f"t{i}", question=q, answer="1"), seed=i) for i, q in enumerate(["a", "boom", "c"])]
    results = runner.run_episodes(harness, "harness.py", jobs)
    assert [r.status for r in results] == ["ok", "sandbox_error", "ok"]
    assert "ZeroDivisionError: the host broke on this one" in results[1].reason and "Traceback" in results[1].reason
    assert "'t1'" in results[1].reason and results[1].answer is None
