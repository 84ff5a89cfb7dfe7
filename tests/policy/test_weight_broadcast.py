"""weight.weight_sync broadcast on the CPU (gloo): the group in one process, then the Trainer's rank 0 and real
PolicyServer replicas on a real local Ray cluster (bit-for-bit weights, versions, greedy outputs against the
object store's path; a replica restarted by Ray and one lost for good), then a whole run."""

from __future__ import annotations

import json
import threading
import time

import pyarrow.parquet as pq
import pytest
import ray
import torch

from tests.helpers import trainer_actor
from whale_ray.config import WeightBroadcastConfig, WeightPhaseConfig
from whale_ray.policy.weight_broadcast import GroupSpec, Receiver, Sender, WeightBroadcastError, plan
from whale_ray.records import SamplingParams

MESSAGES = [{"role": "user", "content": "A jar has 4 apples. Ann removes 1. How many apples are in the jar now?"}]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
TIMEOUT_S = 15.0
CFG = WeightPhaseConfig(learning_rate=1e-2, micro_batch=2, num_workers=1, weight_sync="broadcast",
                        broadcast=WeightBroadcastConfig(timeout_s=TIMEOUT_S, bucket_mb=1))


# ------------------------------------------------------------------------------------------- the group alone
def _state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    emb = torch.randn(300, 64)
    return {"embed.weight": emb, "proj.weight": torch.randn(64, 64), "norm.weight": torch.rand(64).half(),
            "steps": torch.arange(5, dtype=torch.int64), "lm_head.weight": emb}  # tied to embed, sent once


def _receive(spec: GroupSpec, rank: int, version: int, out: dict) -> None:
    try:
        out[rank] = Receiver().receive(spec, rank, version)
    except WeightBroadcastError as e:
        out[rank] = e


def test_plan_packs_in_order_sends_shared_storage_once_and_splits_buckets():
    state = _state()
    layout = plan(state, bucket_bytes=64 << 10)
    by = {s.name: s for s in layout.slots}
    assert [s.name for s in layout.slots] == list(state)
    assert (by["lm_head.weight"].bucket, by["lm_head.weight"].offset) == (by["embed.weight"].bucket, 0)
    assert len(layout.sizes) == 2 and by["proj.weight"].bucket == 1  # the 75 KiB embedding fills the first
    assert sum(layout.sizes) < sum(t.numel() * t.element_size() for t in state.values())  # the tie is not resent


def test_gloo_broadcast_is_bit_for_bit_and_a_missing_member_is_named_within_the_timeout():
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    state, sender, out = _state(), Sender(), {}
    spec = GroupSpec("127.0.0.1", store.port, 1, 3, "gloo", 5.0, 16 << 10)
    threads = [threading.Thread(target=_receive, args=(spec, r, 7, out)) for r in (1, 2)]
    for t in threads:
        t.start()
    assert sender.send(spec, state, 7) == sum(plan(state, 16 << 10).sizes)
    for t in threads:
        t.join()
    for rank in (1, 2):
        got = out[rank]
        assert got.keys() == state.keys()
        assert all(got[k].dtype == v.dtype and torch.equal(got[k], v) for k, v in state.items())
    assert sender.group() == spec.key

    # generation 2 with a member that never comes: both who came fail, named, within the timeout; nobody hangs
    spec2 = GroupSpec("127.0.0.1", store.port, 2, 3, "gloo", 3.0, 16 << 10)
    t = threading.Thread(target=_receive, args=(spec2, 1, 8, out))
    t0 = time.monotonic()
    t.start()
    with pytest.raises(WeightBroadcastError, match=r"Trainer rank 0 \(rank 0\): sending version 8 failed in group "
                                                   r"generation 2"):
        sender.send(spec2, state, 8)
    t.join()
    assert time.monotonic() - t0 < 3.0 + 5
    assert isinstance(out[1], WeightBroadcastError) and "replica (rank 1): receiving version 8" in str(out[1])
    assert sender.group() is None  # a failed member forgets its group: the next broadcast builds another


# -------------------------------------------------------------------------------------- Trainer and replicas
@pytest.fixture(scope="module")
def trainer(ray_cluster, tiny_policy, tmp_path_factory):
    with trainer_actor(tiny_policy, CFG, tmp_path_factory.mktemp("bcast-trainer")) as t:
        yield t


def _replica(tiny_policy, restarts: int = 0):
    from actors.policy_server import PolicyServer

    return PolicyServer.options(max_restarts=restarts, max_task_retries=restarts).remote(
        tiny_policy, engine="transformers", max_batch=4, batch_wait_ms=1.0, device="cpu")


def _served_weights(replica) -> dict[str, torch.Tensor]:
    return ray.get(replica.__ray_call__.remote(
        lambda self: {k: v.detach().clone() for k, v in self._service.engine.model.state_dict().items()}))


