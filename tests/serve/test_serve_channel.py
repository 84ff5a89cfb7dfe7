"""whale_ray/serve/channel.py: the batched hop between a replica and the endpoint's engine actor (serve.preset gpu),
against a real `EngineActor` on a local Ray cluster and the same engine in this process
(tests/serve/test_serve_presets.py runs it behind Serve)."""

from __future__ import annotations

import asyncio
import copy
import os

import pytest

from whale_ray.config import PolicyConfig, SandboxConfig, ServeConfig
from whale_ray.policy.engine import GenerationRequest
from whale_ray.policy.transformers_engine import TransformersEngine
from whale_ray.records import SamplingParams


@pytest.fixture
def engine_actor(ray_cluster, tiny_policy):
    """An `EngineActor` on the session's cluster, killed after the test: it holds one of the cluster's CPUs, which
    the tests after this one need."""
    from whale_ray.policy.restart import Weights
    from whale_ray.serve.engines import EngineActor
    from whale_ray.serve.spec import for_model

    spec = for_model(tiny_policy, domain="math_reasoning", harness=None, policy=PolicyConfig(device="cpu"),
                     sandbox=SandboxConfig(), serve=ServeConfig(preset="gpu", engine_cpus=1, engine_gpus=0))
    actor = EngineActor.options(num_cpus=1).remote({"whale": Weights(0, tiny_policy)}, spec)
    yield actor
    ray_cluster.kill(actor)


def _requests(n: int, max_tokens: int = 16) -> list[GenerationRequest]:
    return [GenerationRequest([{"role": "user", "content": f"What is {i} + {2 * i}?"}],
                              SamplingParams(max_tokens=max_tokens, temperature=1.0, top_k=20, seed=i)) for i in range(n)]


@pytest.mark.parametrize("node", ["here", "elsewhere"])  # a replica on the actor's node (Unix socket) or not (TCP)
def test_concurrent_requests_cross_in_one_frame_and_equal_the_engine_in_process(ray_cluster, tiny_policy, engine_actor,
                                                                                node):
    from whale_ray.serve.channel import Channel

    requests = _requests(24)
    expected = TransformersEngine(tiny_policy, device="cpu").generate(copy.deepcopy(requests))
    streamed: dict[int, list[tuple[int, int]]] = {i: [] for i in range(0, 24, 3)}
    for i in streamed:
        requests[i].on_token = lambda t, v, i=i: streamed[i].append((t, v))

    async def go():
        channel = Channel(engine_actor, node_id=None if node == "here" else "a-node-id-of-another-node")
        outs = await asyncio.gather(*(channel.complete("whale", r) for r in requests))
        again = await channel.complete("whale", _requests(1)[0])  # the reader, started by the first batch, goes on
        return outs, again, channel.writer.get_extra_info("peername"), channel.timing

    outs, again, peer, trips = asyncio.run(go())
    assert isinstance(peer, (str, bytes)) == (node == "here"), peer  # a Unix socket's name, or (host, port)
    assert [o.completion_ids for o in outs] == [e.completion_ids for e in expected]
    assert [o.text for o in outs] == [e.text for e in expected]
    assert again.completion_ids == expected[0].completion_ids
    for i, tokens in streamed.items():  # every token streamed, in order, before the output came
        assert [t for t, _ in tokens] == outs[i].completion_ids and {v for _, v in tokens} == {0}
    stats = ray_cluster.get(engine_actor.stats.remote("whale"))
    assert stats["submits"] == 2 and stats["in_flight"] == 0  # 24 requests in one frame, then the 25th
    # each request's seconds: in the engine, within the actor's part, within the channel's round trip
    assert stats["finished"] == stats["answered"] == trips["round_trips"] == 25, (stats, trips)
    assert 0 < stats["latency_s"] < stats["actor_s"] < trips["round_trip_s"], (stats, trips)


def _long(tiny_policy: str) -> list[tuple[GenerationRequest, int]]:
    """Seeded requests that run for 200 tokens or more (sampled hot, so the tiny policy's eos comes late), each with
    its length in process."""
    requests = [GenerationRequest([{"role": "user", "content": "Count."}],
                                  SamplingParams(max_tokens=400, temperature=3.0, top_k=0, seed=s)) for s in range(16)]
    outs = TransformersEngine(tiny_policy, device="cpu").generate(copy.deepcopy(requests))
    long = [(r, len(o.completion_ids)) for r, o in zip(requests, outs) if len(o.completion_ids) >= 200]
    assert len(long) >= 3, [len(o.completion_ids) for o in outs]
    return long


