"""The evaluator pool on a real multi-node Ray cluster (ray.cluster_utils.Cluster: a head and worker raylets
on this machine): evaluators on every node, a node joining mid-phase gets work, a node leaving mid-phase
takes its evaluators and its episodes are run again, once each."""

from __future__ import annotations

import json
import threading
import time

import pytest
import ray
from ray.cluster_utils import Cluster

from actors.evaluator_pool import EvaluatorPool
from whale_ray.config import DataConfig, SandboxConfig
from whale_ray.domain import get_domain
from whale_ray.events import EventLog, read_events
from whale_ray.loop import EpisodeWork
from whale_ray.records import EpisodeJob

# Answers after a short wait and never calls the model: the pool, not the policy, is under test.
SLOW = "import time\n\ndef run(task, agent):\n    time.sleep(0.4)\n    return '\\\\boxed{' + str(agent.seed % 7) + '}'\n"
FAST_DEATH = {"health_check_period_ms": 300, "health_check_failure_threshold": 3, "health_check_initial_delay_ms": 0}


@pytest.fixture(scope="module")
def head():
    """A head that holds no actors (0 CPUs), one for the module: its start and the driver's moves to it and back
    are paid once. The session's own local Ray is put back afterwards for the modules that follow."""
    was_up = ray.is_initialized()
    if was_up:
        ray.shutdown()
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "_system_config": FAST_DEATH})
    ray.init(address=c.address, log_to_driver=False)
    yield c
    ray.shutdown()
    c.shutdown()
    if was_up:
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)


@pytest.fixture
def cluster(head):
    """The head with the worker nodes each test adds; they are removed after it, and the GCS has marked every one
    dead before the next test starts, so each test sees only its own nodes, as on a fresh cluster."""
    yield head
    for node in list(head.worker_nodes):
        head.remove_node(node, allow_graceful=False)
    head.wait_for_nodes(timeout=60)


def jobs(n: int) -> list[EpisodeJob]:
    tasks = get_domain("math_reasoning").load_splits(DataConfig(n_harness=8), 0).harness
    return [EpisodeJob(task=tasks[i % len(tasks)], seed=i) for i in range(n)]


def pool_of(tmp_path, evaluators, **sandbox) -> tuple[EvaluatorPool, EventLog]:
    events = EventLog(tmp_path)
    cfg = SandboxConfig(slots=1, chunk=1, evaluators=evaluators, wall_s=30, **sandbox)
    return EvaluatorPool("math_reasoning", None, cfg, events=events, poll_s=0.3), events


def run_with(pool: EvaluatorPool, work: list[EpisodeJob], when_done: int, action) -> list:
    """Runs the episodes; `action()` runs once `when_done` of them have finished (in the pool's own loop, the
    main thread, where Ray's cluster utilities must run; the evaluators go on meanwhile)."""
    done, fired = [0], threading.Event()

    def on_done(n: int) -> None:
        done[0] += n
        if done[0] >= when_done and not fired.is_set():
            fired.set()
            action()

    (results,) = pool.run([EpisodeWork(SLOW, "slow.py", work)], on_done)
    assert done[0] == len(work) and fired.is_set()
    return results


def answers_match_seeds(results, work) -> None:
    """Each job's result is its own (the answer is a function of its seed) and came back exactly once."""
    assert len(results) == len(work)
    assert [r.status for r in results] == ["ok"] * len(work), {r.reason for r in results}
    assert [r.answer for r in results] == ["\\boxed{" + str(j.seed % 7) + "}" for j in work]


def test_elastic_pool_spreads_over_nodes_and_follows_a_joining_node(cluster, tmp_path, bwrap):
    first = cluster.add_node(num_cpus=1)
    pool, _ = pool_of(tmp_path, {"min": 1, "max": 16})
    work = jobs(96)  # long enough for the new node's evaluators to start on loaded cores (CI: over 5 s) and take work
    joined = {}

    def add_node() -> None:
        joined["node"] = cluster.add_node(num_cpus=1).node_id

    results = run_with(pool, work, 8, add_node)
    answers_match_seeds(results, work)
    nodes = {r.node for r in results}
    assert first.node_id in nodes and joined["node"] in nodes  # the new node got work within the phase
    later = [r.node for r in results[48:]]
    assert later.count(joined["node"]) >= 4, later
    assert pool.nodes().keys() == {first.node_id, joined["node"]}
    assert pool.size == 8  # 0.25 CPU each: four per node, and no more (max 16)
    kinds = [e["kind"] for e in read_events(tmp_path)]
    assert "node_joined" in kinds and "evaluators_added" in kinds