def _step(trainer, version: int, towards=None) -> int:
    """One RSFT step (towards another greedy reply than `towards`, a ModelCall, where given); the new version."""
    examples = [([3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14])] * 4
    if towards is not None:
        examples = [(towards.prompt_ids, [towards.completion_ids[0]] * 6)] * 4
    m = ray.get(trainer.train_step.remote(examples, version))
    assert m["trained"] and m["version"] == version + 1
    return m["version"]


def _trained(trainer, version: int) -> dict[str, torch.Tensor]:
    """The Trainer's weights of `version`, through the object store (asked for here only)."""
    (ref,) = ray.get(trainer.host_weights.remote(version))
    return ray.get(ref)


def _sync(trainer, replicas, cfg=CFG.broadcast, events=None):
    from actors.broadcast_sync import BroadcastSync

    return BroadcastSync(trainer, replicas, version=ray.get(trainer.version.remote()), cfg=cfg, use_gpu=False,
                         events=events)


def test_both_replicas_get_the_trainers_weights_bit_for_bit_and_serve_as_the_object_stores_path(trainer, tiny_policy):
    replicas = [_replica(tiny_policy) for _ in range(2)]
    reference = _replica(tiny_policy)
    try:
        before = ray.get(replicas[0].generate.remote(MESSAGES, GREEDY))
        v = _step(trainer, ray.get(trainer.version.remote()), towards=before)
        sync = _sync(trainer, replicas)
        sync.push(v)
        assert sync.last["by"] == "broadcast" and sync.generation == 1
        assert ray.get([r.version.remote() for r in replicas]) == [v, v]
        key = (sync.host, sync.port, 1)
        assert ray.get([r.broadcast_group.remote() for r in [trainer, *replicas]]) == [key] * 3

        trained = _trained(trainer, v)
        for r in replicas:
            served = _served_weights(r)
            assert all(torch.equal(served[k], trained[k]) for k in trained)
        assert ray.get(reference.load_weights.remote(trained, v)) == v
        outs = ray.get([r.generate.remote(MESSAGES, GREEDY) for r in [*replicas, reference]])
        # the step moved the model on this prompt (a tiny policy's greedy reply may not show it; its log-probs do)
        assert outs[0].logprobs != pytest.approx(before.logprobs, abs=1e-3)
        for out in outs[:2]:
            assert out.weight_version == v
            assert (out.completion_ids, out.logprobs) == (outs[2].completion_ids, outs[2].logprobs)

        v2 = _step(trainer, v)  # the next version goes over the same group
        sync.push(v2)
        assert sync.generation == 1 and ray.get([r.version.remote() for r in replicas]) == [v2, v2]
        trained = _trained(trainer, v2)
        assert all(torch.equal(_served_weights(replicas[1])[k], trained[k]) for k in trained)
    finally:
        for r in [*replicas, reference]:
            ray.kill(r)


def test_a_replica_restarted_by_ray_rejoins_and_one_lost_for_good_is_named_within_the_timeout(trainer, tiny_policy):
    a, b = (_replica(tiny_policy, restarts=1) for _ in range(2))
    try:
        sync = _sync(trainer, [a, b])
        v = _step(trainer, ray.get(trainer.version.remote()))
        sync.push(v)
        ray.kill(b, no_restart=False)  # Ray restarts it: it comes back on its start-up weights, held, in no group
        v = _step(trainer, v)
        sync.push(v)
        assert sync.last["by"] == "broadcast" and sync.generation == 2  # rebuilt for it
        assert ray.get([a.version.remote(), b.version.remote()]) == [v, v]

        ray.kill(b, no_restart=True)  # lost for good before the next broadcast
        v = _step(trainer, v)
        t0 = time.monotonic()
        with pytest.raises(WeightBroadcastError, match=r"PolicyServer replica 1 \(actor \w+\) is dead"):
            sync.push(v)
        assert time.monotonic() - t0 < TIMEOUT_S

        # the recovery goes on: the survivor alone (another set of replicas) gets the version over a new group
        sync.servers = [a]
        sync.push(v)
        assert sync.last["by"] == "broadcast" and sync.generation == 3
        assert ray.get(a.version.remote()) == v and ray.get(trainer.version.remote()) == v
    finally:
        for r in (a, b):
            ray.kill(r)


