"""The Trainer actor on a real local Ray cluster (2 CPUs): steps, weights as object refs, checkpoints,
data-parallel equivalence, and a clean release of the Ray Train workers."""

from __future__ import annotations

import json
import time

import pytest
import ray
import torch

from actors.trainer import LocalTrainer, StaleTrainer, Trainer
from tests.helpers import live_placement_groups, trainer_actor
from whale_ray.config import WeightPhaseConfig

CFG = WeightPhaseConfig(learning_rate=1e-2, micro_batch=2, sft_epochs_per_step=1, num_workers=1)
EXAMPLES = [([1, 2, 3], [4, 5, 6, 7]), ([8, 9], [10, 11]), ([12], [13, 14, 15, 16, 17]), ([3, 3, 3], [7])]
MORE = [([5, 6, 7], [8, 9]), ([10], [11, 12, 13])]


@pytest.fixture(scope="module")
def cluster(ray_cluster):
    return ray_cluster


@pytest.fixture(scope="module")
def trainer(cluster, tiny_model, tmp_path_factory):
    with trainer_actor(tiny_model, CFG, tmp_path_factory.mktemp("trainer")) as t:
        yield t


def _weights(trainer, version: int | None = None) -> dict[str, torch.Tensor]:
    """The state dict behind the Trainer's object ref (a weight sync hands the ref on unread)."""
    (ref,) = ray.get(trainer.host_weights.remote(version))
    return ray.get(ref)


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_train_step_returns_metrics_and_bumps_version(trainer, tiny_model):
    from transformers import AutoModelForCausalLM

    initial = _weights(trainer)
    assert _same(initial, AutoModelForCausalLM.from_pretrained(tiny_model).state_dict())
    v0 = ray.get(trainer.version.remote())
    m = ray.get(trainer.train_step.remote(EXAMPLES))
    assert m["trained"] and m["version"] == v0 + 1 and m["n_examples"] == 4 and m["n_tokens"] == 12
    assert m["loss"] > 0 and m["grad_norm"] > 0
    # where the step's time went: the queue to the worker, the worker's parts, the way back; within the Trainer's clock
    parts = ("to_worker_s", "worker_step_s", "worker_share_s", "worker_free_s", "to_trainer_s")
    assert 0 < m["worker_step_s"] and min(m[k] for k in parts) >= 0 and "replied_at" not in m
    assert m["cuda_mallocs"] == 0 and m["cache_emptied"] is False  # on CPU
    assert sum(m[k] for k in parts) <= m["wall_s"] + 0.01  # two clocks: wall time for the legs, perf_counter for wall_s
    with pytest.raises(ValueError, match="vocabulary"):  # rejected on the workers; the run goes on
        ray.get(trainer.train_step.remote([([1], [999])]))
    empty = ray.get(trainer.train_step.remote([]))
    assert empty["trained"] is False and empty["version"] == v0 + 1 and empty["n_examples"] == 0

    after = _weights(trainer)
    assert not _same(initial, after)


def completion_logprobs(model, call) -> list[float]:
    """Raw log-probs of a call's completion tokens under `model` (one forward over prompt + completion)."""
    ids = torch.tensor([call.prompt_ids + call.completion_ids])
    with torch.no_grad():
        logp = model(ids).logits[0].float().log_softmax(-1)
    n = len(call.prompt_ids)
    return [float(logp[n - 1 + i, t]) for i, t in enumerate(call.completion_ids)]


