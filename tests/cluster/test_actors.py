"""PolicyServer and the SandboxEvaluator pool as real Ray actors, on the embedded policy."""

from __future__ import annotations

import ray
import torch

from actors.evaluator_pool import EvaluatorPool
from actors.policy_server import PolicyServer
from actors.sandbox_evaluator import EpisodeJob
from whale_ray.config import DataConfig, SandboxConfig
from whale_ray.domain import get_domain
from whale_ray.loop import EpisodeWork
from whale_ray.records import SamplingParams


def test_policy_server_batches_distinct_requests_each_to_its_caller(ray_cluster, tiny_policy):
    """Distinct concurrent requests (prompts, budgets, temperatures, seeds): each reply equals a solo generate of
    the same request on the same checkpoint and carries its own messages, so a batcher that swapped or mixed
    replies between callers fails. Then weights swapped in place, and the new version named."""
    from whale_ray.policy.engine import GenerationRequest
    from whale_ray.policy.transformers_engine import TransformersEngine

    server = PolicyServer.remote(tiny_policy, max_batch=32, batch_wait_ms=200)
    reqs = [GenerationRequest(
        [{"role": "system", "content": "Solve the problem."}, {"role": "user", "content": f"What is {i} + {3 * i}?" + " Hm." * (i % 4)}],
        SamplingParams(max_tokens=3 + i % 7, temperature=[1.0, 0.7, 0.0][i % 3], top_k=[0, 20, 5][i % 3], seed=1000 + i),
    ) for i in range(24)]
    calls = ray.get([server.generate.remote(r.messages, r.sampling) for r in reqs])
    stats = ray.get(server.stats.remote())
    assert stats["requests"] == 24 and stats["batches"] < 24  # gathered, not one pass per request
    solo = TransformersEngine(tiny_policy, device="cpu")
    for call, req in zip(calls, reqs):
        ref = solo.generate([req])[0]
        assert call.messages == req.messages and call.weight_version == 0
        assert (call.prompt_ids, call.completion_ids, call.text, call.finish_reason) == \
            (ref.prompt_ids, ref.completion_ids, ref.text, ref.finish_reason)
        assert torch.allclose(torch.tensor(call.logprobs), torch.tensor(ref.logprobs), atol=1e-4)
    assert len({tuple(c.completion_ids) for c in calls}) > 12  # the requests really differ

    weights = {k: torch.zeros_like(v) for k, v in solo.state_dict().items()}
    assert ray.get(server.load_weights.remote(ray.put(weights), 7)) == 7
    after = ray.get(server.generate.remote(reqs[0].messages, reqs[0].sampling))
    solo.load_weights(weights, 7)
    assert after.weight_version == 7 and after.completion_ids == solo.generate([reqs[0]])[0].completion_ids
    ray.kill(server)


BROKEN = "def run(task, agent):\n    return 1 / 0\n"


def test_evaluator_pool_runs_episodes_and_survives_failures(ray_cluster, tiny_policy):
    server = PolicyServer.remote(tiny_policy)
    pool = EvaluatorPool("math_reasoning", server, SandboxConfig(slots=4, evaluators=2))
    domain = get_domain("math_reasoning")
    tasks = domain.load_splits(DataConfig(), 0).harness[:6]
    jobs = [EpisodeJob(task=t, seed=i) for i, t in enumerate(tasks)]
    node = ray.get_runtime_context().get_node_id()

    def run(p, code):
        done = []
        (results,) = p.run([EpisodeWork(code, "h.py", jobs)], done.append)
        assert sum(done) == len(jobs)
        return results

    broken = run(pool, BROKEN)
    assert [r.status for r in broken] == ["harness_exception"] * 6
    assert "ZeroDivisionError" in broken[0].reason
    good = run(pool, domain.h0_path.read_text())
    assert len(good) == 6 and all(r.status == "ok" for r in good)
    assert all(r.calls and r.calls[0].prompt_ids for r in good)  # recorded on the trusted side
    assert {r.node for r in good} == {node}  # each result names where it ran
    one = EvaluatorPool("math_reasoning", server, SandboxConfig(slots=4, evaluators=1))
    again = run(one, domain.h0_path.read_text())
    # Same episode seeds, a different batching (one evaluator): every call samples the same tokens.
    assert one.size == 1 and [[c.completion_ids for c in r.calls] for r in again] == \
        [[c.completion_ids for c in r.calls] for r in good]
    for actor in [server, *pool.actors, *one.actors]:
        ray.kill(actor)
