"""serve.engine_layout, serve.ingress and serve.access_log (whale_ray/serve/engines.py, app.py), on a real Serve app
on a local Ray cluster with the real `openai` client: with the engine in the replica's process and in an actor of
its own, and with requests through Serve's proxy or straight to the replica (direct ingress, past Serve's proxy), the
endpoint answers (whole and streamed) what the engine in process answers; /health names the two processes;
bad input is still an OpenAI error object; Serve's access log is written only when asked for.
(tests/serve/test_serve.py runs the rest of the contract on the default layout, replica; the actor layout passed it
too when it was the default, commit 7c2791e.)"""

from __future__ import annotations

import time
from pathlib import Path

import openai
import pytest

from tests.helpers import free_port

pytestmark = pytest.mark.timeout(300)

QUESTION = [{"role": "user", "content": "Tom has 3 apples and buys 4 more. How many apples does he have?"}]
PROMPT = "Tom has 3 apples and buys 4 more."


def in_process(policy: str, messages=None, prompt=None, **sampling) -> str:
    from whale_ray.policy.engine import GenerationRequest
    from whale_ray.policy.transformers_engine import TransformersEngine
    from whale_ray.records import SamplingParams

    engine = TransformersEngine(policy, device="cpu")
    return engine.generate([GenerationRequest(messages or [], SamplingParams(**sampling), prompt=prompt)])[0].text


@pytest.mark.parametrize("layout,ingress,access_log,user_code_thread", [
    ("replica", "proxy", True, True), ("actor", "proxy", False, False), ("replica", "direct", False, False)])
