"""The sandbox side of one episode: loads the untrusted harness and serves it the `agent` handle.

STANDARD LIBRARY ONLY. This file is copied into the sandbox, which has no site-packages and cannot
import whale_ray. It is started by whale_ray/sandbox/episode.py as

    python3 -P -s -S child.pyc RPC_FD LIMITS_JSON

(the host compiles this file once per process and ships the bytecode, which saves the compile in every
episode; the interpreter is the host's own, so the bytecode always matches), with RPC_FD an inherited
Unix stream socket to the trusted host. Everything it says to the host goes
over that socket as frames (4-byte big-endian length, then UTF-8 JSON); stdout and stderr belong to the
harness and are only captured (and capped) by the host.

Order of events: apply the resource limits, read the host's `init` message, apply the Landlock rules
and the seccomp filter the host asked for (LIMITS_JSON["harden"]), load the domain tools
module (trusted), say `hello`, load the harness (untrusted), call `run(task, agent)`, send exactly one
final `result` or `error` message, and `os._exit`. The host re-validates every message: the harness runs in this very
process and can write to the socket itself, so nothing here is a security boundary, only a courtesy
that turns honest mistakes into clear errors inside the harness.
"""

import _thread
import json
import os
import sys

_MAX_REASON = 300
_MAX_TRACEBACK = 8000


# ----------------------------------------------------------------------------------------- limits
def _apply_limits(limits):
    """Lower this process's rlimits before any untrusted code runs; they are inherited by its children."""
    import resource

    def lower(res, value):
        hard = resource.getrlimit(res)[1]
        if hard != resource.RLIM_INFINITY and value > hard:
            value = hard
        resource.setrlimit(res, (value, value))

    lower(resource.RLIMIT_CORE, 0)
    if limits.get("as"):
        lower(resource.RLIMIT_AS, int(limits["as"]))
    if limits.get("fsize"):
        lower(resource.RLIMIT_FSIZE, int(limits["fsize"]))
    if limits.get("nofile"):
        lower(resource.RLIMIT_NOFILE, int(limits["nofile"]))
    if limits.get("nproc"):
        lower(resource.RLIMIT_NPROC, int(limits["nproc"]))
    if limits.get("cpu"):
        cpu = int(limits["cpu"])
        hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
        if hard == resource.RLIM_INFINITY or cpu + 1 <= hard:
            # SIGXCPU at the soft limit (the host reports a timeout), SIGKILL one second later.
            resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        else:
            lower(resource.RLIMIT_CPU, cpu)


# ------------------------------------------------------------------------------ seccomp and Landlock
# Applied by child.py to itself (inherited by everything the harness and the domain tools start), after
# the rlimits and before the domain tools module and the harness load. x86_64 only: elsewhere the
# seccomp layer is reported as unavailable (the host's doctor says so) rather than half-applied.
_AUDIT_ARCH_X86_64 = 0xC000003E
_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_SECCOMP = 22
_SECCOMP_MODE_FILTER = 2
_RET_KILL_PROCESS = 0x80000000
_RET_ERRNO = 0x00050000
_RET_ALLOW = 0x7FFF0000
_EPERM, _ENOSYS = 1, 38
_LD_W_ABS, _JEQ_K, _JGE_K, _JSET_K, _RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
_AF_UNIX = 1
_TIOCSTI, _TIOCLINUX = 0x5412, 0x541C
_CLONE_NS_FLAGS = 0x7E020000  # NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET
_SYS_SOCKET, _SYS_IOCTL, _SYS_CLONE, _SYS_CLONE3 = 41, 16, 56, 435
# Denied outright with EPERM (x86_64 numbers).
_DENY = {
    "ptrace": 101, "unshare": 272, "setns": 308, "mount": 165, "umount2": 166, "pivot_root": 155,
    "chroot": 161, "bpf": 321, "perf_event_open": 298, "keyctl": 250, "add_key": 248, "request_key": 249,
    "kexec_load": 246, "kexec_file_load": 320, "init_module": 175, "finit_module": 313, "delete_module": 176,
    "process_vm_readv": 310, "process_vm_writev": 311, "userfaultfd": 323, "io_uring_setup": 425,
    "io_uring_enter": 426, "io_uring_register": 427, "open_tree": 428, "move_mount": 429, "fsopen": 430,
    "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442, "pidfd_getfd": 438, "acct": 163,
    "swapon": 167, "swapoff": 168, "reboot": 169, "settimeofday": 164, "clock_settime": 227,
    "name_to_handle_at": 303, "open_by_handle_at": 304, "lookup_dcookie": 212, "vhangup": 153,
}


