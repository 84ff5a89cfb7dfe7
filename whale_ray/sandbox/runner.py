"""Run one episode of an untrusted harness file in an isolated subprocess (the host side).

    result = run_episode(source, task.public(), generate=gen, tools_path=domain.sandbox_tools_path,
                         host_tools=domain.host_tools(services), limits=SandboxLimits(), seed=7)

`run_episode` never raises for anything the harness does: every outcome is an `EpisodeResult` with a status
from `records.STATUSES` and a short reason. Every frame a child sends is decoded strictly
(`frames.decode_frame`: UTF-8 JSON object with a str type, 64-bit integers, finite numbers, nesting <=
MAX_DEPTH, no lone surrogates) and checked field by field: anything else is a protocol_error, and a
host-side failure on a frame all the same ends that episode as sandbox_error (traceback in the reason),
never an exception. It raises only for the caller's own mistakes (a task that is not JSON-serialisable, a
bad harness_name, a missing tools file) and re-raises an exception of the caller's `generate` callback (the
policy server failing is not the harness's fault and must not be scored as a 0).

The parts, each in a module of its own: limits.py (`SandboxLimits`, and where each limit is enforced),
episode.py (one episode in order, and the channel's messages), frames.py (the strict frame decoder),
uid_pool.py (per-slot uids when running as root). This module keeps the entry point and the host tools'
schema.
"""

from __future__ import annotations

import inspect
import json
import re
import sys
import time
from pathlib import Path
from typing import Any, Callable

from whale_ray.records import EpisodeResult
from whale_ray.sandbox import isolation
from whale_ray.sandbox.episode import Episode, GenerateFn, episode_result
from whale_ray.sandbox.isolation import SetupError
from whale_ray.sandbox.limits import SandboxLimits

_HARNESS_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}\.py$")


def run_episode(
    harness_source: str,
    task: dict,
    *,
    generate: GenerateFn,
    tools_path: Path | None,
    host_tools: dict[str, Callable[..., str]],
    limits: SandboxLimits,
    seed: int,
    harness_name: str = "harness.py",
) -> EpisodeResult:
    """Run `run(task, agent)` of `harness_source` in a fresh sandbox; see the module docstring."""
    t0 = time.monotonic()
    if not isinstance(harness_source, str):
        raise TypeError(f"harness_source must be str, got {type(harness_source).__name__}")
    if not _HARNESS_NAME.match(harness_name):
        raise ValueError(f"harness_name must be a plain file name ending in .py, got {harness_name!r}")
    tools_source = Path(tools_path).read_bytes() if tools_path is not None else None
    host_tools = dict(host_tools or {})
    init = {
        "type": "init",
        "task": task,
        "seed": seed,
        "harness_name": harness_name,
        "module": _module_name(harness_name),
        "host_tool_specs": {name: host_tool_spec(name, fn) for name, fn in host_tools.items()},
        "max_trace_bytes": max(1024, limits.max_message_bytes * 3 // 4),
    }
    try:
        json.dumps(init)
    except (TypeError, ValueError) as e:
        raise ValueError(f"the task (and host tool specs) must be JSON-serialisable: {e}") from None

    try:
        launcher = _launcher(limits.isolation)
    except SetupError as e:
        return episode_result("sandbox_setup_error", str(e), t0)
    harness_bytes = harness_source.encode("utf-8", "surrogateescape")
    episode = Episode(launcher, limits, generate, host_tools, seed, t0)
    return episode.run(harness_name, harness_bytes, tools_source, init)


_JSON_TYPES = {"str": "string", "int": "integer", "float": "number", "bool": "boolean", "list": "array",
               "dict": "object"}


def host_tool_spec(name: str, fn: Callable[..., Any]) -> dict[str, Any]:
    """The spec the harness sees for a host tool: `fn.tool_spec` if set, else from its signature and docstring."""
    spec = getattr(fn, "tool_spec", None)
    if isinstance(spec, dict):
        return spec
    doc = (inspect.getdoc(fn) or f"host tool {name}").strip().split("\n\n")[0]
    props: dict[str, Any] = {}
    required: list[str] = []
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        params = []
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        ann = p.annotation
        t = _JSON_TYPES.get(ann if isinstance(ann, str) else getattr(ann, "__name__", None))
        props[p.name] = {"type": t} if t else {}
        if p.default is p.empty:
            required.append(p.name)
    return {"description": doc, "parameters": {"type": "object", "properties": props, "required": required}}


# ------------------------------------------------------------------------------------------ helpers
def _launcher(mode: str) -> Any:
    if mode == "unsafe_none":
        return isolation.UnsafeLauncher(isolation.interpreter_path())
    return isolation.bwrap_launcher()  # "auto" and "bwrap": the probe decides, never a silent fallback


def _module_name(harness_name: str) -> str:
    stem = harness_name[:-3]
    stdlib = getattr(sys, "stdlib_module_names", ())
    if not stem.isidentifier() or stem in stdlib or stem in sys.builtin_module_names or stem.startswith("_whale"):
        return "harness"
    return stem
