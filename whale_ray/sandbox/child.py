"""The sandbox side of one episode: loads the untrusted harness and serves it the `agent` handle.

STANDARD LIBRARY ONLY. This file is copied into the sandbox, which has no site-packages and cannot
import whale_ray. It is started by whale_ray/sandbox/runner.py as

    python3 -P -s -S child.pyc RPC_FD LIMITS_JSON

(the host compiles this file once per process and ships the bytecode, which saves the compile in every
episode; the interpreter is the host's own, so the bytecode always matches), with RPC_FD an inherited
Unix stream socket to the trusted host. Everything it says to the host goes
over that socket as frames (4-byte big-endian length, then UTF-8 JSON); stdout and stderr belong to the
harness and are only captured (and capped) by the host.

Order of events: apply the resource limits, read the host's `init` message, load the domain tools
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