def _seccomp_program(families=(_AF_UNIX,)):
    """The classic BPF filter, as bytes of struct sock_filter {u16 code; u8 jt; u8 jf; u32 k}; socket() is
    allowed for the address `families` only (a harness: AF_UNIX; a jailed agent with network: + IP, netlink)."""
    import struct

    def op(code, k, jt=0, jf=0):
        return struct.pack("=HBBI", code, jt, jf, k)

    nr, arch, arg0, arg1 = 0, 4, 16, 24  # offsets in struct seccomp_data (low 32 bits of the args)
    eperm, allow = _RET_ERRNO | _EPERM, _RET_ALLOW
    p = [
        op(_LD_W_ABS, arch), op(_JEQ_K, _AUDIT_ARCH_X86_64, 1, 0), op(_RET_K, _RET_KILL_PROCESS),
        op(_LD_W_ABS, nr), op(_JGE_K, 0x40000000, 0, 1), op(_RET_K, _RET_KILL_PROCESS),  # x32 ABI
    ]
    for number in sorted(set(_DENY.values())):
        p += [op(_JEQ_K, number, 0, 1), op(_RET_K, eperm)]
    # clone3 passes its flags in memory that BPF cannot read: ENOSYS makes libc fall back to clone.
    p += [op(_JEQ_K, _SYS_CLONE3, 0, 1), op(_RET_K, _RET_ERRNO | _ENOSYS)]
    # socket(): the allowed families only.
    fams = sorted(set(families))
    p += [op(_JEQ_K, _SYS_SOCKET, 0, 2 + len(fams) + 1), op(_LD_W_ABS, arg0)]
    p += [op(_JEQ_K, f, len(fams) - i, 0) for i, f in enumerate(fams)]
    p += [op(_RET_K, eperm), op(_RET_K, allow)]
    # ioctl(): no TIOCSTI / TIOCLINUX (terminal injection).
    p += [op(_JEQ_K, _SYS_IOCTL, 0, 5), op(_LD_W_ABS, arg1), op(_JEQ_K, _TIOCSTI, 2, 0),
          op(_JEQ_K, _TIOCLINUX, 1, 0), op(_RET_K, allow), op(_RET_K, eperm)]
    # clone(): no new namespaces.
    p += [op(_JEQ_K, _SYS_CLONE, 0, 4), op(_LD_W_ABS, arg0), op(_JSET_K, _CLONE_NS_FLAGS, 1, 0),
          op(_RET_K, allow), op(_RET_K, eperm)]
    p.append(op(_RET_K, allow))
    return b"".join(p)


def _libc():
    import ctypes

    return ctypes, ctypes.CDLL(None, use_errno=True)


def _prctl(ctypes, libc, *args):
    ul = ctypes.c_ulong
    r = libc.prctl(ctypes.c_int(args[0]), *[a if not isinstance(a, int) else ul(a) for a in args[1:]])
    if r != 0:
        e = ctypes.get_errno()
        raise OSError(e, "prctl(%d): %s" % (args[0], os.strerror(e)))


