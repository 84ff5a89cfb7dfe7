"""What one endpoint serves: its models (followed or fixed), the agent's domain and harness, its settings.

An `EndpointSpec` is built in the driver (the CLI, `whale run --serve`, a test) and handed to every replica.
It holds no secret: the API key's SHA-256 only, so the key never travels through Ray's object store.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import BaseModel

from whale_ray.config import PolicyConfig, SandboxConfig, ServeConfig, WhaleConfig, load_recorded_config
from whale_ray.domain import get_domain

LATEST, BEST = "whale-latest", "whale-best"  # the model ids of a followed run


class ModelSource(BaseModel):
    name: str  # the OpenAI model id
    follow: Optional[Literal["latest", "best"]] = None  # which weights of the run directory; None: `path` as is
    path: Optional[str] = None  # the checkpoint served when not following


class EndpointSpec(BaseModel):
    models: list[ModelSource]
    run_dir: Optional[str] = None  # followed when set
    base_model: str  # the run's θ0 (what version 0 and a base-model best are)
    domain: str
    harness_path: str  # the agent's harness when not following a run (and a run's h0 before its archive has it)
    policy: PolicyConfig = PolicyConfig()
    sandbox: SandboxConfig = SandboxConfig()
    serve: ServeConfig = ServeConfig()
    api_key_sha256: Optional[str] = None
    config: Optional[dict[str, Any]] = None  # the resolved run config the agent's domain services start from

    @property
    def agent_model(self) -> str:
        """The weights the agent runs on by default: θ* of a followed run, else the first model."""
        names = [m.name for m in self.models]
        return BEST if BEST in names else names[0]


def api_key_sha256(env_name: Optional[str]) -> Optional[str]:
    """The SHA-256 of the key in $env_name (None when no key is asked for); ValueError when it is unset."""
    if not env_name:
        return None
    key = os.environ.get(env_name)
    if not key:
        raise ValueError(f"--api-key-env {env_name}: the environment variable is not set (or empty)")
    return hashlib.sha256(key.encode()).hexdigest()


def for_model(model: str | Path, *, domain: str, harness: str | Path | None, policy: PolicyConfig,
              sandbox: SandboxConfig, serve: ServeConfig, name: str = "whale",
              config: dict[str, Any] | None = None) -> EndpointSpec:
    """A fixed checkpoint, served as `name`; the agent runs `harness` (the domain's h0 by default); `config`:
    the resolved config its domain services start from (none: the domain needs none)."""
    path = str(Path(model).resolve())
    return EndpointSpec(models=[ModelSource(name=name, path=path)], base_model=path, domain=domain,
                        harness_path=str(harness or get_domain(domain).h0_path), policy=policy, sandbox=sandbox,
                        serve=serve, api_key_sha256=api_key_sha256(serve.api_key_env), config=config)


def for_run(cfg: WhaleConfig, base_model: str, serve: ServeConfig | None = None) -> EndpointSpec:
    """A run's latest weights and θ* (whale-latest, whale-best), and its h* for the agent, with the run's own
    policy, sandbox and serve settings (`serve` replaces the last). The run directory may not exist yet."""
    serve = serve or cfg.serve
    return EndpointSpec(
        models=[ModelSource(name=LATEST, follow="latest"), ModelSource(name=BEST, follow="best")],
        run_dir=str(Path(cfg.run_dir).resolve()), base_model=base_model, domain=cfg.domain,
        harness_path=str(cfg.harness or get_domain(cfg.domain).h0_path), policy=cfg.policy, sandbox=cfg.sandbox,
        serve=serve, api_key_sha256=api_key_sha256(serve.api_key_env), config=cfg.model_dump(mode="json"))


def for_run_dir(run_dir: str | Path, base_model: str, serve: ServeConfig | None = None) -> EndpointSpec:
    """`for_run` of the run recorded in `run_dir` (its config.yaml)."""
    root = Path(run_dir).resolve()
    cfg = load_recorded_config(root / "config.yaml")
    cfg.run_dir = root
    return for_run(cfg, base_model, serve)
