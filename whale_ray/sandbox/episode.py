"""One episode's state machine on the host side: prepare the episode directory, start the sandbox, serve
the child's frames, decide the outcome, tear down. run_episode (runner.py) makes one `Episode` per call.

One episode, in order:
1. a fresh episode directory (mounts.EpisodeMounts, removed afterwards) receives copies of child.py and
   tools.py (in `.whale/`) and of the harness file; bubblewrap shows it read-only at /sandbox, and gives
   the harness a capped tmpfs /scratch as HOME and cwd (as root these are host-side tmpfs mounts with
   byte and inode caps; see mounts.py); the episode's cgroup is created (cgroup.py, when the machine
   has the layer); the launcher starts `python3 child.pyc FD LIMITS` with a socketpair end as FD, and the
   whole process tree is moved into the cgroup before the host sends `init` (until then the child runs
   no untrusted code);
2. the host queues an `init` message (task, seed, host tool specs, file paths) and then serves the
   child's requests over the socket, recording every ModelCall the callback returns, while draining
   stdout/stderr (capped) from the same poll loop: one thread per episode, no helper threads;
3. the first final message (`result` or `error`) ends the episode; so do the wall-clock deadline, a
   broken limit or protocol rule, or the child's death;
4. teardown kills whatever is left: in bwrap mode SIGKILL goes to the sandbox's pid-namespace init
   through a pidfd; bwrap exits, and once the init is reaped every process of the namespace is gone (an
   init reaps its whole namespace before it exits). bwrap's outer process may exit without reaping the
   init (it returns as soon as the init reports the exit status through an eventfd), so a process that
   runs episodes becomes a child subreaper (`become_subreaper`) and reaps the orphaned init itself: the
   slot's uid is then known free without scanning /proc.

The channel is docs/contracts.md's, with two additions: the host's first message is
`{"type": "init", ...}`, and the child's first is `{"type": "hello"}`, sent by child.py after the
rlimits and the domain's tools module and right before the harness is loaded. A child that dies
without saying hello is a sandbox_setup_error, and so is an `error` of kind "setup" (tools module or
rlimits failed) before hello; no harness can fake either. After hello an `error` message carries
`kind` "exception" (harness_exception), "memory" (memory_limit) or "protocol" (run() returned a
non-str: protocol_error). Its events are kept, plus one {"type": "error_traceback", "traceback": ...}
event with the harness's traceback for whoever reads the trace.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import marshal
import math
import os
import select
import shutil
import signal
import socket
import subprocess
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from whale_ray.records import EpisodeResult, ModelCall, SamplingParams
from whale_ray.sandbox import isolation
from whale_ray.sandbox.cgroup import EpisodeCgroup, cgroup_layer
from whale_ray.sandbox.frames import (
    BadFrame,
    check_messages,
    decode_frame,
    encode_frame,
    is_int,
    parse_sampling,
    utf8_ok,
)
from whale_ray.sandbox.limits import FSIZE_BYTES, NOFILE, SandboxLimits
from whale_ray.sandbox.mounts import EpisodeMounts
from whale_ray.sandbox.uid_pool import UID_POOL

GenerateFn = Callable[[list[dict], SamplingParams], ModelCall]

RUNTIME_DIR = ".whale"  # inside the episode directory: child.py and tools.py
_STDERR_TAIL = 4096
_EXIT_GRACE_S = 1.0  # the channel closed without a result: how long to wait for the child's exit status
_REAP_TIMEOUT_S = 5.0
_BWRAP_PIDS = 3  # bwrap, its pid-namespace init and child.py, on top of the harness's max_processes
_MAX_REASON = 500
MAX_ERROR_REASON = 4000  # sandbox_error reasons carry a traceback
_CHILD_SOURCE = Path(__file__).with_name("child.py").read_bytes()


def _compile_child() -> tuple[str, bytes]:
    """child.py as a .pyc for the sandbox's interpreter (the host's own base interpreter)."""
    try:
        code = compile(_CHILD_SOURCE, "child.py", "exec", dont_inherit=True)
        header = importlib.util.MAGIC_NUMBER + bytes(8) + (len(_CHILD_SOURCE) & 0xFFFFFFFF).to_bytes(4, "little")
        return "child.pyc", header + marshal.dumps(code)
    except Exception:  # pragma: no cover - fall back to the source
        return "child.py", _CHILD_SOURCE


CHILD_NAME, CHILD_BYTES = _compile_child()  # also bound into the agent-cli jail (jail.py)


def episode_result(status: str, reason: str, t0: float, answer: str | None = None,
                   calls: list[ModelCall] | None = None, events: list[dict[str, Any]] | None = None) -> EpisodeResult:
    if status == "sandbox_error":  # a host bug: keep the end of its traceback, where the failure is
        if len(reason) > MAX_ERROR_REASON:
            reason = "..." + reason[-(MAX_ERROR_REASON - 3):]
    elif len(reason) > _MAX_REASON:
        reason = reason[: _MAX_REASON - 3] + "..."
    return EpisodeResult(status=status, reason=reason, answer=answer, calls=list(calls or []),
                         events=list(events or []), wall_s=time.monotonic() - t0)


def _call_seed(episode_seed: int, index: int) -> int:
    digest = hashlib.blake2b(f"{episode_seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def _invoke(fn: Callable[..., Any], args: dict[str, Any]) -> Any:
    return fn(**args)


def _raised_by_call(e: BaseException) -> bool:
    """True when a TypeError came from binding the arguments in `_invoke`, not from inside the tool."""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_code is _invoke.__code__


_PR_SET_CHILD_SUBREAPER = 36


def become_subreaper(on: bool = True) -> bool:
    """Makes this process the reaper of its orphaned descendants, so that the teardown can reap each
    sandbox's pid-namespace init (see the module docstring, step 4); without it the orphan goes to the
    host's pid 1, a zombie under the slot's uid until pid 1 gets to it. Process-wide: for processes that
    run episodes (the SandboxEvaluator actor), not for one whose other children may leave daemons behind.
    `on=False` undoes it (a benchmark compares both). False where prctl refuses."""
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


_SETPRIV = shutil.which("setpriv")
# Run as root: write our own pid to each cgroup.procs given before "--", then exec the rest (setpriv, bwrap).
_ENTER = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 126; shift; done; shift; exec "$@"'


def _enter_cgroup_first(launch: isolation.Launch, cg: EpisodeCgroup) -> bool:
    """Where the launch drops to a slot uid and util-linux setpriv is there: start it as root through a shell
    that enters the episode's cgroup and then becomes setpriv -> bwrap (one pid throughout). bwrap then
    starts inside the cgroup: its cgroup namespace has the episode's cgroup as its root (the sandbox's
    /proc/self/cgroup shows "/", no host path), and no /proc scan is needed. False: use add_tree."""
    if _SETPRIV is None or launch.user is None:
        return False
    launch.argv = ["/bin/sh", "-c", _ENTER, "sh", *cg.procs_files(), "--", _SETPRIV, f"--reuid={launch.user}",
                   f"--regid={launch.group}", "--clear-groups", "--", *launch.argv]
    launch.user = launch.group = launch.extra_groups = None
    return True


class _Done(Exception):
    """Ends the serve loop."""


_ERROR_KINDS = {"exception": "harness_exception", "memory": "memory_limit", "protocol": "protocol_error"}


class Episode:
    def __init__(self, launcher: Any, limits: SandboxLimits, generate: GenerateFn,
                 host_tools: dict[str, Callable[..., str]], seed: int, t0: float):
        self.launcher = launcher
        self.limits = limits
        self.generate = generate
        self.host_tools = host_tools
        self.seed = seed
        self.t0 = t0
        self.calls: list[ModelCall] = []
        self.tool_calls: list[dict[str, Any]] = []
        self.outcome: tuple[str, str, str | None, list[dict[str, Any]]] | None = None
        self.host_error: BaseException | None = None
        self.rpc_calls = 0
        self.got_hello = False  # child.py says hello before any harness code runs
        # where the episode's time went (EpisodeResult.timings): until the hello, in host callbacks, tearing down
        self.timings = {"start": 0.0, "model": 0.0, "tools": 0.0, "teardown": 0.0}
        self.output_bytes = 0
        self.stderr_tail = bytearray()
        self.proc: subprocess.Popen | None = None
        self.proc_pidfd: int | None = None
        self.inner_pidfd: int | None = None  # the sandbox's pid-namespace init (bwrap mode)
        self.deadline = 0.0
        self.partial_frame = False  # the channel ended with an incomplete frame in the buffer
        self.cgroup: EpisodeCgroup | None = None
        self.emptied = False  # every process of the sandbox is known reaped (teardown)

    # -- lifecycle
    def run(self, harness_name: str, harness: bytes, tools: bytes | None, init: dict[str, Any]) -> EpisodeResult:
        self.uid = None
        if isinstance(self.launcher, isolation.BwrapLauncher) and isolation.running_as_root():
            try:
                self.uid = UID_POOL.acquire()
            except RuntimeError as e:
                return episode_result("sandbox_setup_error", str(e), self.t0)
        layer = cgroup_layer()
        try:
            if layer is not None:
                try:
                    self.cgroup = layer.create(self.limits.memory_mb << 20, self.limits.max_processes + _BWRAP_PIDS)
                except OSError as e:
                    return episode_result("sandbox_setup_error", f"cannot create the episode's cgroup: {e}", self.t0)
            try:
                mounts = EpisodeMounts(self.uid, tmpfs=isinstance(self.launcher, isolation.BwrapLauncher))
            except OSError as e:
                return episode_result("sandbox_setup_error", f"cannot create the episode directory: {e}", self.t0)
            try:
                return self._run_in(mounts, harness_name, harness, tools, init)
            finally:
                mounts.close()
        finally:
            if self.cgroup is not None:
                self.cgroup.remove()  # kills anything still in it first
            if self.uid is not None:
                UID_POOL.release(self.uid, reap=not self.emptied)

    def _run_in(self, mounts: EpisodeMounts, harness_name: str, harness: bytes, tools: bytes | None,
                init: dict[str, Any]) -> EpisodeResult:
        launcher = self.launcher
        namespaced = isinstance(launcher, isolation.BwrapLauncher)
        episode_dir = mounts.files
        files, home = launcher.inside(episode_dir)
        try:
            os.chmod(episode_dir, 0o755)  # readable (not writable) by the sandbox's uid
            rt = os.path.join(episode_dir, RUNTIME_DIR)
            os.mkdir(rt, 0o755)
            with open(os.path.join(rt, CHILD_NAME), "wb") as f:
                f.write(CHILD_BYTES)
            if tools is not None:
                with open(os.path.join(rt, "tools.py"), "wb") as f:
                    f.write(tools)
            with open(os.path.join(episode_dir, harness_name), "wb") as f:
                f.write(harness)
        except OSError as e:
            return episode_result("sandbox_setup_error", f"cannot prepare the episode directory: {e}", self.t0)
        init = dict(init, harness_file=f"{files}/{harness_name}",
                    tools_path=f"{files}/{RUNTIME_DIR}/tools.py" if tools is not None else None)
        lim = self.limits
        rlimits = {"as": lim.memory_mb << 20, "cpu": max(1, math.ceil(lim.cpu_limit_s)), "nproc": lim.max_processes,
                   "fsize": FSIZE_BYTES, "nofile": NOFILE, "harden": launcher.layers()}

        host_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        info_r = info_w = None
        try:
            if namespaced:
                info_r, info_w = os.pipe()
            child_fd = child_sock.fileno()
            child_argv = [f"{files}/{RUNTIME_DIR}/{CHILD_NAME}", str(child_fd), json.dumps(rlimits)]
            env = isolation.sandbox_env(self.seed, home, launcher.python_exe)
            extra = {"binds": mounts.binds} if mounts.binds is not None else {}
            launch = launcher.command(episode_dir=episode_dir, child_argv=child_argv, env=env, pass_fds=(child_fd,),
                                      info_fd=info_w, uid=self.uid, **extra)
            entered = self.cgroup is not None and _enter_cgroup_first(launch, self.cgroup)
            self.deadline = time.monotonic() + lim.wall_s
            try:
                self.proc = subprocess.Popen(
                    launch.argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                    env=launch.env, cwd=launch.cwd, pass_fds=launch.pass_fds, close_fds=True,
                    start_new_session=True, user=launch.user, group=launch.group,
                    extra_groups=launch.extra_groups,
                )
            except (OSError, subprocess.SubprocessError) as e:
                return episode_result("sandbox_setup_error", f"cannot start the sandbox: {type(e).__name__}: {e}",
                                      self.t0)
            finally:
                child_sock.close()
                if info_w is not None:
                    os.close(info_w)
                    info_w = None
            try:
                self.proc_pidfd = os.pidfd_open(self.proc.pid)
            except (AttributeError, OSError):
                self.proc_pidfd = None
            if self.cgroup is not None and not entered:
                # Before `init` is sent: until it arrives the child runs no untrusted code.
                try:
                    self.cgroup.add_tree(self.proc.pid)
                except OSError as e:
                    self._teardown(namespaced)
                    return episode_result("sandbox_setup_error", f"cannot move the sandbox into its cgroup: {e}",
                                          self.t0)
            try:
                self._serve(host_sock, info_r, encode_frame(init))
            finally:
                ended = time.monotonic()
                self._teardown(namespaced)
                self.timings["teardown"] = time.monotonic() - ended
        finally:
            host_sock.close()
            child_sock.close()
            for fd in (info_r, info_w, self.proc_pidfd, self.inner_pidfd):
                if fd is not None:
                    try:
                        os.close(fd)
                    except OSError:
                        pass
        if self.host_error is not None:
            raise self.host_error
        result = self._finish(namespaced)
        result.tool_calls = self.tool_calls
        result.timings = {k: round(v, 6) for k, v in self.timings.items()}
        if self.cgroup is not None:
            result.peak_memory_bytes = self.cgroup.peak_bytes()
        return result

    def _finish(self, namespaced: bool) -> EpisodeResult:
        if self.outcome is not None:
            status, reason, answer, events = self.outcome
            return episode_result(status, reason, self.t0, answer, self.calls, events)
        # The child died (or closed the channel) without a final message.
        rc = self.proc.returncode if self.proc is not None else None
        tail = self.stderr_tail.decode("utf-8", "replace").strip()
        last = tail.splitlines()[-1] if tail else ""
        detail = f" ({last[:200]})" if last else ""
        if self.cgroup is not None and self.cgroup.oom_killed():
            # The kernel's count (shared memory, tmpfs pages and kernel memory included) hit the limit.
            return episode_result("memory_limit",
                                  f"the episode's memory reached its limit of {self.limits.memory_mb} MB "
                                  "(cgroup; the kernel's OOM killer ended it)", self.t0, calls=self.calls)
        if not self.got_hello:
            # No harness code ran: bwrap or the interpreter failed to start.
            return episode_result("sandbox_setup_error", f"the sandbox did not start (exit code {rc}){detail}", self.t0)
        sig = None
        if rc is not None and rc < 0:
            sig = -rc
        elif rc is not None and namespaced and rc > 128:
            sig = rc - 128  # bwrap reports a child killed by signal N as exit code 128 + N
        if "MemoryError" in tail or "Cannot allocate memory" in tail or "out of memory" in tail.lower():
            return episode_result("memory_limit",
                                  f"the child ran out of memory (limit {self.limits.memory_mb} MB){detail}",
                                  self.t0, calls=self.calls)
        if sig == signal.SIGXCPU:
            return episode_result("timeout", f"CPU time limit of {math.ceil(self.limits.cpu_limit_s)} s exceeded",
                                  self.t0, calls=self.calls)
        sandbox_s = self.limits.wall_s - (self.deadline - time.monotonic())
        if sig == signal.SIGKILL and sandbox_s >= math.ceil(self.limits.cpu_limit_s):
            # SIGXCPU ignored: the kernel's SIGKILL at the hard RLIMIT_CPU (one second later).
            return episode_result("timeout", f"CPU time limit of {math.ceil(self.limits.cpu_limit_s)} s exceeded "
                                  "(killed at the hard limit)", self.t0, calls=self.calls)
        if sig is not None:
            return episode_result("crashed", f"the child was killed by {_signal_name(sig)} without a result{detail}",
                                  self.t0, calls=self.calls)
        if self.partial_frame:
            return episode_result("protocol_error", f"the child exited with code {rc} in the middle of an RPC message",
                                  self.t0, calls=self.calls)
        return episode_result("crashed", f"the child exited with code {rc} without a result{detail}", self.t0,
                              calls=self.calls)

    def _set(self, status: str, reason: str, answer: str | None = None,
             events: list[dict[str, Any]] | None = None) -> None:
        if self.outcome is None:
            self.outcome = (status, reason, answer, events or [])
        raise _Done

    # -- the poll loop
    def _serve(self, sock: socket.socket, info_r: int | None, init_frame: bytes) -> None:
        proc = self.proc
        assert proc is not None and proc.stdout is not None and proc.stderr is not None
        sock.setblocking(False)
        sfd, ofd, efd = sock.fileno(), proc.stdout.fileno(), proc.stderr.fileno()
        poller = select.poll()
        IN = select.POLLIN | select.POLLHUP | select.POLLERR
        poller.register(ofd, IN)
        poller.register(efd, IN)
        if info_r is not None:
            poller.register(info_r, IN)
        if self.proc_pidfd is not None:
            poller.register(self.proc_pidfd, select.POLLIN)
        out = bytearray(init_frame)
        poller.register(sfd, IN | select.POLLOUT)
        inbuf = bytearray()
        info = bytearray()
        sock_eof = exited = False
        eof_deadline = None
        try:
            while True:
                now = time.monotonic()
                if now >= self.deadline:
                    self._set("timeout", f"wall-clock limit of {self.limits.wall_s:g} s exceeded")
                wait = self.deadline - now
                if sock_eof:
                    if exited or (self.proc_pidfd is None and proc.poll() is not None):
                        return
                    if eof_deadline is None:
                        eof_deadline = now + _EXIT_GRACE_S
                    if now >= eof_deadline:
                        self._set("protocol_error", "the child closed the RPC channel without sending a result")
                    wait = min(wait, eof_deadline - now, 0.05 if self.proc_pidfd is None else wait)
                elif exited:
                    # The process is gone; whatever it sent is in the socket buffer.
                    if eof_deadline is None:
                        eof_deadline = now + _EXIT_GRACE_S
                    if now >= eof_deadline:
                        return
                    wait = min(wait, eof_deadline - now)
                for fd, ev in poller.poll(max(0.0, wait) * 1000.0):
                    if fd == sfd:
                        if ev & select.POLLOUT and out:
                            try:
                                n = sock.send(out)
                                del out[:n]
                            except BlockingIOError:
                                pass
                            except OSError:
                                out.clear()
                        if ev & (select.POLLIN | select.POLLHUP | select.POLLERR):
                            try:
                                data = sock.recv(1 << 16)
                            except BlockingIOError:
                                data = None
                            except OSError:
                                data = b""
                            if data == b"":
                                sock_eof = True
                                poller.unregister(sfd)
                            elif data:
                                inbuf += data
                                self.receive(inbuf, out)
                        if not sock_eof:
                            poller.modify(sfd, IN | (select.POLLOUT if out else 0))
                    elif fd in (ofd, efd):
                        data = os.read(fd, 1 << 16)
                        if not data:
                            poller.unregister(fd)
                            continue
                        self.output_bytes += len(data)
                        if fd == efd:
                            self.stderr_tail += data
                            del self.stderr_tail[:-_STDERR_TAIL]
                        if self.output_bytes > self.limits.max_output_bytes:
                            self._set("output_limit",
                                      f"the harness wrote more than {self.limits.max_output_bytes} bytes to stdout/stderr")
                    elif fd == info_r:
                        data = os.read(fd, 4096)
                        if not data:
                            poller.unregister(fd)
                            continue
                        info += data
                        self._take_info(info)
                    elif fd == self.proc_pidfd:
                        exited = True
                        poller.unregister(fd)
        except _Done:
            return
        finally:
            self.partial_frame = bool(inbuf)

    def _take_info(self, info: bytearray) -> None:
        if self.inner_pidfd is not None:
            return
        try:
            pid = json.loads(info.decode("utf-8"))["child-pid"]
        except (ValueError, KeyError, TypeError):
            return  # not complete yet
        try:
            fd = os.pidfd_open(int(pid))
        except (AttributeError, OSError, ValueError):
            return
        self.inner_pidfd = fd

    def _parse(self, inbuf: bytearray, out: bytearray) -> None:
        cap = self.limits.max_message_bytes
        while len(inbuf) >= 4:
            n = int.from_bytes(inbuf[:4], "big")
            if n > cap:
                self._set("output_limit", f"an RPC message of {n} bytes exceeds the {cap}-byte cap")
            if len(inbuf) < 4 + n:
                return
            payload = bytes(inbuf[4 : 4 + n])
            del inbuf[: 4 + n]
            try:
                msg = decode_frame(payload)
            except BadFrame as e:
                self._set("protocol_error", str(e))
            reply = self._handle(msg)
            if reply is not None:
                out += encode_frame(reply)

    def receive(self, inbuf: bytearray, out: bytearray) -> None:
        """Answer every complete frame in `inbuf` (replies appended to `out`); raises _Done when the episode
        is decided. Defence in depth: a host-side failure on any frame ends the episode as sandbox_error
        with the traceback, never as an exception out of run_episode."""
        try:
            self._parse(inbuf, out)
        except _Done:
            raise
        except Exception:
            self._set("sandbox_error", "the host failed on an RPC message: " + traceback.format_exc(limit=-4))

    # -- messages
    def _handle(self, msg: dict[str, Any]) -> dict[str, Any] | None:
        kind = msg["type"]
        if not self.got_hello:
            if kind == "error" and msg.get("kind") == "setup" and isinstance(msg.get("error"), str):
                self._set("sandbox_setup_error", msg["error"])
            if kind != "hello":
                self._set("protocol_error", f"the child's first message was {kind[:40]!r}, not 'hello'")
            self.got_hello = True
            self.timings["start"] = time.monotonic() - self.t0
            return None
        if kind in ("generate", "tool"):
            self.rpc_calls += 1
            if self.rpc_calls > self.limits.max_rpc_calls:
                self._set("output_limit", f"more than {self.limits.max_rpc_calls} RPC calls (generate and tool)")
            rid = msg.get("id")
            if not is_int(rid):
                self._set("protocol_error", f"a {kind} request without an integer id")
            return self._generate(rid, msg) if kind == "generate" else self._tool(rid, msg)
        if kind == "result":
            answer, events = msg.get("answer"), msg.get("events", [])
            if answer is not None and not isinstance(answer, str):
                self._set("protocol_error", f"run() returned {type(answer).__name__}, expected str or None")
            if answer is not None and not utf8_ok(answer):
                self._set("protocol_error", "the answer is not valid Unicode text")
            self._set("ok", "ok", answer, self._events(events))
        if kind == "error":
            err, tb, ekind = msg.get("error"), msg.get("traceback", ""), msg.get("kind")
            status = _ERROR_KINDS.get(ekind) if isinstance(ekind, str) else None  # "setup" only before hello
            if status is None or not isinstance(err, str) or not isinstance(tb, str):
                self._set("protocol_error", "the child sent a malformed error message")
            if status == "memory_limit" and "limit" not in err:
                err = f"{err} (memory limit {self.limits.memory_mb} MB)"
            events = self._events(msg.get("events", []))
            if tb and utf8_ok(tb):
                events.append({"type": "error_traceback", "traceback": tb})
            self._set(status, err, None, events)
        self._set("protocol_error", f"the child sent an unknown RPC message type {kind[:40]!r}")
        return None

    def _events(self, events: Any) -> list[dict[str, Any]]:
        if not isinstance(events, list) or not all(isinstance(e, dict) and isinstance(e.get("type"), str)
                                                   for e in events):
            self._set("protocol_error", "the trace events are malformed")
        return events  # decode_frame made them re-encodable: valid text, finite numbers, bounded depth

    def _call_host(self, kind: str, fn: Callable[[], Any]) -> Any:
        """Run a host callback with the sandbox's clock stopped; its time goes to timings[kind]."""
        start = time.monotonic()
        try:
            return fn()
        finally:
            spent = time.monotonic() - start
            self.deadline += spent
            self.timings[kind] += spent

    def _generate(self, rid: int, msg: dict[str, Any]) -> dict[str, Any]:
        messages = msg.get("messages")
        problem = check_messages(messages)
        if problem:
            self._set("protocol_error", problem)
        sp = parse_sampling(msg.get("sampling"))
        if isinstance(sp, str):
            self._set("protocol_error", sp)
        # Each call samples from its own stream, a function of the episode seed and the call's index: an
        # episode replays exactly whatever else shares the policy's batch.
        sp.seed = _call_seed(self.seed, len(self.calls))
        try:
            call = self._call_host("model", lambda: self.generate(messages, sp))
        except BaseException as e:  # the caller's failure, not the harness's: re-raised after teardown
            self.host_error = e
            self._set("crashed", f"the host's generate callback raised {type(e).__name__}")
        self.calls.append(call)
        return {"type": "generate_result", "id": rid, "text": call.text, "finish_reason": call.finish_reason}

    def _tool(self, rid: int, msg: dict[str, Any]) -> dict[str, Any]:
        name, args = msg.get("name"), msg.get("args")
        if not isinstance(name, str) or not isinstance(args, dict):
            self._set("protocol_error", "a tool request needs a str name and a dict of args")
        fn = self.host_tools.get(name)
        if fn is None:
            return self._tool_error(rid, name, args, f"unknown tool {name[:80]!r}")
        try:
            output = self._call_host("tools", lambda: _invoke(fn, args))
        except TypeError as e:
            if _raised_by_call(e):
                return self._tool_error(rid, name, args, f"bad arguments for tool {name!r}: {e}")
            return self._tool_error(rid, name, args, f"tool {name!r} raised TypeError: {e}")
        except Exception as e:
            return self._tool_error(rid, name, args, f"tool {name!r} raised {type(e).__name__}: {e}")
        output = output if isinstance(output, str) else str(output)
        self.tool_calls.append({"name": name, "args": args, "output": output})
        return {"type": "tool_result", "id": rid, "output": output}

    def _tool_error(self, rid: int, name: str, args: dict[str, Any], message: str) -> dict[str, Any]:
        self.tool_calls.append({"name": name[:80], "args": args, "error": message})
        return {"type": "rpc_error", "id": rid, "message": message}

    # -- teardown
    def _teardown(self, namespaced: bool) -> None:
        proc = self.proc
        if proc is None:
            return
        try:
            if namespaced:
                if self.inner_pidfd is not None:
                    try:
                        signal.pidfd_send_signal(self.inner_pidfd, signal.SIGKILL)
                    except OSError:
                        pass
                if self.inner_pidfd is None or not self._wait(proc, 2.0):
                    # No pidfd of the namespace's init: killing bwrap makes the kernel kill its init
                    # (--die-with-parent), which takes the whole pid namespace with it.
                    self._kill_pid(proc)
            else:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # before reaping: the group id cannot be reused yet
                except OSError:
                    pass
            if not self._wait(proc, _REAP_TIMEOUT_S):
                self._kill_pid(proc)
                self._wait(proc, _REAP_TIMEOUT_S)
            self.emptied = namespaced and proc.returncode is not None and self._init_gone()
            if self.outcome is None and proc.stderr is not None:
                self._drain_stderr(proc.stderr.fileno())
        finally:
            for f in (proc.stdout, proc.stderr):
                if f is not None:
                    f.close()

    def _init_gone(self) -> bool:
        """True once the sandbox's pid-namespace init is reaped: by bwrap, or here when it came to this
        process as an orphan (become_subreaper). False when it is someone else's zombie, or still alive."""
        fd = self.inner_pidfd
        if fd is None:
            return False
        poller = select.poll()  # as the serve loop: select() refuses descriptors past FD_SETSIZE
        poller.register(fd, select.POLLIN)
        if not poller.poll(_REAP_TIMEOUT_S * 1000):  # a pidfd reads once its process exited
            return False
        try:
            os.waitid(os.P_PIDFD, fd, os.WEXITED | os.WNOHANG)
            return True
        except ChildProcessError:  # not this process's child: reaped already, or an orphan of the host's pid 1
            try:
                signal.pidfd_send_signal(fd, 0)
            except ProcessLookupError:
                return True
            return False
        except OSError:
            return False

    def _drain_stderr(self, fd: int) -> None:
        """The last words of a child that died without a result (for the crash reason)."""
        os.set_blocking(fd, False)
        for _ in range(16):
            try:
                data = os.read(fd, 1 << 16)
            except OSError:
                return
            if not data:
                return
            self.stderr_tail += data
            del self.stderr_tail[:-_STDERR_TAIL]

    @staticmethod
    def _kill_pid(proc: subprocess.Popen) -> None:
        try:
            proc.kill()
        except OSError:
            pass

    @staticmethod
    def _wait(proc: subprocess.Popen, timeout: float) -> bool:
        try:
            proc.wait(timeout=timeout)
            return True
        except subprocess.TimeoutExpired:
            return False