def test_a_node_leaving_mid_phase_takes_its_evaluators_and_its_episodes_are_run_again_once(cluster, tmp_path, bwrap):
    stays = cluster.add_node(num_cpus=1)
    leaves = cluster.add_node(num_cpus=1)
    pool, _ = pool_of(tmp_path, "auto", episode_retries=0)
    deadline = time.monotonic() + 120
    while leaves.node_id not in pool.nodes():  # its evaluators are up, so it has episodes in flight when it goes
        assert time.monotonic() < deadline, "no evaluator started on the node that leaves"
        run_with(pool, jobs(2), 1, lambda: None)
    work = jobs(40)
    results = run_with(pool, work, 8, lambda: cluster.remove_node(leaves, allow_graceful=False))
    answers_match_seeds(results, work)  # every episode once, none given up: a loss with its node is not charged
    events = read_events(tmp_path)
    kinds = [e["kind"] for e in events]
    assert "node_left" in kinds and "evaluator_lost" in kinds
    redone = sum(e["episodes"] for e in events if e["kind"] == "episodes_redone")
    assert redone >= 1  # the lost node had episodes in flight, and they were run again
    assert {r.node for r in results[-10:]} == {stays.node_id}
    assert set(pool.nodes()) == {stays.node_id}
    json.dumps(events)  # the log is plain JSON


def test_a_pool_started_after_a_roll_back_reports_what_the_cluster_did_meanwhile(cluster, tmp_path, bwrap):
    """A roll-back replaces the run's pool; the nodes that joined or left between the old pool's last look
    and the new pool's first are still named, from the old pool's view (seen on CI: a proposer lost with
    its node rolled the run back, and the node that joined then was never reported)."""
    leaves = cluster.add_node(num_cpus=1)
    old, _ = pool_of(tmp_path, 1)
    run_with(old, jobs(2), 1, lambda: None)
    for actor in old.actors:
        ray.kill(actor)
    joins = cluster.add_node(num_cpus=1)
    cluster.remove_node(leaves)
    new = EvaluatorPool("math_reasoning", None, SandboxConfig(slots=1, chunk=1, evaluators=1, wall_s=30),
                        events=EventLog(tmp_path), poll_s=0.3, nodes=old.known_nodes)
    work = jobs(2)
    answers_match_seeds(run_with(new, work, 1, lambda: None), work)
    said = {(e["kind"], e.get("node")) for e in read_events(tmp_path)}
    assert {("node_joined", joins.node_id), ("node_left", leaves.node_id)} <= said
    for actor in new.actors:
        ray.kill(actor)


def test_a_pool_of_cores_counts_the_whole_clusters_cpus_and_spreads(cluster, tmp_path, bwrap):
    """`sandbox.evaluators: cores`, the default: one evaluator per four of the cluster's CPUs, counted over every
    node when the pool starts, a fixed pool spread over the nodes."""
    a, b = cluster.add_node(num_cpus=4), cluster.add_node(num_cpus=5)
    pool, _ = pool_of(tmp_path, "cores")
    assert (pool.min, pool.max, pool.elastic, pool.size) == (2, 2, False, 2)
    work = jobs(8)
    answers_match_seeds(run_with(pool, work, 1, lambda: None), work)
    assert set(pool.nodes()) == {a.node_id, b.node_id}
    for actor in pool.actors:
        ray.kill(actor)


def test_a_fixed_pool_spreads_and_replaces_a_killed_evaluator(cluster, tmp_path, bwrap):
    """An evaluator killed while its node stays up: the loss is charged to its episodes, which with
    episode_retries 0 are given up (a sandbox error each, counted once); the rest of the phase goes on."""
    a, b = cluster.add_node(num_cpus=1), cluster.add_node(num_cpus=1)
    pool, _ = pool_of(tmp_path, 2, episode_retries=0)
    work = jobs(24)
    victim = pool.actors[0]
    results = run_with(pool, work, 4, lambda: ray.kill(victim))
    lost = [i for i, r in enumerate(results) if r.status == "sandbox_error"]
    assert 1 <= len(lost) <= 2, lost  # what the victim held: one running, one queued behind it (slots 1, chunk 1)
    assert all("lost with its evaluator 1 times" in results[i].reason for i in lost)
    kept = [i for i in range(len(work)) if i not in lost]
    answers_match_seeds([results[i] for i in kept], [work[i] for i in kept])
    assert {r.node for r in results} - {""} == {a.node_id, b.node_id}  # SPREAD: one evaluator on each node
    assert pool.size == 2 and victim not in pool.actors  # replaced
    kinds = [e["kind"] for e in read_events(tmp_path)]
    assert kinds.count("evaluator_lost") == 1 and "evaluators_added" in kinds


