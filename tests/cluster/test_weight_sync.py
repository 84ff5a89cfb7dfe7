"""The weight syncs (actors/weight_sync.py) on a real local Ray cluster, with the real Trainer and PolicyServers on
CPU: a push reaches every server with the Trainer's own object ref; a server restarted by Ray holds its calls until
`follow_restarts` brings it to the version on record; a level-2 wake that finds no weights is pushed them; and
cuda_ipc sends a server that cannot see the Trainer's GPU the weights through the object store.
(actors/broadcast_sync.py: tests/policy/test_weight_broadcast.py.)"""

from __future__ import annotations

import time

import pytest
import ray
import torch

from actors.weight_sync import CudaIpcSync, ObjectStoreSync
from tests.helpers import trainer_actor
from whale_ray.config import WeightPhaseConfig
from whale_ray.events import read_events
from whale_ray.records import SamplingParams

CFG = WeightPhaseConfig(learning_rate=1e-2, micro_batch=2, num_workers=1)
MESSAGES = [{"role": "user", "content": "A jar has 4 apples. Ann removes 1. How many apples are in the jar now?"}]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0)
EXAMPLES = [([3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14])] * 4


@pytest.fixture(scope="module")
def trainer(ray_cluster, tiny_policy, tmp_path_factory):
    with trainer_actor(tiny_policy, CFG, tmp_path_factory.mktemp("sync-trainer")) as t:
        yield t


def _server(tiny_policy, restarts: int = 0, events_dir=None):
    from actors.policy_server import PolicyServer

    return PolicyServer.options(max_restarts=restarts, max_task_retries=restarts).remote(
        tiny_policy, engine="transformers", max_batch=4, batch_wait_ms=1.0, device="cpu",
        events_dir=str(events_dir) if events_dir else None)


def _served(server) -> dict[str, torch.Tensor]:
    return ray.get(server.__ray_call__.remote(
        lambda self: {k: v.detach().clone() for k, v in self._service.engine.model.state_dict().items()}))


def _step(trainer) -> int:
    v = ray.get(trainer.version.remote())
    m = ray.get(trainer.train_step.remote(EXAMPLES, v))
    assert m["trained"] and m["version"] == v + 1
    return m["version"]


def _kill_and_restart(server, timeout: float = 120.0) -> int:
    """Kills `server` for Ray to restart; the version the new instance holds its calls at. A call made right
    after the kill can still reach the instance being killed (which answers `restarted` with None)."""
    ray.kill(server, no_restart=False)
    deadline = time.monotonic() + timeout
    while (held := ray.get(server.restarted.remote())) is None:
        assert time.monotonic() < deadline, "Ray did not restart the server"
        time.sleep(0.1)
    return held


