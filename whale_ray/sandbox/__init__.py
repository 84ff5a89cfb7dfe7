"""The sandbox: runs one episode of an untrusted harness file in an isolated subprocess.

Host API (whale_ray/sandbox/runner.py): `run_episode`, `SandboxLimits`; the child runtime that runs
inside the sandbox is whale_ray/sandbox/child.py (standard library only); the isolation layers
(bubblewrap, rlimits) are in whale_ray/sandbox/isolation.py.
"""

from whale_ray.sandbox.runner import ISOLATIONS, GenerateFn, SandboxLimits, host_tool_spec, run_episode

__all__ = ["ISOLATIONS", "GenerateFn", "SandboxLimits", "host_tool_spec", "run_episode"]