@pytest.mark.slow
def test_a_whale_run_rides_out_nodes_leaving_and_joining(cluster, tmp_path, tiny_policy, bwrap):
    """A whole run on a cluster whose evaluators may only live on two worker nodes (a custom resource the
    others lack): inside the weight phase both are removed, one without warning, and a new one joins, so the
    rest of the run can only go on there. The run finishes in the same launch; the rollout files hold exactly
    the planned (task, sample) rows, none given up, and the records name the nodes that ran them: the new one
    and at least one of the old. (With one old node kept, the new one got work only if the run outlasted its
    evaluators' start: on CI it did not, once.) The proposer and the Trainer ask for no resources and may live on a removed
    node: the run then rolls back to its last commit, and its events still name every node that came or went."""
    import pyarrow.parquet as pq

    from actors.coordinator import Coordinator
    from tests.fault_injection import committed
    from tests.helpers import small_config
    from tests.run_truth import check_ledger

    cluster.add_node(num_cpus=3, resources={"main": 4})  # for the PolicyServer and the Trainer's worker
    first = cluster.add_node(num_cpus=1, resources={"evaluator_slot": 4})
    second = cluster.add_node(num_cpus=1, resources={"evaluator_slot": 4})
    # eight weight steps: the next step's episodes run beside each step, so once the first step is on record a
    # phase of two ends within a second, a window that a loaded machine's polling missed
    cfg = small_config(tmp_path / "run", condition="whale", cycles=1, E=2.0, sandbox__evaluators={"min": 1, "max": 8},
                       sandbox__slots=2, faults__poll_s=0.3,
                       resources__evaluator={"num_cpus": 0.25, "resources": {"evaluator_slot": 1}},
                       resources__policy_server={"num_cpus": 1, "resources": {"main": 1}},
                       resources__trainer_worker={"num_cpus": 0.5, "resources": {"main": 1}})
    coordinator = Coordinator(cfg, tiny_policy)
    joined: dict = {}
    errors: list = []

    def run() -> None:
        try:
            coordinator.run()
        except BaseException as e:  # reported below
            errors.append(e)

    runner = threading.Thread(target=run, daemon=True)  # the nodes change from the main thread, as Ray needs
    runner.start()
    removed = False
    while runner.is_alive() and not removed:  # from the committed state, as tests/fault_injection.py does
        p = committed(cfg.run_dir).get("phase") or {}
        if not removed and p.get("kind") == "weight" and p.get("units_done", 0) >= 1:
            cluster.remove_node(second, allow_graceful=False)
            joined["node"] = cluster.add_node(num_cpus=1, resources={"evaluator_slot": 4}).node_id
            cluster.remove_node(first)
            removed = True
        time.sleep(0.05)
    runner.join()
    assert not errors, errors
    state = json.loads((cfg.run_dir / "state.json").read_text())
    assert state["finished"] and "node" in joined
    check_ledger(cfg, cfg.run_dir, state)  # every planned (task, sample) row once, nothing lost or doubled
    nodes = set()
    for path in (cfg.run_dir / "rollouts").glob("*.parquet"):
        table = pq.read_table(path, columns=["node", "status"])
        assert "sandbox_error" not in table.column("status").to_pylist(), path.name  # lost work was redone
        nodes |= set(table.column("node").to_pylist())
    # the new node ran work, and the old ones ran the work before it: which of the two did depends on
    # where the elastic pool had grown when they went (one was seen marked dead by a loaded CI before it ran)
    assert joined["node"] in nodes and nodes & {first.node_id, second.node_id}
    assert nodes <= {first.node_id, second.node_id, joined["node"]}  # evaluators went only where their resource is
    kinds = [e["kind"] for e in read_events(cfg.run_dir)]
    assert "node_left" in kinds and "node_joined" in kinds