def _install_seccomp(families=(_AF_UNIX,)):
    import platform

    if platform.machine() != "x86_64":
        return False
    ctypes, libc = _libc()
    prog = _seccomp_program(families)
    buf = ctypes.create_string_buffer(prog, len(prog))

    class _SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    fprog = _SockFprog(len(prog) // 8, ctypes.addressof(buf))
    _prctl(ctypes, libc, _PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    _prctl(ctypes, libc, _PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0)
    return True


_LL_CREATE, _LL_ADD_RULE, _LL_RESTRICT = 444, 445, 446  # the same on every architecture
_LL_FS_EXECUTE, _LL_FS_WRITE_FILE, _LL_FS_READ_FILE, _LL_FS_READ_DIR = 1, 2, 4, 8
_LL_FS_REFER, _LL_FS_TRUNCATE, _LL_FS_IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15


def landlock_abi():
    """The kernel's Landlock ABI version, or 0 when Landlock is unavailable/disabled."""
    try:
        ctypes, libc = _libc()
        r = libc.syscall(ctypes.c_long(_LL_CREATE), None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    except Exception:
        return 0
    return r if r > 0 else 0


def _install_landlock(cfg):
    """Writes only under cfg["rw"] (and device files under cfg["dev"]), reads under cfg["ro"]; on
    ABI >= 4 no TCP bind/connect, on ABI >= 6 no signals or abstract Unix sockets outside the sandbox's
    own Landlock domain. Returns the ABI used (0: unavailable, nothing applied)."""
    import struct

    abi = landlock_abi()
    if abi < 1:
        return 0
    ctypes, libc = _libc()
    fs = (1 << 13) - 1  # ABI 1: EXECUTE .. MAKE_SYM
    if abi >= 2:
        fs |= _LL_FS_REFER
    if abi >= 3:
        fs |= _LL_FS_TRUNCATE
    if abi >= 5:
        fs |= _LL_FS_IOCTL_DEV
    net = 3 if abi >= 4 and not cfg.get("tcp") else 0  # BIND_TCP | CONNECT_TCP, no rule allowing any port
    scoped = 3 if abi >= 6 else 0  # ABSTRACT_UNIX_SOCKET | SIGNAL
    attr = struct.pack("=QQQ", fs, net, scoped)[: 8 if abi < 4 else 16 if abi < 6 else 24]
    abuf = ctypes.create_string_buffer(attr, len(attr))
    rfd = libc.syscall(ctypes.c_long(_LL_CREATE), abuf, ctypes.c_size_t(len(attr)), ctypes.c_uint32(0))
    if rfd < 0:
        e = ctypes.get_errno()
        raise OSError(e, "landlock_create_ruleset: " + os.strerror(e))
    try:
        read = _LL_FS_EXECUTE | _LL_FS_READ_FILE | _LL_FS_READ_DIR
        file_rights = _LL_FS_EXECUTE | _LL_FS_WRITE_FILE | _LL_FS_READ_FILE | _LL_FS_TRUNCATE | _LL_FS_IOCTL_DEV
        rules = [(p, read) for p in cfg.get("ro", ())]
        rules += [(p, fs) for p in cfg.get("rw", ())]
        rules += [(p, read | _LL_FS_WRITE_FILE | _LL_FS_IOCTL_DEV) for p in cfg.get("dev", ())]
        for path, rights in rules:
            try:
                pfd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue  # not mounted here: nothing to allow
            try:
                import stat

                if not stat.S_ISDIR(os.fstat(pfd).st_mode):
                    rights &= file_rights
                rule = ctypes.create_string_buffer(struct.pack("=Qi", rights & fs, pfd), 12)
                r = libc.syscall(ctypes.c_long(_LL_ADD_RULE), ctypes.c_int(rfd), ctypes.c_int(1), rule,
                                 ctypes.c_uint32(0))
                if r != 0:
                    e = ctypes.get_errno()
                    raise OSError(e, "landlock_add_rule(%s): %s" % (path, os.strerror(e)))
            finally:
                os.close(pfd)
        _prctl(ctypes, libc, _PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
        r = libc.syscall(ctypes.c_long(_LL_RESTRICT), ctypes.c_int(rfd), ctypes.c_uint32(0))
        if r != 0:
            e = ctypes.get_errno()
            raise OSError(e, "landlock_restrict_self: " + os.strerror(e))
    finally:
        os.close(rfd)
    return abi


def _harden(cfg):
    """Apply the layers the host asked for; returns what was applied (exposed as agent.sandbox)."""
    applied = {"seccomp": False, "landlock_abi": 0}
    if cfg.get("landlock"):
        applied["landlock_abi"] = _install_landlock(cfg["landlock"])
    if cfg.get("seccomp"):
        applied["seccomp"] = _install_seccomp(tuple(cfg.get("socket_families") or (_AF_UNIX,)))
    return applied


def exec_jailed(argv):
    """`child.pyc --exec GO_FD LAYERS_JSON -- COMMAND...`: a jailed command that is not a harness (the
    agent-cli proposer's coding agent). Waits for the host's go byte on GO_FD (the host moves the jail into
    its cgroup first), applies the Landlock/seccomp layers of LAYERS_JSON, and execs COMMAND: the layers
    stay on across exec (no_new_privs) for it and everything it starts."""
    go_fd, cfg, command = int(argv[0]), json.loads(argv[1]), argv[3:]
    if os.read(go_fd, 1) != b"1":
        os._exit(3)  # the host gave up on this jail
    os.closerange(3, 1 << 16)  # the go pipe, and any descriptor bwrap's --bind-fd sources left open
    if os.environ.get("LD_LIBRARY_PATH") == "/python/lib":
        del os.environ["LD_LIBRARY_PATH"]  # for this interpreter only (jail.py), not for the command
    try:
        _harden(cfg)
    except Exception as e:
        sys.stderr.write("jail: could not apply the seccomp/Landlock layers: %s: %s\n" % (type(e).__name__, e))
        os._exit(125)
    try:
        os.execvp(command[0], command)
    except OSError as e:
        sys.stderr.write("jail: cannot run %s: %s\n" % (command[0], e))
        os._exit(127)


# ---------------------------------------------------------------------------------------- channel
class _Channel:
    """Blocking framed JSON over the inherited socket fd (os.read/os.write: no socket module needed)."""

    def __init__(self, fd):
        self.fd = fd
        self.lock = _thread.allocate_lock()

    def send(self, obj):
        data = json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "replace")
        self.send_raw(data)

    def send_raw(self, data):
        buf = memoryview(len(data).to_bytes(4, "big") + data)
        while buf:
            n = os.write(self.fd, buf)
            buf = buf[n:]

    def _read_exact(self, n):
        chunks = []
        while n:
            chunk = os.read(self.fd, min(n, 1 << 20))
            if not chunk:
                raise EOFError("the host closed the RPC channel")
            chunks.append(chunk)
            n -= len(chunk)
        return b"".join(chunks)

    def recv(self):
        n = int.from_bytes(self._read_exact(4), "big")
        return json.loads(self._read_exact(n).decode("utf-8"))


class ToolError(Exception):
    """An unknown tool, bad arguments, or a tool that failed. The harness may catch it."""


class RPCError(RuntimeError):
    """The host refused a request."""


def _is_int(x):
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x and x not in (float("inf"), float("-inf"))


def _check_text(s, what):
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(what + " is not valid Unicode text (lone surrogate)") from None


# ------------------------------------------------------------------------------------------ agent
class Agent:
    """The handle a harness receives: the one way to reach the model, the tools and the trace."""

    ToolError = ToolError

    def __init__(self, channel, seed, local_tools, tool_specs, host_tools, max_trace_bytes):
        self._channel = channel
        self._local_tools = local_tools
        self._host_tools = host_tools
        self._events = []
        self._trace_bytes = 0
        self._max_trace_bytes = max_trace_bytes
        self._next_id = 0
        self.seed = seed
        self.tool_specs = tool_specs
        self.last_finish_reason = None

    def __repr__(self):
        return "<agent seed=%r tools=%r>" % (self.seed, sorted(self.tool_specs))

    # -- model
    def generate(self, messages, *, max_tokens=64, temperature=1.0, top_k=20, top_p=1.0, stop=None):
        """Call the policy model on a chat `messages` list; returns the completion text."""
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("agent.generate: messages must be a non-empty list of {'role', 'content'} dicts")
        clean = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or set(m) != {"role", "content"}:
                raise ValueError(
                    "agent.generate: messages[%d] must be a dict with exactly the keys 'role' and 'content', got %s"
                    % (i, _short(m))
                )
            role, content = m["role"], m["content"]
            if not isinstance(role, str) or not isinstance(content, str):
                raise ValueError(
                    "agent.generate: messages[%d]: 'role' and 'content' must be str, got %s and %s"
                    % (i, type(role).__name__, type(content).__name__)
                )
            _check_text(content, "agent.generate: messages[%d]['content']" % i)
            _check_text(role, "agent.generate: messages[%d]['role']" % i)
            clean.append({"role": role, "content": content})
        if not _is_int(max_tokens) or max_tokens < 1:
            raise ValueError("agent.generate: max_tokens must be a positive int, got %r" % (max_tokens,))
        if not _is_number(temperature) or temperature < 0:
            raise ValueError("agent.generate: temperature must be a number >= 0, got %r" % (temperature,))
        if not _is_int(top_k) or top_k < 0:
            raise ValueError("agent.generate: top_k must be an int >= 0, got %r" % (top_k,))
        if not _is_number(top_p) or not 0 < top_p <= 1:
            raise ValueError("agent.generate: top_p must be a number in (0, 1], got %r" % (top_p,))
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        elif isinstance(stop, (list, tuple)) and all(isinstance(s, str) for s in stop):
            stop = list(stop)
        else:
            raise ValueError("agent.generate: stop must be None, a str or a list of str, got %s" % _short(stop))
        for s in stop:
            _check_text(s, "agent.generate: stop")
        sampling = {"max_tokens": max_tokens, "temperature": float(temperature), "top_k": top_k,
                    "top_p": float(top_p), "stop": stop}
        reply = self._rpc({"type": "generate", "messages": clean, "sampling": sampling})
        if reply.get("type") != "generate_result":
            raise RPCError("agent.generate: " + str(reply.get("message", "the host refused the request")))
        self.last_finish_reason = reply.get("finish_reason")
        return reply.get("text", "")

    # -- tools
    def tool(self, name, **kwargs):
        """Call a domain tool by name; returns its observation string. Raises agent.ToolError."""
        if not isinstance(name, str):
            raise ToolError("agent.tool: the tool name must be a str, got %s" % type(name).__name__)
        fn = self._local_tools.get(name)
        if fn is not None:
            try:
                out = fn(**kwargs)
            except TypeError as e:
                if e.__traceback__ is not None and e.__traceback__.tb_next is None:
                    raise ToolError("bad arguments for tool %r: %s" % (name, e)) from None
                raise ToolError("tool %r raised TypeError: %s" % (name, e)) from e
            except (ToolError, MemoryError):
                raise
            except Exception as e:
                raise ToolError("tool %r raised %s: %s" % (name, type(e).__name__, e)) from e
            return out if isinstance(out, str) else str(out)
        if name not in self._host_tools:
            known = ", ".join(sorted(set(self._local_tools) | set(self._host_tools))) or "none"
            raise ToolError("unknown tool %r (available: %s)" % (name, known))
        try:
            json.dumps(kwargs)
        except (TypeError, ValueError) as e:
            raise ToolError("arguments of tool %r must be JSON-serialisable: %s" % (name, e)) from None
        reply = self._rpc({"type": "tool", "name": name, "args": kwargs})
        if reply.get("type") != "tool_result":
            raise ToolError(str(reply.get("message", "tool %r failed" % name)))
        out = reply.get("output", "")
        return out if isinstance(out, str) else str(out)

    # -- trace
    def log(self, type, **data):
        """Append an event {"type": type, **data} to the episode's trace. Must be JSON-serialisable."""
        if not isinstance(type, str):
            raise TypeError("agent.log: the event type must be a str, got %s" % _short(type))
        event = {"type": type}
        event.update(data)
        try:
            text = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
        except (TypeError, ValueError) as e:
            raise TypeError("agent.log: event %r is not JSON-serialisable: %s" % (type, e)) from None
        size = len(text.encode("utf-8", "replace")) + 1
        if self._trace_bytes + size > self._max_trace_bytes:
            raise ValueError("agent.log: the trace would exceed its %d-byte cap" % self._max_trace_bytes)
        self._trace_bytes += size
        self._events.append(text)

    # -- internals
    def _rpc(self, msg):
        with self._channel.lock:
            self._next_id += 1
            msg["id"] = self._next_id
            try:
                self._channel.send(msg)
                reply = self._channel.recv()
            except (OSError, EOFError, ValueError):
                # The host is gone or killed us on purpose (limits): nothing left to report to.
                os._exit(3)
        if not isinstance(reply, dict) or reply.get("id") != msg["id"]:
            os._exit(3)
        return reply

    def _events_json(self):
        return "[" + ",".join(self._events) + "]"


def _short(x):
    try:
        r = repr(x)
    except Exception:
        r = "<%s>" % type(x).__name__
    return r if len(r) <= 80 else r[:77] + "..."


# --------------------------------------------------------------------------------------- loading
_SOURCES = {}  # filename -> source text, for tracebacks (the files are not in the cwd)


def _load_module(name, path, filename):
    with open(path, "rb") as f:
        source = f.read()
    _SOURCES[filename] = source
    code = compile(source, filename, "exec", dont_inherit=True)
    module = type(sys)(name)
    module.__file__ = filename
    sys.modules[name] = module
    exec(code, module.__dict__)
    return module


def _where(exc, filename):
    """' at harness.py line 12' for the deepest traceback frame in the harness file, or ''."""
    line = None
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == filename:
            line = tb.tb_lineno
        tb = tb.tb_next
    return "" if line is None else " at %s line %d" % (filename, line)


def _describe(exc, filename, prefix="harness raised"):
    if isinstance(exc, SyntaxError) and exc.filename == filename:
        return "%s in %s line %s: %s" % (type(exc).__name__, filename, exc.lineno, exc.msg)
    try:
        msg = str(exc)
    except Exception:
        msg = ""
    if len(msg) > _MAX_REASON:
        msg = msg[: _MAX_REASON - 3] + "..."
    head = "%s %s" % (prefix, type(exc).__name__) + (": " + msg if msg else "")
    return head + _where(exc, filename)


def _format_tb(exc):
    try:
        import linecache
        import traceback

        for filename, source in _SOURCES.items():
            lines = source.decode("utf-8", "replace").splitlines(True)
            linecache.cache[filename] = (len(source), None, lines, filename)
        tb = exc.__traceback__
        own = _format_tb.__code__.co_filename
        while tb is not None and tb.tb_next is not None and tb.tb_frame.f_code.co_filename == own:
            tb = tb.tb_next  # the runtime's own frames are noise for whoever reads the trace
        text = "".join(traceback.format_exception(type(exc), exc, tb))
    except BaseException:
        return ""
    return text if len(text) <= _MAX_TRACEBACK else "...\n" + text[-_MAX_TRACEBACK:]


# ------------------------------------------------------------------------------------------- main
def _finish(channel, payload_head, events_json):
    """Send the final message (events spliced in as already-encoded JSON), then leave at once."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        pass
    try:
        head = json.dumps(payload_head, ensure_ascii=False, separators=(",", ":"))
        data = (head[:-1] + ',"events":' + events_json + "}").encode("utf-8", "replace")
        with channel.lock:
            channel.send_raw(data)
    except BaseException:
        os._exit(4)
    os._exit(0)


def _error(channel, kind, message, exc=None, events_json="[]"):
    head = {"type": "error", "kind": kind, "error": message, "traceback": _format_tb(exc) if exc is not None else ""}
    _finish(channel, head, events_json)


def main():
    if sys.argv[1] == "--exec":
        exec_jailed(sys.argv[2:])
    fd = int(sys.argv[1])
    limits = json.loads(sys.argv[2])
    os.set_inheritable(fd, False)
    channel = _Channel(fd)
    try:
        _apply_limits(limits)
    except Exception as e:
        _error(channel, "setup", "could not apply resource limits: %s: %s" % (type(e).__name__, e))
    try:
        init = channel.recv()
    except Exception:
        os._exit(3)
    try:
        applied = _harden(limits.get("harden") or {})
    except Exception as e:
        _error(channel, "setup", "could not apply the seccomp/Landlock layers: %s: %s" % (type(e).__name__, e))
    harness_file = init["harness_file"]
    module_name = init["module"]

    # The domain's tools module: trusted code, loaded before the harness, so that its failure is a
    # setup error (sent before "hello"), never the harness's fault.
    local_tools, tool_specs = {}, {}
    for name, spec in (init.get("host_tool_specs") or {}).items():
        tool_specs[name] = spec
    if init.get("tools_path"):
        try:
            tools = _load_module("_whale_domain_tools", init["tools_path"], "tools.py")
            specs = getattr(tools, "TOOL_SPECS", None) or {}
            for name, spec in dict(specs).items():
                fn = getattr(tools, name, None)
                if callable(fn):
                    local_tools[name] = fn
                    tool_specs[name] = spec
        except BaseException as e:
            _error(channel, "setup", _describe(e, "tools.py", "the domain tools module raised"), e)

    # From here on untrusted code runs: "hello" tells the host so (a child that dies before it, or a
    # "setup" error after it, cannot be the harness's doing / must be a forgery).
    channel.send({"type": "hello", "pid": os.getpid()})

    agent = Agent(channel, init.get("seed"), local_tools, tool_specs, set(init.get("host_tool_specs") or {}),
                  int(init.get("max_trace_bytes") or (1 << 20)))
    agent.sandbox = applied  # informational: the layers this process runs under

    try:
        module = _load_module(module_name, harness_file, init["harness_name"])
    except MemoryError as e:
        _error(channel, "memory", "MemoryError while loading " + init["harness_name"] + _where(e, init["harness_name"]), e)
    except BaseException as e:
        _error(channel, "exception", _describe(e, init["harness_name"]), e)
    run = getattr(module, "run", None)
    if not callable(run):
        _error(channel, "exception", "no run(task, agent) function in " + init["harness_name"])

    try:
        answer = run(init["task"], agent)
    except MemoryError as e:
        _error(channel, "memory", "MemoryError" + _where(e, init["harness_name"]), e, agent._events_json())
    except BaseException as e:
        _error(channel, "exception", _describe(e, init["harness_name"]), e, agent._events_json())
    if answer is not None and not isinstance(answer, str):
        _error(channel, "protocol", "run() returned %s, expected str or None" % type(answer).__name__,
               None, agent._events_json())
    _finish(channel, {"type": "result", "answer": answer}, agent._events_json())


if __name__ == "__main__":
    main()
