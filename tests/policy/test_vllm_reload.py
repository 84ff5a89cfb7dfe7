"""CopyPlan (whale_ray/policy/vllm_reload.py) on CPU, over modules that load the way vLLM's models do: packed
parameters filled slice by slice by weight loaders, an embedding's padding rows zeroed. The plan on vLLM itself is tested on the GPU
(tests/policy/test_vllm_gpu.py); here, what it accepts, what it refuses and why, and that a replay equals a load."""

from __future__ import annotations

import pytest
import torch

from whale_ray.policy.vllm_reload import CopyPlan


class Packed(torch.nn.Module):
    """q, k, v packed into the rows of one bfloat16 parameter, as vLLM's QKVParallelLinear; `how` picks a loader."""

    def __init__(self, how: str = "copy"):
        super().__init__()
        self.qkv = torch.nn.Parameter(torch.zeros(12, 4, dtype=torch.bfloat16), requires_grad=False)
        self.norm = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16), requires_grad=False)
        self.emb = torch.nn.Parameter(torch.zeros(6, 4, dtype=torch.bfloat16), requires_grad=False)  # 5 + padding
        self.how = how

    def load_weights(self, weights) -> None:
        for name, w in weights:
            if name == "emb":  # as vLLM's VocabParallelEmbedding: the rows, then zeros past the vocabulary
                self.emb[: w.shape[0]].data.copy_(w)
                self.emb[w.shape[0]:].data.fill_(0)
                continue
            if name == "norm":
                if self.how == "replace":
                    self.norm.data = w.to(torch.bfloat16)  # new memory: recorded views would be stale
                else:
                    self.norm.data.copy_(w)
                continue
            i = "qkv".index(name)
            if self.how == "skip_v" and name == "v":
                continue
            rows = self.qkv.data.narrow(0, 4 * i, 4)
            if self.how == "cast_first":
                rows.copy_(w.to(torch.bfloat16))  # a tensor the replay never sees
            elif self.how == "scale":
                rows.copy_(w * 2)
            else:
                rows.copy_(w.narrow(0, 0, 4))  # a loader's no-op shard narrow: still the whole tensor


def weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(n, torch.randn(4, 4, generator=g)) for n in "qkv"] + [("norm", torch.randn(4, generator=g)),
                                                                   ("emb", torch.randn(5, 4, generator=g))]


def test_a_replay_writes_what_the_loader_writes():
    model, twin = Packed(), Packed()
    first = weights(0)
    model.load_weights(first)  # what vLLM's reload left (same loader here)
    plan, why = CopyPlan.record(model, first)
    assert plan is not None and why == "" and len(plan.targets) == 5 and len(plan.fills) == 1
    second = weights(1)
    model.emb.data[5:] = 7.0  # the padding's memory after a level-2 sleep holds anything: the replay fills it again
    plan.apply(dict(second))
    twin.load_weights(second)
    assert all(torch.equal(getattr(model, n), getattr(twin, n)) for n in ("qkv", "norm", "emb"))
    assert not torch.equal(model.qkv, Packed().qkv)


@pytest.mark.parametrize("how, why", [
    ("cast_first", "copy_ into qkv not from a whole incoming tensor"),
    ("scale", "copy_ into qkv not from a whole incoming tensor"),
    ("skip_v", "the writes into qkv cover 32 of its 48 elements"),
    ("replace", "the load gave norm new memory"),
])
def test_a_load_the_replay_cannot_repeat_is_refused_with_the_reason(how, why):
    model = Packed(how)
    first = weights(0)
    model.load_weights(first)
    plan, got = CopyPlan.record(model, first)
    assert plan is None and why in got


def test_a_loader_that_disagrees_with_the_reload_before_it_is_refused():
    model = Packed()
    model.load_weights(weights(0))
    plan, why = CopyPlan.record(model, weights(1))  # not the weights the "reload" just loaded
    assert plan is None and "other values than vLLM's reload for qkv" in why
