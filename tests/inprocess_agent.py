"""The sandbox's own Agent (whale_ray/sandbox/child.py), in this process, for domain unit tests.

`InProcessEpisode` builds the real `child.Agent` over an in-process channel that plays the host's side of
the RPC frames the way the runner does: "generate" asks a scripted `policy(messages, sampling) -> text`,
"tool" calls a host tool (errors become the runner's "rpc_error" replies, which the Agent turns into
agent.ToolError). Local tools are loaded from the domain's tools.py by child.py's own loader, as in the
sandbox. What the harness sent is kept: `prompts`, `sampling`, `tool_calls`, and the trace `events`.
"""

from __future__ import annotations

import _thread
import json
from pathlib import Path
from typing import Any, Callable

from whale_ray.sandbox import child


class _Channel:
    """child.Agent's channel (lock, send, recv), answered in process."""

    def __init__(self, episode: "InProcessEpisode"):
        self.lock = _thread.allocate_lock()
        self._episode = episode
        self._reply: dict[str, Any] | None = None

    def send(self, msg: dict[str, Any]) -> None:
        msg = json.loads(json.dumps(msg))  # what crosses the socket is JSON
        self._reply = {**self._episode._answer(msg), "id": msg["id"]}

    def recv(self) -> dict[str, Any]:
        reply, self._reply = self._reply, None
        return reply


class InProcessEpisode:
    def __init__(self, policy: Callable[[list[dict], dict], str] | list[str], *, tools_path: Path | None = None,
                 host_tools: dict[str, Callable[..., str]] | None = None,
                 local_tools: dict[str, Callable[..., str]] | None = None, seed: int = 0,
                 finish_reason: str = "stop", max_trace_bytes: int = 1 << 20):
        if isinstance(policy, list):
            queue = list(policy)
            policy = lambda messages, sampling: queue.pop(0)  # noqa: E731
        self.policy, self.host_tools, self.finish_reason = policy, dict(host_tools or {}), finish_reason
        self.prompts: list[list[dict]] = []
        self.sampling: list[dict] = []
        self.tool_calls: list[dict] = []
        tools, specs = {}, {name: getattr(fn, "tool_spec", {}) for name, fn in self.host_tools.items()}
        if tools_path is not None:
            module = child._load_module("_whale_domain_tools", str(tools_path), "tools.py")
            for name, spec in dict(getattr(module, "TOOL_SPECS", None) or {}).items():
                if callable(getattr(module, name, None)):
                    tools[name], specs[name] = getattr(module, name), spec
        for name, fn in (local_tools or {}).items():  # in place of a tools.py function (one that fails, say)
            tools[name] = fn
            specs.setdefault(name, {})
        self.agent = child.Agent(_Channel(self), seed, tools, specs, set(self.host_tools), max_trace_bytes)

    @property
    def events(self) -> list[dict]:
        return [json.loads(e) for e in self.agent._events]

    def _answer(self, msg: dict[str, Any]) -> dict[str, Any]:
        if msg["type"] == "generate":
            self.prompts.append(msg["messages"])
            self.sampling.append(msg["sampling"])
            return {"type": "generate_result", "text": self.policy(msg["messages"], msg["sampling"]),
                    "finish_reason": self.finish_reason}
        name, args = msg["name"], msg["args"]
        try:
            output = self.host_tools[name](**args)
        except Exception as e:  # as the runner says it: the harness sees agent.ToolError with this text
            self.tool_calls.append({"name": name, "args": args, "error": str(e)})
            return {"type": "rpc_error", "message": f"tool {name!r} raised {type(e).__name__}: {e}"}
        self.tool_calls.append({"name": name, "args": args, "output": output})
        return {"type": "tool_result", "output": output}