def test_layout_answers_as_in_process_and_logs_access_only_when_asked(ray_cluster, tiny_policy, layout, ingress,
                                                                     access_log, user_code_thread):
    import httpx2

    from whale_ray.config import PolicyConfig, SandboxConfig, ServeConfig
    from whale_ray.serve.app import deploy, undeploy
    from whale_ray.serve.spec import for_model

    serve = ServeConfig(port=free_port(), replicas=1, engine_layout=layout, ingress=ingress, access_log=access_log,
                        user_code_thread=user_code_thread)
    spec = for_model(tiny_policy, domain="math_reasoning", harness=None, policy=PolicyConfig(device="cpu"),
                     sandbox=SandboxConfig(), serve=serve)
    logs = Path(ray_cluster._private.worker._global_node.get_session_dir_path()) / "logs" / "serve"
    before = set(logs.glob("replica_*.log"))
    url = deploy(spec)
    try:
        c = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
        r = c.chat.completions.create(model="whale", messages=QUESTION, max_tokens=12, temperature=0)
        assert r.choices[0].message.content == in_process(tiny_policy, QUESTION, max_tokens=12, temperature=0)
        assert r.system_fingerprint == "whale-v0"
        r = c.completions.create(model="whale", prompt=PROMPT, max_tokens=8, temperature=0)
        assert r.choices[0].text == in_process(tiny_policy, prompt=PROMPT, max_tokens=8, temperature=0)
        stream = c.chat.completions.create(model="whale", messages=QUESTION, max_tokens=24, temperature=0, stream=True)
        chunks = [ch.choices[0].delta.content for ch in stream if ch.choices and ch.choices[0].delta.content]
        assert "".join(chunks) == in_process(tiny_policy, QUESTION, max_tokens=24, temperature=0)
        assert len(chunks) > 3  # as it is sampled (through the actor: a list of tokens per read), not all at the end
        raw = c.chat.completions.with_raw_response.create(model="whale", messages=QUESTION, max_tokens=4)
        timing = dict(x.strip().split(";dur=") for x in raw.headers["server-timing"].split(","))
        assert 0 < float(timing["completion"]) <= float(timing["handler"]), timing  # ms, the one within the other
        health = httpx2.get(url.removesuffix("/v1") + "/health", timeout=60).json()
        stats = health["batches"]["whale"]
        engine_pid, replica_pid = stats["pid"], health["pid"]
        assert (engine_pid == replica_pid) == (layout == "replica")
        # the handlers on Serve's main loop, or on its loop for user code in a thread of its own
        assert ("_run_user_code" in health["thread"]) == user_code_thread, health["thread"]
        assert stats["idle_s"] > 0  # the engine waited between the requests above
        assert 0 < stats["busy_s"] < stats["batches"]  # in its steps, each far below a second
        assert health["loop"]["lag_ticks"] > 0  # the handlers' loop's lag is measured (whale_ray/serve/lag.py)
        if layout == "actor":  # every request crossed the hop, none is left in flight there
            assert stats["submits"] == stats["requests"] == 4 and stats["in_flight"] == 0, stats
            assert stats["lag_ticks"] > 0, stats  # and the engine actor's loop's
        bad = httpx2.post(url + "/chat/completions", content=b"{not json", timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error", bad.text
        assert c.chat.completions.create(model="whale", messages=QUESTION, max_tokens=2).choices  # still serving
        if ingress == "proxy":  # Serve's ingress is fixed while it runs: the other one is refused, naming both
            other = spec.model_copy(update={"serve": serve.model_copy(update={"ingress": "direct"})})
            with pytest.raises(RuntimeError, match="ingress direct: Serve is already running .* with ingress proxy"):
                deploy(other)
    finally:
        undeploy()
    new = set(logs.glob("replica_*.log")) - before
    assert new, f"no replica log under {logs}"
    access = [line for f in new for line in f.read_text().splitlines() if "POST /v1/chat/completions" in line]
    assert bool(access) == access_log, access[:3]
    # direct: the replica's own HTTP server on the endpoint's port answered (Serve's proxy, if any, is elsewhere)
    own = [f for f in new if f"Started HTTP server on port {serve.port}" in f.read_text()]
    assert bool(own) == (ingress == "direct")


def test_whale_serve_engine_layout_and_ingress_flags(tiny_policy):
    """`whale serve --engine-layout` and `--ingress` reach the spec; a value that is not a layout is one line naming
    the flag, and direct ingress with more than one replica one line naming both."""
    from whale_ray.serve.start import SERVE_FLAGS, endpoint_spec

    flags = dict.fromkeys(SERVE_FLAGS)
    spec = endpoint_spec(None, Path(tiny_policy), "math_reasoning", None, None, {**flags, "engine_layout": "actor"},
                         lambda cfg: tiny_policy)
    assert spec.serve.engine_layout == "actor" and spec.serve.access_log is False
    assert endpoint_spec(None, Path(tiny_policy), "math_reasoning", None, None, flags,
                         lambda cfg: tiny_policy).serve.engine_layout == "replica"
    with pytest.raises(ValueError, match="--engine-layout 'gpu'"):
        endpoint_spec(None, Path(tiny_policy), "math_reasoning", None, None, {**flags, "engine_layout": "gpu"},
                      lambda cfg: tiny_policy)
    direct = {**flags, "ingress": "direct", "port": 8123}
    assert endpoint_spec(None, Path(tiny_policy), "math_reasoning", None, None, direct,
                         lambda cfg: tiny_policy).serve.ingress == "direct"
    with pytest.raises(ValueError, match="ingress direct serves from one replica on port 8123; got replicas 2"):
        endpoint_spec(None, Path(tiny_policy), "math_reasoning", None, None, {**direct, "replicas": 2},
                      lambda cfg: tiny_policy)


def test_an_engine_actor_the_cluster_cannot_place_is_an_error_not_a_hang(ray_cluster, tiny_policy, monkeypatch):
    from whale_ray.config import PolicyConfig, SandboxConfig, ServeConfig
    from whale_ray.serve import engines
    from whale_ray.serve.follow import Weights
    from whale_ray.serve.spec import for_model

    spec = for_model(tiny_policy, domain="math_reasoning", harness=None, policy=PolicyConfig(), sandbox=SandboxConfig(),
                     serve=ServeConfig(engine_layout="actor", replica_cpus=64))  # the test cluster has 4
    monkeypatch.setattr(engines, "ENGINE_START_S", 3.0)
    with pytest.raises(RuntimeError, match="not up after 3 s; it asks for 64 CPU"):
        engines.start_engines({"policy": Weights(0, str(tiny_policy))}, spec)


def test_shared_engine_behind_haproxy_serves_every_replica_and_loads_each_version_once(ray_cluster, tiny_policy,
                                                                                      tmp_path):
    """serve.engine_layout shared with serve.ingress haproxy: two replicas (processes and HTTP servers of their own,
    behind Serve's HAProxy) feed one engine actor in a third process; each checkpoint landing in the followed run is
    loaded into it once although both replicas see it, every client's versions never go down while it lands, the
    greedy answer after it equals the in-process engine's on those weights, and undeploy ends the engine actor."""
    import asyncio

    import httpx2
    import ray

    from tests.helpers import Run, in_process, small_config
    from whale_ray.config import ServeConfig, dump_config
    from whale_ray.serve.app import deploy, undeploy
    from whale_ray.serve.engines import SHARED_NAME, SHARED_NAMESPACE
    from whale_ray.serve.spec import for_run_dir

    (tmp_path / "config.yaml").write_text(dump_config(small_config(tmp_path)))
    run = Run(tmp_path, tiny_policy)
    serve = ServeConfig(port=free_port(), replicas=2, engine_layout="shared", ingress="haproxy", poll_s=0.2)
    url = deploy(for_run_dir(tmp_path, tiny_policy, serve))
    base = url.removesuffix("/v1")
    try:
        async def load(clients: int, per_client: int, during=None) -> list[list[int]]:
            ac = openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0)
            seen: list[list[int]] = [[] for _ in range(clients)]

            async def client(i: int) -> None:
                for k in range(per_client):
                    r = await ac.chat.completions.create(model="whale-latest", messages=QUESTION, max_tokens=6, seed=k)
                    seen[i].append(int(r.system_fingerprint.removeprefix("whale-v")))

            async def land_midway() -> None:
                while sum(map(len, seen)) < clients * per_client // 3:
                    await asyncio.sleep(0.02)
                await asyncio.get_running_loop().run_in_executor(None, during)
            await asyncio.gather(*(client(i) for i in range(clients)), *([land_midway()] if during else []))
            await ac.close()
            return seen

        assert {v for s in asyncio.run(load(8, 3)) for v in s} == {0}
        healths = [httpx2.get(base + "/health", timeout=60).json() for _ in range(16)]
        replicas = {h["pid"] for h in healths}
        engines = {h["batches"]["whale-latest"]["pid"] for h in healths}
        assert len(replicas) == 2 and len(engines) == 1 and not engines & replicas, (replicas, engines)
        assert {h["batches"]["whale-latest"]["requests"] for h in healths} >= {24}  # one engine counts them all

        seen = asyncio.run(load(8, 6, during=lambda: run.land(1)))
        assert all(s == sorted(s) for s in seen) and {v for s in seen for v in s} == {0, 1}, seen
        c = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
        want = in_process(str(run.root / run.state.checkpoint), 1, QUESTION, max_tokens=10, temperature=0)
        for _ in range(4):  # through HAProxy to either replica: the same engine, on v1
            r = c.chat.completions.create(model="whale-latest", messages=QUESTION, max_tokens=10, temperature=0)
            assert (r.system_fingerprint, r.choices[0].message.content) == ("whale-v1", want)
        run.land(2)
        assert c.chat.completions.create(model="whale-latest", messages=QUESTION, max_tokens=2).system_fingerprint \
            == "whale-v2"
        time.sleep(3 * serve.poll_s)  # both replicas' followers look at the run directory
        healths = [httpx2.get(base + "/health", timeout=60).json() for _ in range(16)]
        assert {h["pid"] for h in healths} == replicas
        assert {h["versions"]["whale-latest"] for h in healths} == {2}
        assert {h["batches"]["whale-latest"]["loads"] for h in healths} == {2}  # once each, for both replicas
    finally:
        undeploy()
    with pytest.raises(ValueError):
        ray.get_actor(SHARED_NAME, namespace=SHARED_NAMESPACE)