def test_a_stalled_replica_is_named_and_that_version_goes_through_the_object_store(trainer, tiny_policy, tmp_path):
    """A replica that is alive but does not answer (its process stopped) fails the broadcast by the timeout, named
    in an event; the version then reaches both replicas through the object store, and the next one goes by
    broadcast again over a new group."""
    import os
    import signal

    from whale_ray.events import EventLog

    a, b = _replica(tiny_policy), _replica(tiny_policy)
    pid = ray.get(b.__ray_call__.remote(lambda self: os.getpid()))
    try:
        sync = _sync(trainer, [a, b], WeightBroadcastConfig(timeout_s=5.0, bucket_mb=1), EventLog(tmp_path))
        v = _step(trainer, ray.get(trainer.version.remote()))
        os.kill(pid, signal.SIGSTOP)
        loading = threading.Thread(target=sync.push, args=(v,))
        loading.start()
        events = tmp_path / "events.jsonl"
        deadline = time.monotonic() + 60
        while not events.exists() and time.monotonic() < deadline:
            time.sleep(0.5)
        os.kill(pid, signal.SIGCONT)  # the object store's load of that version waits for it
        loading.join(timeout=120)
        assert not loading.is_alive()
        (event,) = [json.loads(line) for line in events.read_text().splitlines()]
        assert event["kind"] == "weight_broadcast_failed" and event["version"] == v
        assert event["failures"] == [f"PolicyServer replica 1 (actor {b._actor_id.hex()[:12]}): no answer within 5 s"]
        assert sync.last["by"] == "object_store"
        assert ray.get([a.version.remote(), b.version.remote()]) == [v, v]

        sync.cfg = CFG.broadcast  # 5 s was for the stall only: building a group can take longer on a busy host
        v = _step(trainer, v)
        sync.push(v)
        assert sync.last["by"] == "broadcast" and ray.get([a.version.remote(), b.version.remote()]) == [v, v]
    finally:
        os.kill(pid, signal.SIGCONT)
        for r in (a, b):
            ray.kill(r)


# ---------------------------------------------------------------------------------------------- a whole run
@pytest.mark.slow
def test_a_whale_run_with_two_replicas_by_broadcast_serves_every_version(tmp_path, ray_cluster, tiny_policy):
    from actors.coordinator import Coordinator
    from tests.helpers import check_condition_run, study_config

    cfg = study_config(tmp_path, "whale", "math_reasoning", policy__replicas=2, weight__weight_sync="broadcast",
                       weight__broadcast__timeout_s=TIMEOUT_S)
    coordinator = Coordinator(cfg, tiny_policy)
    served, loads = [], []

    def on_cycle(row, c=coordinator) -> None:
        served.append(ray.get([h.version.remote() for h in c.policies]))
        loads.append(dict(c.sync.last))

    history = coordinator.run(on_cycle)
    check_condition_run(cfg, history)
    state = json.loads((cfg.run_dir / "state.json").read_text())
    final = state["weight_version"]
    assert final > 0 and served[-1] == [final, final]
    assert (loads[-1]["version"], loads[-1]["by"]) == (final, "broadcast")
    log = cfg.run_dir / "events.jsonl"  # written at the first event: none at all is a run without faults
    events = [json.loads(line) for line in log.read_text().splitlines() if line.strip()] if log.exists() else []
    assert not [e for e in events if e["kind"] in ("weight_broadcast_failed", "rolled_back")]
    versions = set()  # every version the run reached answered model calls, each by the replica that held it
    for path in sorted((cfg.run_dir / "rollouts").glob("*.parquet")):
        for calls in pq.read_table(path, columns=["calls"]).column("calls").to_pylist():
            versions.update(c["weight_version"] for c in calls)
    assert versions == set(range(final + 1))


# ------------------------------------------------------------------------------------------ nccl, 2+ GPUs
def _nccl_member(rank: int, port: int, out) -> None:
    """GPU `rank`: generation 1 (2 members) bit for bit, then generation 2 of 3 members whose rank 2 never comes."""
    torch.cuda.set_device(rank)
    state = {k: v.cuda() for k, v in _state().items()}
    peer = Sender() if rank == 0 else Receiver()
    for spec, version in ((GroupSpec("127.0.0.1", port, 1, 2, "nccl", 10.0, 16 << 10), 1),
                          (GroupSpec("127.0.0.1", port, 2, 3, "nccl", 10.0, 16 << 10), 2)):
        t0 = time.monotonic()
        try:
            if rank == 0:
                peer.send(spec, state, version)
                out.put((rank, version, "ok", time.monotonic() - t0))
            else:
                got = peer.receive(spec, rank, version)
                same = all(torch.equal(got[k], v) for k, v in state.items())
                out.put((rank, version, "ok" if same else "differs", time.monotonic() - t0))
        except WeightBroadcastError as e:
            out.put((rank, version, str(e), time.monotonic() - t0))


@pytest.mark.gpu
def test_nccl_broadcast_between_two_gpus_and_a_missing_member_fails_in_time_without_ending_the_process():
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    import os

    import torch.multiprocessing as mp

    os.environ["NCCL_NVLS_ENABLE"] = "0"  # NVLink multicast stays off on the lent machines
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_nccl_member, args=(r, store.port, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    results = sorted(out.get(timeout=180) for _ in range(4))
    for p in procs:
        p.join(timeout=60)
    assert [p.exitcode for p in procs] == [0, 0]  # a timed-out group did not end either process
    assert [(r, v, msg) for r, v, msg, _ in results if v == 1] == [(0, 1, "ok"), (1, 1, "ok")]
    for rank, version, msg, seconds in (x for x in results if x[1] == 2):
        assert f"(rank {rank})" in msg and "version 2 failed in group generation 2" in msg, msg
        assert seconds < 10.0 + 10, seconds