def test_new_weights_reach_the_real_policy_server(cluster, tiny_policy, tmp_path):
    """The ref from the Trainer goes straight to the PolicyServer, which generates with exactly those weights."""
    from transformers import AutoModelForCausalLM

    from actors.policy_server import PolicyServer
    from whale_ray.records import SamplingParams

    messages = [{"role": "user", "content": "A jar has 4 apples. Ann removes 1. How many apples are in the jar now?"}]
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    trainer = Trainer.remote(tiny_policy, CFG, str(tmp_path / "trainer"))
    policy = PolicyServer.remote(tiny_policy, engine="transformers", max_batch=4, batch_wait_ms=1.0, device="cpu")
    try:
        before = ray.get(policy.generate.remote(messages, greedy))
        assert before.weight_version == 0 and before.completion_ids
        # train towards another completion of the same prompt, so the greedy reply has to move
        m = ray.get(trainer.train_step.remote([(before.prompt_ids, [before.completion_ids[0]] * 6)] * 4))
        assert m["trained"] and m["version"] == 1
        (ref,) = ray.get(trainer.host_weights.remote(m["version"]))
        assert ray.get(policy.load_weights.remote(ref, m["version"])) == 1
        after = ray.get(policy.generate.remote(messages, greedy))
        assert after.weight_version == 1 and ray.get(policy.version.remote()) == 1
        weights = ray.get(ref)
    finally:
        ray.get(trainer.shutdown.remote())
        ray.kill(policy)
    base = AutoModelForCausalLM.from_pretrained(tiny_policy)
    trained = AutoModelForCausalLM.from_pretrained(tiny_policy)
    trained.load_state_dict(weights)
    # the served log-probs are those of the trained weights, not of the base model
    assert after.logprobs == pytest.approx(completion_logprobs(trained, after), abs=1e-4)
    assert before.logprobs == pytest.approx(completion_logprobs(base, before), abs=1e-4)
    assert completion_logprobs(base, after) != pytest.approx(after.logprobs, abs=1e-2)


def test_checkpoint_loads_in_transformers_and_resumes_exactly(trainer, tmp_path):
    from transformers import AutoModelForCausalLM

    ray.get(trainer.train_step.remote(EXAMPLES))
    path = ray.get(trainer.save_checkpoint.remote(str(tmp_path / "ckpt")))
    saved = _weights(trainer)
    v = ray.get(trainer.version.remote())
    assert _same(AutoModelForCausalLM.from_pretrained(path).state_dict(), saved)
    assert json.loads((tmp_path / "ckpt" / "tokenizer_config.json").read_text()) == {"marker": "tok"}

    m1 = ray.get(trainer.train_step.remote(MORE))
    w1 = _weights(trainer)
    ray.get(trainer.train_step.remote(MORE))  # move further away
    ray.get(trainer.load_checkpoint.remote(path))
    assert ray.get(trainer.version.remote()) == v
    assert _same(_weights(trainer), saved)
    m2 = ray.get(trainer.train_step.remote(MORE))  # the same step again from the same state: same result
    assert m2["version"] == m1["version"] == v + 1 and m2["loss"] == m1["loss"]
    assert _same(_weights(trainer), w1)


def test_a_checkpoint_written_in_the_background_holds_the_step_it_was_begun_at(trainer, tmp_path):
    """save_checkpoint(wait=False) returns while rank 0 writes; a step asked for meanwhile waits for the write, so
    the checkpoint holds the weights of its own version; checkpoint_written names it once it is whole, and a path
    that is not being written is refused (the Trainer was restarted since: that write is gone)."""
    from transformers import AutoModelForCausalLM

    v = ray.get(trainer.version.remote())
    saved = _weights(trainer, v)
    path = ray.get(trainer.save_checkpoint.remote(str(tmp_path / "bg"), v, wait=False))
    m = ray.get(trainer.train_step.remote(MORE, v))  # the Trainer waits for the write before it steps
    assert m["version"] == v + 1
    assert _same(AutoModelForCausalLM.from_pretrained(path).state_dict(), saved)
    assert json.loads((tmp_path / "bg" / "rsft_state.json").read_text())["step"] == v
    with pytest.raises(StaleTrainer, match="not writing"):  # already waited for, by the step
        ray.get(trainer.checkpoint_written.remote(path))
    path = ray.get(trainer.save_checkpoint.remote(str(tmp_path / "bg2"), v + 1, wait=False))
    assert ray.get(trainer.checkpoint_written.remote(path)) == path
    assert json.loads((tmp_path / "bg2" / "rsft_state.json").read_text())["step"] == v + 1
    ray.get(trainer.load_checkpoint.remote(str(tmp_path / "bg")))  # back to where the test began
    assert ray.get(trainer.version.remote()) == v and _same(_weights(trainer, v), saved)


def test_a_call_meant_for_another_weight_version_is_refused(trainer, tmp_path):
    """The guard that keeps a Trainer back from an older state (after a fault) from training, saving or
    handing out the wrong weights: every call naming a version it does not hold is refused, nothing changes."""
    v = ray.get(trainer.version.remote())
    before = _weights(trainer, v)
    for call in (trainer.train_step.remote(MORE, v + 1), trainer.host_weights.remote(v - 1),
                 trainer.save_checkpoint.remote(str(tmp_path / "wrong"), v + 3)):
        with pytest.raises(StaleTrainer, match=f"holds weight version {v}"):
            ray.get(call)
    assert ray.get(trainer.version.remote()) == v and not (tmp_path / "wrong").exists()
    assert _same(_weights(trainer, v), before)
    m = ray.get(trainer.train_step.remote(MORE, v))  # the right version: trains
    assert m["trained"] and m["version"] == v + 1


