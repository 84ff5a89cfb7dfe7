"""What every command does before a run: check its inputs, find (or build) the base model, start or join Ray.

`whale run`, `whale sweep` and `whale study` share these steps (whale_ray/cli.py parses the flags and calls them);
errors a user can fix are `InputError`s, which the CLI prints as one line.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from rich.console import Console

from whale_ray.config import WhaleConfig
from whale_ray.resources import cache_dir

console = Console()
if not console.is_terminal:
    console.width = 200  # logs and pipes: keep table rows on one line


class InputError(Exception):
    """Bad input found before anything is started; the message is one line naming the input."""


def check_inputs(cfg: WhaleConfig) -> None:
    """Everything that can be checked before a run directory is touched."""
    from whale_ray.domain import DataError, get_domain
    from whale_ray.harness import HarnessError, load_harness_file

    domain = get_domain(cfg.domain)
    try:
        domain.load_splits(cfg.data, cfg.seed)
        domain.check_inputs(cfg)
    except DataError as e:
        raise InputError(str(e)) from None
    try:
        load_harness_file(Path(cfg.harness) if cfg.harness else domain.h0_path)
    except HarnessError as e:
        raise InputError(str(e)) from None
    if cfg.policy.model is not None:
        check_model(Path(cfg.policy.model))
    check_proposer(cfg)
    from whale_ray.loop import RunDirectory

    conflicts = [c for c in RunDirectory(cfg.run_dir).config_conflicts(cfg) if not c.startswith(("serve.", "tracking."))]
    if conflicts:  # the endpoint (serve.*) and the trackers (tracking.*) are no part of a run's identity
        raise InputError(f"--run-dir {cfg.run_dir}: holds a run with a different config ({'; '.join(conflicts[:5])}); "
                         "relaunch with the same options to resume, or choose another run directory")


def check_model(model: Path) -> None:
    """A `--model` checkpoint fully checked (files, config, chat template, eos), so that a bad one is one line here
    rather than an actor that fails the same way on every start."""
    from whale_ray.policy.checkpoint import CheckpointError, check_checkpoint

    try:
        check_checkpoint(model)
    except CheckpointError as e:
        raise InputError(str(e)) from None


def check_proposer(cfg: WhaleConfig) -> None:
    """The proposer can start: an API key for a non-loopback llm endpoint, bubblewrap for agent-cli."""
    hp = cfg.harness_phase
    if hp.proposer == "llm":
        from whale_ray.proposers.base import ProposerError
        from whale_ray.proposers.llm import resolve_api_key

        try:
            resolve_api_key(hp.endpoint)
        except ProposerError as e:
            raise InputError(str(e)) from None
    elif hp.proposer == "agent-cli":
        from whale_ray.sandbox.isolation import find_bwrap

        if find_bwrap() is None:
            raise InputError("--proposer agent-cli runs the agent in a bubblewrap jail: install bubblewrap")


def base_model(cfg: WhaleConfig) -> str:
    if cfg.policy.model is not None:
        return str(Path(cfg.policy.model).resolve())
    from whale_ray.domain import get_domain
    from whale_ray.policy.tiny import build_embedded_policy
    from whale_ray.storage import default_cache_dir

    # $WHALE_CACHE wins; else <storage>/cache, where every node of a cluster finds the build
    cache = default_cache_dir() if os.environ.get("WHALE_CACHE") else (cache_dir(cfg.storage) or default_cache_dir())
    console.print(f"embedded tiny policy: cached under {cache} (built on first use)")
    # One base policy for every run seed: runs differ in what WHALE does, not in where they start.
    path = build_embedded_policy(get_domain(cfg.domain), cache_dir=cache, warmstart_steps=cfg.policy.warmstart_steps)
    return str(path)


CONNECT_TIMEOUT_S = 30.0  # ray.init against an address where nothing answers would retry for minutes


def start_ray(address: str | None) -> None:
    import logging

    import ray

    address = address or os.environ.get("RAY_ADDRESS")

    if address:
        check_reachable(address)
        # Backstop for an address that accepts connections but is no Ray head: one line, not a hang.
        watchdog = threading.Timer(CONNECT_TIMEOUT_S, _give_up, args=(address,))
        watchdog.daemon = True
        watchdog.start()
        try:
            ray.init(address=address, logging_level=logging.WARNING)
        finally:
            watchdog.cancel()
    else:
        # A new local cluster turns Ray's token authentication on by default and says so on every run; the
        # mode is Ray's own choice (RAY_AUTH_MODE still decides), only the notice is not repeated. Setting the
        # mode here instead would be too late: Ray reads it at import, and a GCS started with another mode
        # than its driver's refuses the driver.
        logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
        # Logical CPUs above the core count: generation, training and sandboxes take turns, not all at once.
        # address="local": a new cluster of this process, never one that `ray start` left recorded in /tmp/ray
        # (ray.init() without an address joins that one, and then refuses num_cpus)
        ray.init(address="local", num_cpus=max(4, os.cpu_count() or 1), include_dashboard=False,
                 logging_level=logging.WARNING, log_to_driver=False)


def check_reachable(address: str) -> None:
    """A Ray address where nothing listens is an InputError within seconds (ray.init would retry for minutes)."""
    import socket

    from ray._private.services import canonicalize_bootstrap_address  # "auto" -> the head `ray start` recorded

    target = address.removeprefix("ray://")
    try:
        hostport = target if address.startswith("ray://") else canonicalize_bootstrap_address(target)
    except (ConnectionError, ValueError) as e:
        raise InputError(f"--ray-address {address}: {str(e).splitlines()[0]}") from None
    host, _, port = (hostport or "").rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=10).close()
    except (OSError, ValueError) as e:
        raise InputError(f"--ray-address {address}: no Ray cluster answers at {hostport} ({e})") from None


def _give_up(address: str) -> None:
    console.print(f"[red]whale: error:[/red] --ray-address {address}: the Ray cluster did not answer within "
                  f"{CONNECT_TIMEOUT_S:.0f} s", highlight=False, soft_wrap=True)
    os._exit(2)  # ray.init cannot be interrupted from another thread