@pytest.mark.parametrize("layout", ["actor", "shared"])
def test_an_engine_actor_killed_under_load_comes_back_on_the_runs_latest_weights(ray_cluster, tiny_policy, tmp_path,
                                                                               layout):
    """The engine actor's process SIGKILLed while 8 clients send requests: each request is answered or gets a 503 with
    Retry-After (nothing else: no 500, no hang), Ray restarts the actor in a new process under the same replica, on
    the run's latest weights (v1, not the v0 it was first started on), every client's versions never go down, and
    the next checkpoint landing reaches the restarted engine."""
    import asyncio
    import os
    import signal

    import httpx2

    from tests.helpers import Run, small_config
    from whale_ray.config import ServeConfig, dump_config
    from whale_ray.serve.app import deploy, undeploy
    from whale_ray.serve.spec import for_run_dir

    (tmp_path / "config.yaml").write_text(dump_config(small_config(tmp_path)))
    run = Run(tmp_path, tiny_policy)
    url = deploy(for_run_dir(tmp_path, tiny_policy, ServeConfig(port=free_port(), engine_layout=layout, poll_s=0.2)))
    base = url.removesuffix("/v1")
    c = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
    ask = dict(model="whale-latest", messages=QUESTION, max_tokens=6)
    try:
        run.land(1)
        assert c.chat.completions.create(**ask).system_fingerprint == "whale-v1"
        before = httpx2.get(base + "/health", timeout=60).json()
        engine = before["batches"]["whale-latest"]["pid"]
        assert engine != before["pid"] and before["batches"]["whale-latest"]["restarted"] is False

        async def load(clients: int = 8, per_client: int = 12) -> tuple[list[list[int]], list[tuple]]:
            ac = openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=120)
            seen: list[list[int]] = [[] for _ in range(clients)]
            refused: list[tuple] = []

            async def client(i: int) -> None:
                for k in range(per_client):
                    try:
                        r = await ac.chat.completions.create(**ask, seed=k)
                        seen[i].append(int(r.system_fingerprint.removeprefix("whale-v")))
                    except openai.APIStatusError as e:
                        refused.append((e.status_code, e.response.headers.get("retry-after"), e.body))

            async def kill_midway() -> None:
                while sum(map(len, seen)) < clients * per_client // 3:
                    await asyncio.sleep(0.01)
                os.kill(engine, signal.SIGKILL)
            await asyncio.gather(*(client(i) for i in range(clients)), kill_midway())
            await ac.close()
            return seen, refused

        seen, refused = asyncio.run(load())
        assert refused, "no request was in flight when the engine died"  # 8 clients keep some in flight at all times
        assert all(status == 503 and after == "1" and body["code"] == "engine_restarting"
                   for status, after, body in refused), refused
        assert {v for s in seen for v in s} == {1} and sum(map(len, seen)) + len(refused) == 96
        assert sum(map(len, seen)) > 96 // 3  # requests after the kill were answered, by the restarted engine
        after = httpx2.get(base + "/health", timeout=60).json()
        assert after["pid"] == before["pid"] and after["status"] == "ok"
        assert after["batches"]["whale-latest"]["pid"] not in (engine, after["pid"])
        assert after["batches"]["whale-latest"]["restarted"] is True
        run.land(2)
        assert c.chat.completions.create(**ask).system_fingerprint == "whale-v2"
    finally:
        undeploy()
