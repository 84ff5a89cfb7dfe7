"""The sandbox: runs one episode of an untrusted harness file in an isolated subprocess.

Host API: `run_episode` (whale_ray/sandbox/runner.py, which says where the rest of the host side lives) and
`SandboxLimits` (limits.py); the child runtime that runs inside the sandbox is whale_ray/sandbox/child.py
(standard library only); the isolation layers (bubblewrap, rlimits) are in whale_ray/sandbox/isolation.py.
"""

from whale_ray.sandbox.episode import GenerateFn
from whale_ray.sandbox.limits import ISOLATIONS, SandboxLimits
from whale_ray.sandbox.runner import host_tool_spec, run_episode

__all__ = ["ISOLATIONS", "GenerateFn", "SandboxLimits", "host_tool_spec", "run_episode"]