def _follow_until_served(sync, server, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while ray.get(server.restarted.remote()) is not None:
        assert time.monotonic() < deadline, "the restarted server was never brought back"
        sync.follow_restarts()
        time.sleep(0.2)


def test_a_push_hands_every_server_the_trainers_own_ref(trainer, tiny_policy):
    """The ref rank 0 put after the step is the one every server reads: the Trainer hands out the same ref each
    time it is asked for that version, so nothing between put and read made another copy."""
    servers = [_server(tiny_policy) for _ in range(2)]
    try:
        sync = ObjectStoreSync(trainer, servers, version=ray.get(trainer.version.remote()))
        v = _step(trainer)
        first, again = (ray.get(trainer.host_weights.remote(v))[0] for _ in range(2))
        assert first.hex() == again.hex()
        sync.push(v)
        assert sync.version == v and ray.get([s.version.remote() for s in servers]) == [v, v]
        trained = ray.get(first)
        for s in servers:
            served = _served(s)
            assert all(torch.equal(served[k], trained[k]) for k in trained)
        assert {c.weight_version for c in ray.get([s.generate.remote(MESSAGES, GREEDY) for s in servers])} == {v}
    finally:
        for s in servers:
            ray.kill(s)


def test_a_restarted_server_holds_its_calls_until_it_is_brought_to_the_version_on_record(trainer, tiny_policy,
                                                                                      tmp_path):
    a, b = _server(tiny_policy), _server(tiny_policy, restarts=1, events_dir=tmp_path)
    try:
        sync = ObjectStoreSync(trainer, [a, b], version=ray.get(trainer.version.remote()))
        v = _step(trainer)
        sync.push(v)
        assert _kill_and_restart(b) == 0  # Ray restarts it on the weights it was started with (version 0)
        call = b.generate.remote(MESSAGES, GREEDY)
        assert not ray.wait([call], timeout=2.0)[0]  # held: no answer from the start-up weights
        _follow_until_served(sync, b)
        assert ray.get(call).weight_version == v and ray.get(b.version.remote()) == v
        trained = ray.get(ray.get(trainer.host_weights.remote(v))[0])
        assert all(torch.equal(_served(b)[k], trained[k]) for k in trained)
        (event,) = [e for e in read_events(tmp_path) if e["kind"] == "actor_restarted"]
        assert (event["actor"], event["version"]) == ("PolicyServer", v)
    finally:
        for s in (a, b):
            ray.kill(s)


def test_a_server_restarted_while_the_trainer_takes_the_next_step_gets_the_version_on_record(trainer, tiny_policy):
    """weight.max_staleness 1: the Trainer takes step v -> v+1 while the servers answer on v. A server Ray restarts
    then is brought to v, the version on record, from the ref the sync sent; the Trainer no longer holds v."""
    from actors.trainer import StaleTrainer

    a, b = _server(tiny_policy), _server(tiny_policy, restarts=1)
    try:
        sync = ObjectStoreSync(trainer, [a, b], version=ray.get(trainer.version.remote()))
        v = _step(trainer)
        sync.push(v)
        on_record = _served(a)
        assert _step(trainer) == v + 1  # not pushed: the next step's rollouts still run on v
        with pytest.raises(StaleTrainer):
            ray.get(trainer.host_weights.remote(v))
        assert _kill_and_restart(b) == 0
        _follow_until_served(sync, b)
        assert ray.get(b.generate.remote(MESSAGES, GREEDY), timeout=120).weight_version == v
        assert all(torch.equal(_served(b)[k], on_record[k]) for k in on_record)
    finally:
        for s in (a, b):
            ray.kill(s)


def test_calls_made_while_the_trainer_takes_a_step_are_answered_by_its_weights(trainer, tiny_policy):
    """The next step's episodes start beside the Trainer's step: their calls wait for the step's weights (push), or,
    after a step that trained nothing, go through on the weights the servers have (resume). A server Ray restarts
    during the step is held for the step's weights too, not let through on the version on record."""
    a, b = _server(tiny_policy), _server(tiny_policy, restarts=1)
    try:
        sync = ObjectStoreSync(trainer, [a, b], version=ray.get(trainer.version.remote()))
        v = _step(trainer)
        sync.push(v)
        sync.before_step()
        calls = [s.generate.remote(MESSAGES, GREEDY) for s in (a, b)]
        assert _kill_and_restart(b) == 0
        _follow_until_served(sync, b)  # brought to v, the version on record, and held for v + 1
        assert ray.get(b.version.remote()) == v
        calls.append(b.generate.remote(MESSAGES, GREEDY))
        assert not ray.wait(calls, num_returns=len(calls), timeout=2.0)[0]  # none answered by v
        sync.push(_step(trainer))
        assert [c.weight_version for c in ray.get(calls, timeout=120)] == [v + 1] * 3
        sync.before_step()
        calls = [s.generate.remote(MESSAGES, GREEDY) for s in (a, b)]
        assert not ray.wait(calls, num_returns=2, timeout=1.0)[0]
        sync.resume()  # the step trained nothing
        assert [c.weight_version for c in ray.get(calls, timeout=120)] == [v + 1] * 2
    finally:
        for s in (a, b):
            ray.kill(s)


def test_a_restarted_server_already_on_the_version_on_record_serves_without_weights(ray_cluster, tiny_policy):
    """A schedule without a weight phase has no Trainer: a restarted server's start-up weights are the ones on
    record, and it is let through as it is."""
    server = _server(tiny_policy, restarts=1)
    try:
        sync = ObjectStoreSync(None, [server], version=0)
        assert _kill_and_restart(server) == 0
        _follow_until_served(sync, server)
        assert ray.get(server.generate.remote(MESSAGES, GREEDY)).weight_version == 0
    finally:
        ray.kill(server)


def _sleepy(self, level: int) -> None:
    """The server's engine as vLLM's sleep mode at `level` behaves, counting its loads (run in the server)."""
    eng = self._service.engine
    eng.sleep_level, eng.asleep, eng.loads = level, False, 0
    load = eng.load_weights

    def sleep():
        eng.asleep = True

    def wake_up():
        assert level == 1, "a level-2 sleep has no weights to wake into"
        eng.asleep = False

    def load_weights(state, version):
        load(state, version)
        eng.asleep, eng.loads = False, eng.loads + 1

    eng.sleep, eng.wake_up, eng.load_weights = sleep, wake_up, load_weights


def test_servers_sleep_through_a_step_and_a_level_2_wake_without_weights_is_pushed_them(trainer, tiny_policy):
    one, two = _server(tiny_policy), _server(tiny_policy)
    try:
        ray.get([one.__ray_call__.remote(_sleepy, 1), two.__ray_call__.remote(_sleepy, 2)])
        v = ray.get(trainer.version.remote())
        sync = ObjectStoreSync(trainer, [one, two], version=v, sleeps=True)

        def state(s) -> tuple[bool, int, int]:
            return ray.get(s.__ray_call__.remote(lambda self: (self._service.engine.asleep,
                                                               self._service.engine.loads, self._service.version())))

        sync.push(v)  # both on the Trainer's weights first
        sync.before_step()
        assert [state(s)[0] for s in (one, two)] == [True, True]
        sync.resume()  # a step that trained nothing: level 1 wakes as it was, level 2 gets the weights again
        assert [state(s) for s in (one, two)] == [(False, 1, v), (False, 2, v)]
        assert ray.get(two.wake_up.remote()) is True  # awake: nothing to do
        sync.before_step()
        assert ray.get(two.wake_up.remote()) is False  # asleep at level 2: the sync must load it
        v = _step(trainer)
        sync.push(v)  # new weights wake both
        assert [state(s) for s in (one, two)] == [(False, 2, v), (False, 3, v)]
    finally:
        for s in (one, two):
            ray.kill(s)


@ray.remote(num_cpus=0)
class GpuTrainerElsewhere:
    """A Trainer whose weights lie on a GPU that no server here can see (cuda_ipc across hosts): its handles name
    an unknown GPU, and its object-store copy is `state`."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self.state, self.hosted = state, 0

    def shared_weights(self, version: int):
        from whale_ray.policy.cuda_ipc import SharedWeights

        return SharedWeights(version, "GPU-on-another-host", "key", (), 0)

    def host_weights(self, version: int) -> list:
        self.hosted += 1
        return [ray.put(self.state)]

    def times_hosted(self) -> int:
        return self.hosted


def test_cuda_ipc_sends_a_server_that_cannot_see_the_gpu_the_weights_through_the_object_store(ray_cluster, tiny_policy):
    servers = [_server(tiny_policy) for _ in range(2)]
    try:
        state = {k: v + 0.01 for k, v in _served(servers[0]).items()}
        elsewhere = GpuTrainerElsewhere.remote(state)
        sync = CudaIpcSync(elsewhere, servers, version=0)
        sync.push(1)
        assert ray.get([s.version.remote() for s in servers]) == [1, 1]
        assert ray.get(elsewhere.times_hosted.remote()) == 1  # one ref for both servers
        for s in servers:
            served = _served(s)
            assert all(torch.equal(served[k], state[k]) for k in state)
        sync.release()  # the servers let go of what they opened: nothing here
        ray.kill(elsewhere)
    finally:
        for s in servers:
            ray.kill(s)