def test_release_workers_then_continue(trainer):
    before = _weights(trainer)
    v = ray.get(trainer.version.remote())
    ray.get(trainer.release_workers.remote())
    assert _same(_weights(trainer), before)  # served without workers
    m = ray.get(trainer.train_step.remote(MORE))  # restarts the Ray Train run from the saved state
    assert m["trained"] and m["version"] == v + 1
    assert m["workers_start_s"] > 0 and m["wall_s"] >= m["workers_start_s"]  # the start, inside the step
    again = ray.get(trainer.train_step.remote(MORE))
    assert again["workers_start_s"] == 0.0


def test_workers_started_ahead_of_the_first_step_are_not_its_cost(trainer):
    """The Coordinator asks for the workers without waiting (beside the first evaluation): the step that follows
    finds them up, and a second ask is a no-op."""
    ray.get(trainer.release_workers.remote())
    started = ray.get(trainer.start_workers.remote())
    assert started > 0 and ray.get(trainer.start_workers.remote()) == 0.0
    m = ray.get(trainer.train_step.remote(MORE))
    assert m["trained"] and m["workers_start_s"] == 0.0


def test_two_workers_match_one_process_and_leave_nothing_behind(cluster, tiny_model, tmp_path):
    cfg = CFG.model_copy(update={"num_workers": 2})
    local = LocalTrainer(str(tiny_model), cfg, str(tmp_path / "local"))
    ddp = Trainer.remote(str(tiny_model), cfg, str(tmp_path / "ddp"))
    try:
        for batch in (EXAMPLES + MORE, EXAMPLES[:1]):  # the second leaves rank 1 without examples
            m, ml = ray.get(ddp.train_step.remote(batch)), local.train_step(batch)
            assert m["version"] == ml["version"] and m["n_tokens"] == ml["n_tokens"]
            assert m["loss"] == pytest.approx(ml["loss"], rel=1e-5)
            w, wl = _weights(ddp), local.state_dict()
            for k in wl:
                torch.testing.assert_close(w[k], wl[k], atol=1e-4, rtol=1e-4)
    finally:
        ray.get(ddp.shutdown.remote())
    ddp_groups = [pg["state"] for pg in ray.util.placement_group_table().values() if len(pg["bundles"]) == 2]
    assert ddp_groups and all(state == "REMOVED" for state in ddp_groups)


def test_the_group_of_a_trainer_killed_with_its_workers_is_freed_by_the_next_start(cluster, tiny_model, tmp_path):
    """A Trainer killed while its Ray Train run is up takes the run's controller with it, and the workers' placement
    group stays reserved (Ray Train's own cleaner needs the state API, which this cluster, like `whale run`'s, runs
    without): the next Trainer to start workers frees it, and says so in its run's events."""
    from ray._private import state
    from ray.core.generated import gcs_pb2

    from whale_ray.events import read_events

    def creator_dead(group: str) -> bool:
        raw = state.state._connect_and_get_accessor().get_placement_group_info(ray.PlacementGroupID.from_hex(group))
        return gcs_pb2.PlacementGroupTableData.FromString(raw).creator_actor_dead

    before = live_placement_groups()
    lost = Trainer.remote(str(tiny_model), CFG, str(tmp_path / "lost"))
    assert ray.get(lost.start_workers.remote()) > 0
    (group,) = live_placement_groups() - before
    ray.kill(lost, no_restart=True)
    deadline = time.monotonic() + 60
    while not creator_dead(group) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert creator_dead(group) and group in live_placement_groups()  # reserved for no one

    nxt = Trainer.remote(str(tiny_model), CFG, str(tmp_path / "next"), events_dir=str(tmp_path / "events"))
    try:
        assert ray.get(nxt.start_workers.remote()) > 0
        assert group not in live_placement_groups()
        (freed,) = [e for e in read_events(tmp_path / "events") if e["kind"] == "trainer_workers_freed"]
        assert group in freed["groups"]
    finally:
        ray.get(nxt.shutdown.remote())
        ray.kill(nxt)
