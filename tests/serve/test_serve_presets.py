"""serve.preset (whale_ray/serve/engines.py, app.py), on a real Serve app on a local Ray cluster with the real `openai`
client: with the engine in the replica's process behind Serve's proxy (cpu) and in one engine actor behind Serve's
HAProxy (gpu, its engine on the CPU here), the endpoint answers (whole and streamed) what the engine in process
answers; /health names the processes; bad input is still an OpenAI error object; the handlers run on Serve's main
loop and Serve's access log stays off. The gpu preset's engine actor: shared by every replica, loading each version
once, an error when the cluster cannot place it, and back on the run's latest weights when Ray restarts it.
(tests/serve/test_serve.py runs the rest of the contract on the default preset, cpu.)"""

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


@pytest.mark.parametrize("preset", ["cpu", "gpu"])
def test_preset_answers_as_in_process(ray_cluster, tiny_policy, preset):
    import httpx2

    from whale_ray.config import PolicyConfig, SandboxConfig, ServeConfig
    from whale_ray.serve.app import deploy, undeploy
    from whale_ray.serve.spec import for_model

    serve = ServeConfig(port=free_port(), preset=preset, engine_gpus=0)  # gpu: its engine on the CPU here
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
        assert (engine_pid == replica_pid) == (preset == "cpu")
        assert "_run_user_code" not in health["thread"], health["thread"]  # the handlers on Serve's main loop
        assert stats["idle_s"] > 0  # the engine waited between the requests above
        assert 0 < stats["busy_s"] < stats["batches"]  # in its steps, each far below a second
        assert health["loop"]["lag_ticks"] > 0  # the handlers' loop's lag is measured (whale_ray/serve/lag.py)
        if preset == "gpu":  # every request crossed the hop, none is left in flight there
            assert stats["submits"] == stats["requests"] == 4 and stats["in_flight"] == 0, stats
            assert stats["lag_ticks"] > 0, stats  # and the engine actor's loop's
        bad = httpx2.post(url + "/chat/completions", content=b"{not json", timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error", bad.text
        assert c.chat.completions.create(model="whale", messages=QUESTION, max_tokens=2).choices  # still serving
        # Serve's ingress is fixed while it runs: the other preset is refused, naming both
        other = {"cpu": "gpu", "gpu": "cpu"}[preset]
        with pytest.raises(RuntimeError, match=f"preset {other}: Serve is already running .* for preset {preset}"):
            deploy(spec.model_copy(update={"serve": serve.model_copy(update={"preset": other})}))
    finally:
        undeploy()
    new = set(logs.glob("replica_*.log")) - before
    assert new, f"no replica log under {logs}"
    assert not [line for f in new for line in f.read_text().splitlines() if "POST /v1/chat/completions" in line]


def test_whale_serve_preset_flag(tiny_policy):
    """`whale serve --preset` reaches the spec, with the preset's GPUs per engine; a value that is no preset is one
    line naming the flag."""
    from whale_ray.serve.start import SERVE_FLAGS, endpoint_spec

    flags = dict.fromkeys(SERVE_FLAGS)
    spec = endpoint_spec(None, Path(tiny_policy), "math_reasoning", None, None, {**flags, "preset": "gpu"},
                         lambda cfg: tiny_policy)
    assert (spec.serve.preset, spec.serve.gpus_per_engine) == ("gpu", 1.0)
    spec = endpoint_spec(None, Path(tiny_policy), "math_reasoning", None, None, flags, lambda cfg: tiny_policy)
    assert (spec.serve.preset, spec.serve.gpus_per_engine) == ("cpu", 0.0)
    with pytest.raises(ValueError, match="--preset 'tpu'"):
        endpoint_spec(None, Path(tiny_policy), "math_reasoning", None, None, {**flags, "preset": "tpu"},
                      lambda cfg: tiny_policy)


def test_an_engine_actor_the_cluster_cannot_place_is_an_error_not_a_hang(ray_cluster, tiny_policy, monkeypatch):
    from whale_ray.config import PolicyConfig, SandboxConfig, ServeConfig
    from whale_ray.policy.restart import Weights
    from whale_ray.serve import engines
    from whale_ray.serve.spec import for_model

    spec = for_model(tiny_policy, domain="math_reasoning", harness=None, policy=PolicyConfig(), sandbox=SandboxConfig(),
                     serve=ServeConfig(preset="gpu", engine_cpus=64, engine_gpus=0))  # the test cluster has 4
    monkeypatch.setattr(engines, "ENGINE_START_S", 3.0)
    with pytest.raises(RuntimeError, match="not up after 3 s; it asks for 64 CPU and 0 GPU"):
        engines.start_shared({"whale": Weights(0, str(tiny_policy))}, spec)
    engines.stop_shared()


def test_shared_engine_behind_haproxy_serves_every_replica_and_loads_each_version_once(ray_cluster, tiny_policy,
                                                                                      tmp_path):
    """serve.preset gpu: two replicas (processes and HTTP servers of their own, behind Serve's HAProxy) feed one
    engine actor in a third process; each checkpoint landing in the followed run is
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
    serve = ServeConfig(port=free_port(), replicas=2, preset="gpu", engine_gpus=0, poll_s=0.2)
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


def test_an_engine_actor_killed_under_load_comes_back_on_the_runs_latest_weights(ray_cluster, tiny_policy, tmp_path):
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
    serve = ServeConfig(port=free_port(), preset="gpu", engine_gpus=0, poll_s=0.2)
    url = deploy(for_run_dir(tmp_path, tiny_policy, serve))
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
