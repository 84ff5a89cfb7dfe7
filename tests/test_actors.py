"""PolicyServer and the SandboxEvaluator pool as real Ray actors, on the embedded policy."""

from __future__ import annotations

import ray
import torch

from actors.policy_server import PolicyServer
from actors.sandbox_evaluator import EpisodeJob, EvaluatorPool
from whale_ray.config import DataConfig, SandboxConfig
from whale_ray.domain import get_domain
from whale_ray.records import SamplingParams


def test_policy_server_batches_concurrent_requests_and_swaps_weights(ray_cluster, tiny_policy):
    server = PolicyServer.remote(tiny_policy, max_batch=32, batch_wait_ms=50)
    messages = [{"role": "system", "content": "Solve the problem."}, {"role": "user", "content": "What is 2 + 3?"}]
    calls = ray.get([server.generate.remote(messages, SamplingParams(max_tokens=8)) for _ in range(24)])
    stats = ray.get(server.stats.remote())
    assert stats["requests"] == 24 and stats["batches"] < 24  # gathered, not one pass per request
    for call in calls:
        assert call.weight_version == 0
        assert call.prompt_ids and 0 < len(call.completion_ids) <= 8
        assert len(call.logprobs) == len(call.completion_ids)

    from transformers import AutoModelForCausalLM

    weights = {k: torch.zeros_like(v) for k, v in AutoModelForCausalLM.from_pretrained(tiny_policy).state_dict().items()}
    assert ray.get(server.load_weights.remote(ray.put(weights), 7)) == 7
    after = ray.get(server.generate.remote(messages, SamplingParams(max_tokens=4)))
    assert after.weight_version == 7
    ray.kill(server)


BROKEN = "def run(task, agent):\n    return 1 / 0\n"


def test_evaluator_pool_runs_episodes_and_survives_failures(ray_cluster, tiny_policy):
    server = PolicyServer.remote(tiny_policy)
    pool = EvaluatorPool("math_reasoning", server, SandboxConfig(slots=4, evaluators=2))
    domain = get_domain("math_reasoning")
    tasks = domain.load_splits(DataConfig(), 0).harness[:6]
    jobs = [EpisodeJob(task=t, seed=i) for i, t in enumerate(tasks)]

    def run(code):
        results = []
        for _, ref in pool.submit(code, "h.py", jobs):
            results += ray.get(ref)
        return results

    broken = run(BROKEN)
    assert [r.status for r in broken] == ["harness_exception"] * 6
    assert "ZeroDivisionError" in broken[0].reason
    good = run(domain.h0_path.read_text())
    assert len(good) == 6 and all(r.status == "ok" for r in good)
    assert all(r.calls and r.calls[0].prompt_ids for r in good)  # recorded on the trusted side
    pool.resize(1)
    again = run(domain.h0_path.read_text())
    # Same episode seeds, a different batching (one evaluator): every call samples the same tokens.
    assert pool.size == 1 and [[c.completion_ids for c in r.calls] for r in again] == \
        [[c.completion_ids for c in r.calls] for r in good]
    ray.kill(server)