def test_a_cancelled_request_leaves_the_engine_and_errors_name_their_cause(ray_cluster, tiny_policy, engine_actor):
    from whale_ray.serve.channel import Channel, EngineLost

    long = _long(tiny_policy)

    async def go():
        channel = Channel(engine_actor)
        first = asyncio.Event()
        request, length = long[0]
        request.on_token = lambda t, v: first.set()
        task = asyncio.ensure_future(channel.complete("whale", request))
        await asyncio.wait_for(first.wait(), 120)
        task.cancel()  # as Serve does when the client goes away
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(600):
            stats = ray_cluster.get(engine_actor.stats.remote("whale"))
            if stats["in_flight"] == 0:
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the cancelled request is still in flight in the engine actor")
        assert stats["tokens"] < length, stats  # its row left the engine before its end
        bad = GenerationRequest([{"role": "user", "content": "x"}], SamplingParams(max_tokens=4), prompt_ids=[-1])
        with pytest.raises(ValueError, match="prompt_ids must be a non-empty list of token ids"):
            await channel.complete("whale", bad)  # the engine's refusal, as a ValueError (the replica's 400)
        ok = await channel.complete("whale", _requests(1)[0])  # and the channel goes on
        started = [asyncio.Event() for _ in long]
        for (r, _), e in zip(long, started):
            r.on_token = lambda t, v, e=e: e.set()
        pending = [asyncio.ensure_future(channel.complete("whale", r)) for r, _ in long]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)
        ray_cluster.kill(engine_actor)  # the engine actor dies with requests in flight: each fails, naming it
        errors = await asyncio.gather(*pending, return_exceptions=True)
        return ok, errors

    ok, errors = asyncio.run(go())
    assert ok.completion_ids
    assert all(isinstance(e, EngineLost) and "engine actor" in str(e) for e in errors), errors


def test_the_link_unpickles_nothing_before_the_key_and_cancels_what_a_closed_connection_left(ray_cluster, tiny_policy,
                                                                                             engine_actor, tmp_path):
    import pickle
    import struct

    from whale_ray.serve.channel import SUBMIT, Channel, EngineLost

    class Touch:  # unpickling this runs os.system
        def __reduce__(self):
            return os.system, (f"touch {tmp_path / 'ran'}",)

    long = _long(tiny_policy)

    async def go():
        _, path, key = await engine_actor.link.remote(ray_cluster.get_runtime_context().get_node_id())
        for first in (b"x" * len(key), b"short"):  # a wrong key; too few bytes, then the end
            reader, writer = await asyncio.open_unix_connection(path)
            body = pickle.dumps((SUBMIT, "whale", [(0, Touch(), False)]))
            writer.write(first + struct.pack(">I", len(body)) + body)
            writer.write_eof()
            assert await asyncio.wait_for(reader.read(), 30) == b""  # closed, with nothing sent back
            writer.close()
        reader, writer = await asyncio.open_unix_connection(path)  # the key, then a frame not of the protocol
        body = pickle.dumps("not a message")
        writer.write(key + struct.pack(">I", len(body)) + body)
        assert await asyncio.wait_for(reader.read(), 30) == b""
        writer.close()
        assert not os.path.exists(path)  # a connection with the key closed its listener, and its file went
        channel = Channel(engine_actor)
        started = [asyncio.Event() for _ in long]
        for (r, _), e in zip(long, started):
            r.on_token = lambda t, v, e=e: e.set()
        pending = [asyncio.ensure_future(channel.complete("whale", r)) for r, _ in long]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)
        channel.writer.close()  # the replica's end goes away with requests in flight
        errors = await asyncio.gather(*pending, return_exceptions=True)
        for _ in range(600):
            stats = await engine_actor.stats.remote("whale")
            if stats["in_flight"] == 0:
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError(f"the closed connection's requests are still in flight in the engine actor: {stats}")
        ok = await channel.complete("whale", _requests(1)[0])  # the next request connects afresh
        return errors, stats, ok

    errors, stats, ok = asyncio.run(go())
    assert not (tmp_path / "ran").exists()
    assert all(isinstance(e, EngineLost) and "engine actor" in str(e) for e in errors), errors
    assert stats["tokens"] < sum(n for _, n in long), stats  # their rows left the engine before their ends
    assert ok.completion_ids
