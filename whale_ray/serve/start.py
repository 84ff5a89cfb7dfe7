"""Starting the endpoint from the command line: `whale serve` (until Ctrl-C) and `whale run --serve` (for the
run's length). The CLI parses and calls these; Ray is connected (or started) by the caller."""

from __future__ import annotations

import contextlib
import signal
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from pydantic import ValidationError

from whale_ray.config import PolicyConfig, ServeConfig, WhaleConfig, load_config, load_recorded_config
from whale_ray.policy.checkpoint import check_checkpoint
from whale_ray.serve.spec import EndpointSpec, for_model, for_run

SERVE_FLAGS = ("preset", "host", "port", "replicas", "min_replicas", "max_replicas", "max_concurrent", "api_key_env")


def endpoint_spec(run_dir: Path | None, model: Path | None, domain: str, harness: Path | None,
                  isolation: str | None, flags: dict[str, Any], base_model: Callable[[WhaleConfig], str]) -> EndpointSpec:
    """`whale serve`'s EndpointSpec: a run directory (its recorded config, serve: section included) or a fixed
    checkpoint; flags that are not None override the serve settings. ValueError naming a bad input."""
    if run_dir is not None:
        if not (run_dir / "config.yaml").is_file():
            raise ValueError(f"--run-dir {run_dir}: no run there (no config.yaml)")
        cfg = load_recorded_config(run_dir / "config.yaml")
        cfg.run_dir = run_dir.resolve()
    else:
        cfg = load_config(None, {"domain": domain, "sandbox.isolation": isolation})
    given = {k: v for k, v in flags.items() if v is not None}
    try:
        serve = ServeConfig.model_validate({**cfg.serve.model_dump(), **given})
    except ValidationError as e:
        err = e.errors()[0]
        if not err["loc"]:  # a rule over several settings (ServeConfig's validator names them)
            raise ValueError(err["msg"].removeprefix("Value error, ")) from None
        raise ValueError(f"--{str(err['loc'][0]).replace('_', '-')} {err.get('input')!r}: {err['msg']}") from None
    if run_dir is not None:
        return for_run(cfg, base_model(cfg), serve)
    assert model is not None
    model = check_checkpoint(model)  # a hub id: its cached snapshot; a CheckpointError is a ValueError naming it
    if harness is not None and not harness.is_file():
        raise ValueError(f"--harness {harness}: no such file")
    return for_model(model, domain=cfg.domain, harness=harness, policy=PolicyConfig(), sandbox=cfg.sandbox,
                     serve=serve, config=cfg.model_dump(mode="json"))


def serve_until_interrupted(spec: EndpointSpec, say: Callable[[str], None]) -> None:
    from whale_ray.serve.app import deploy, undeploy

    def stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)  # a pod or service manager stops it so: Serve apps outlive their driver
    url = deploy(spec)
    say(f"serving {', '.join(m.name for m in spec.models)} at {url} "
        f"({'following ' + spec.run_dir if spec.run_dir else 'fixed weights'}); Ctrl-C or SIGTERM stops")
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:  # the way to stop it: not an interrupted run, nothing to resume
        say("stopping the endpoint")
    finally:
        undeploy()
    say("the endpoint is down")


@contextlib.contextmanager
def run_endpoint(cfg: WhaleConfig, base_model: str, say: Callable[[str], None]) -> Iterator[str]:
    """The endpoint over a run that is about to start: up before the run's actors (so it serves θ0 from the
    first request), following the run directory as checkpoints land, taken down after the run however it ends.
    The run directory need not hold a state yet: the replicas serve the base model until it does."""
    from whale_ray.serve.app import deploy, undeploy

    url = deploy(for_run(cfg, base_model))
    say(f"live endpoint: {url} (whale-latest follows the run, whale-best is θ*; POST {url}/agent/run)")
    try:
        yield url
    finally:
        undeploy()
