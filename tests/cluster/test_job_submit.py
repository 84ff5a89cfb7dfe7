"""cluster/README.md followed as a new user would: a real `ray start --head` (token authentication on, as a
token left by an earlier local run turns it on), a checkout shipped with `--working-dir .`, a short study
submitted through the real `ray job submit` CLI and through the real JobSubmissionClient; a job stopped
mid-run (the client's stop_job, the REST call `ray job stop` makes) and resubmitted finishes with the planned
ledger (tests/run_truth.py), equal to the uninterrupted run's, while `whale serve --ray-address` (its CLI)
follows it on the same cluster. The run directory and the policy cache live
under `storage:`. Also the bad input of item 4: an address where nothing listens and a
role no node can hold are one-line errors (exit 2), not hangs.

The head gets its own temp dir and ports (other Ray clusters may share the machine) and is stopped by
killing its own process group, never with `ray stop`.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import yaml

from tests.helpers import SMALL, build_test_policy, nested
from tests.run_truth import check_ledger, guessing_math_harness
from whale_ray.config import load_config
from whale_ray.domain import get_domain

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent
START_S = 300  # a head on a loaded 2-core machine takes a minute or two to take jobs
JOB_S = 1500  # one short study end to end


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def checkout_copy(dest: Path) -> Path:
    """What `git clone` gives a new user: the files git tracks or would add (no .venv, runs, caches)."""
    repo = Path(__file__).resolve().parents[2]
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=repo, capture_output=True,
                           check=True).stdout.decode().split("\0")
    for name in filter(None, files):
        if (repo / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(repo / name, dest / name)
    return dest


class Head:
    """`ray start --head --block` in its own session; stop() ends exactly the processes it started."""

    def __init__(self, root: Path, env: dict[str, str]):
        gcs, dash, agent, agent_grpc, client, metrics, runtime_env, node, obj = free_ports(9)
        self.gcs_address, self.address = f"127.0.0.1:{gcs}", f"http://127.0.0.1:{dash}"
        self.log = root / "head.log"
        cmd = [str(BIN / "ray"), "start", "--head", "--block", f"--port={gcs}", "--num-cpus=4",
               "--disable-usage-stats", f"--temp-dir={root / 'ray'}", "--node-ip-address=127.0.0.1",
               "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", f"--dashboard-agent-listen-port={agent}",
               f"--dashboard-agent-grpc-port={agent_grpc}", f"--ray-client-server-port={client}",
               f"--metrics-export-port={metrics}", f"--runtime-env-agent-port={runtime_env}",
               f"--node-manager-port={node}", f"--object-manager-port={obj}"]
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(cmd, env=env, cwd=root, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def stop(self) -> None:
        for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 30)):  # its raylet often outlives a SIGTERM
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline:
                self.proc.poll()  # reaps the group's leader: as a zombie, pgrep would find it until the wait ran out
                if subprocess.run(["pgrep", "-g", str(self.proc.pid)], capture_output=True).returncode != 0:
                    self.proc.wait(timeout=10)
                    return
                time.sleep(1)


@pytest.fixture(scope="module")
def cluster(pytestconfig):
    """A head with token auth, a shipped checkout holding the study's config, and the client's environment."""
    root = Path(tempfile.mkdtemp(prefix="wjs-", dir="/tmp"))  # short: Ray's socket paths live under it
    token = root / "token"
    token.write_text(secrets.token_hex(32))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_") and k != "WHALE_CACHE"}
    env.update(PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}", RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token))
    # storage: a local path every node of this one-machine cluster reaches; the policy cache is under it
    storage = root / "storage"
    policy = Path(build_test_policy(pytestconfig, "math_reasoning"))
    shutil.copytree(policy, storage / "cache" / policy.name)
    checkout = checkout_copy(root / "checkout")
    # a seed harness whose rewards vary, so weight steps train and the Trainer has state to resume
    (checkout / "guessing_h0.py").write_text(guessing_math_harness(get_domain("math_reasoning").h0_path.read_text()))
    study = nested({**SMALL, "policy.warmstart_steps": 60, "harness": "guessing_h0.py"})  # 60: the test policy
    (checkout / "study.yaml").write_text(yaml.safe_dump({**study, "storage": str(storage), "run_dir": "study"}))
    # the resubmitted one is followed by `whale serve` (the serve: section is no part of a run's identity): a
    # small replica, and an autoscaling target of 1 request per replica that its three clients exceed within 5 s
    serve = {"engine_cpus": 0.25, "max_concurrent": 2, "upscale_delay_s": 5}
    (checkout / "again.yaml").write_text(yaml.safe_dump({**study, "storage": str(storage), "run_dir": "again",
                                                         "serve": serve}))
    head = Head(root, env)
    try:
        wait_ready(head, env)
        yield {"head": head, "env": env, "root": root, "storage": storage, "checkout": checkout}
    finally:
        head.stop()
        shutil.rmtree(root, ignore_errors=True)


def client(head: Head, env: dict[str, str]):
    """The real JobSubmissionClient, sending the cluster's token (the client sends it only when told to)."""
    from ray.job_submission import JobSubmissionClient

    token = Path(env["RAY_AUTH_TOKEN_PATH"]).read_text().strip()
    return JobSubmissionClient(head.address, headers={"Authorization": f"Bearer {token}"})


def wait_ready(head: Head, env: dict[str, str]) -> None:
    """Until the head runs a job: its job agent starts a while after the dashboard answers."""
    deadline, last = time.monotonic() + START_S, None
    while time.monotonic() < deadline:
        if head.proc.poll() is not None:
            pytest.fail(f"ray start --head exited: {head.log.read_text()[-2000:]}")
        try:
            jobs = client(head, env)
            sub = jobs.submit_job(entrypoint="python -c 'print(1)'")
            wait_job(jobs, sub, timeout=120)
            return
        except Exception as e:  # not up yet: connection refused, "No available agent to submit job"
            last = e
            time.sleep(3)
    pytest.fail(f"the head took no job within {START_S} s: {last}")


def wait_job(jobs, sub: str, timeout: float, until=("SUCCEEDED", "FAILED", "STOPPED")) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = str(jobs.get_job_status(sub).value)
        if status in until:
            return status
        time.sleep(2)
    raise TimeoutError(f"job {sub} still not {until} after {timeout} s:\n{jobs.get_job_logs(sub)[-3000:]}")


ENTRYPOINT = "python -m whale_ray.cli run --config {} --ray-address auto"


def state(run_dir: Path) -> dict:
    return json.loads((run_dir / "state.json").read_text())


@pytest.fixture(scope="module")
def uninterrupted(cluster):
    """The README's command through the real `ray job submit` CLI (it waits for the job and streams its log)."""
    c = cluster
    out = subprocess.run([str(BIN / "ray"), "job", "submit", "--address", c["head"].address, "--working-dir", ".",
                          "--", *ENTRYPOINT.format("study.yaml").split()],
                         cwd=c["checkout"], env=c["env"], capture_output=True, text=True, timeout=JOB_S)
    transcript = c["root"].parent / f"{c['root'].name}-ray-job-submit.txt"  # kept for the record
    transcript.write_text(f"$ ray job submit ...\n{out.stdout}\n{out.stderr}")
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    return c["storage"] / "study", out.stdout


def test_ray_job_submit_runs_a_study(cluster, uninterrupted):
    run_dir, log = uninterrupted
    assert "succeeded" in log and "WHALE run summary" in log
    assert f"run directory: {run_dir}" in log  # run_dir: study, under storage:
    s = state(run_dir)
    assert s["finished"] and len(s["history"]) == 3  # row 0 and two cycles
    assert s["ledger"]["weight_steps"] > 0  # the Trainer trained: a stopped job has weights to resume
    cfg = load_config(run_dir / "config.yaml")
    assert cfg.storage == str(cluster["storage"]) and cfg.run_dir == run_dir
    check_ledger(cfg, run_dir, s)
    assert list((cluster["storage"] / "cache").iterdir()) == [next((cluster["storage"] / "cache").iterdir())]
    status = subprocess.run([sys.executable, "-m", "whale_ray.cli", "status", str(run_dir)], capture_output=True,
                            text=True, timeout=120)
    assert status.returncode == 0 and "finished (2/2 cycles)" in status.stdout, status.stdout + status.stderr


# ------------------------------------------------------------------------------------------- whale serve
def serve_apps(c: dict) -> dict:
    """The cluster's Serve applications, from the dashboard's REST API (what `serve status` reads)."""
    import urllib.request

    token = Path(c["env"]["RAY_AUTH_TOKEN_PATH"]).read_text().strip()
    req = urllib.request.Request(f"{c['head'].address}/api/serve/applications/",
                                 headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read()).get("applications") or {}


class LiveEndpoint:
    """`whale serve --run-dir --ray-address` started through the CLI, as a user starts it, with autoscaling
    bounds, and three `openai` clients asking it in a loop; records (time, client, version, fingerprint) and the
    most replicas seen running."""

    ARGS = ("--min-replicas", "1", "--max-replicas", "2")

    def __init__(self, c: dict, run_dir: Path):
        import openai

        (port,) = free_ports(1)
        self.c, self.log, self.url = c, c["root"] / "whale-serve.log", f"http://127.0.0.1:{port}/v1"
        self.command = ["whale", "serve", "--run-dir", str(run_dir), "--ray-address", c["head"].gcs_address,
                        "--port", str(port), *self.ARGS]
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "whale_ray.cli", *self.command[1:]],
                                         cwd=c["checkout"], env=c["env"], stdout=out, stderr=subprocess.STDOUT)
        self.seen: list[tuple[float, int, int, str]] = []
        self.errors: list[str] = []  # what a client met that it should not have: check() fails on it
        self.replicas, self._stop = 0, threading.Event()

        def ask(i: int) -> None:
            api = openai.OpenAI(base_url=self.url, api_key="none", max_retries=0, timeout=120)
            self.wait_ready(api)
            while not self._stop.is_set():
                try:
                    r = api.chat.completions.with_raw_response.create(
                        model="whale-latest", messages=[{"role": "user", "content": "What is 2 + 3?"}], max_tokens=8)
                    body = r.parse()
                    self.seen.append((time.monotonic(), i, int(r.headers["x-whale-weight-version"]),
                                      body.system_fingerprint))
                except openai.RateLimitError as e:  # the replica is full: 429 with Retry-After, as promised
                    if not e.response.headers.get("retry-after"):
                        self.errors.append(f"client {i}: a 429 without Retry-After")
                    time.sleep(0.2)
                except Exception as e:  # noqa: BLE001 - reported by check(), not lost with the thread
                    self.errors.append(f"client {i}: {type(e).__name__}: {e}")
                    return
        self.clients = [threading.Thread(target=ask, args=(i,), daemon=True) for i in range(3)]
        for t in self.clients:
            t.start()

    def wait_ready(self, api) -> None:
        """Until the app answers: before it is deployed, nothing listens, then Serve's proxy answers 404."""
        import openai

        while not self._stop.is_set():
            try:
                api.models.list()
                return
            except (openai.APIConnectionError, openai.NotFoundError):
                time.sleep(0.5)

    def check(self) -> None:
        """The endpoint is up and no client met an error; counts its running replicas."""
        assert not self.errors, self.errors
        assert self.proc.poll() is None, self.log.read_text()[-3000:]
        deployment = ((serve_apps(self.c).get("whale") or {}).get("deployments") or {}).get("WhaleEndpoint") or {}
        self.replicas = max(self.replicas, sum(r.get("state") == "RUNNING" for r in deployment.get("replicas") or []))

    def stop(self) -> tuple[int, str]:
        """SIGTERM, as a pod or service manager stops it; its exit code and log."""
        self._stop.set()
        for t in self.clients:
            t.join(timeout=180)
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=120), self.log.read_text()

    def transcript(self, text: str) -> list[str]:
        """whale serve's own lines, then each client's version changes."""
        lines = ["$ " + " ".join(self.command), *[ln for ln in text.splitlines() if ln.strip() and "pid=" not in ln],
                 "# t_s client weight_version system_fingerprint"]
        t0, last = self.seen[0][0], {}
        for t, i, v, fp in self.seen:
            if v != last.get(i):
                lines.append(f"{t - t0:8.1f} s  client {i}  v{v}  {fp}")
            last[i] = v
        return lines


def test_job_stop_and_resubmit_resume_under_a_live_endpoint(cluster, uninterrupted):
    """A job stopped mid-run and resubmitted finishes as the uninterrupted run did, while `whale serve` follows
    its run directory on the same cluster the whole time: the clients see θ0 first and the job's last weights at
    the end, the version never goes down across the stop and the resubmission, every reply names its weights,
    the load scales the endpoint to its second replica, and SIGTERM takes the app down. The transcript is kept
    beside the job's."""
    c = cluster
    jobs = client(c["head"], c["env"])
    entry = ENTRYPOINT.format("again.yaml")
    run_dir = c["storage"] / "again"
    first = jobs.submit_job(entrypoint=entry, runtime_env={"working_dir": str(c["checkout"])})
    deadline = time.monotonic() + JOB_S

    def running(job: str) -> None:
        assert time.monotonic() < deadline and jobs.get_job_status(job).value in ("PENDING", "RUNNING"), \
            jobs.get_job_logs(job)[-4000:]

    while not (run_dir / "config.yaml").is_file():  # `whale serve --run-dir` needs the run on record
        running(first)
        time.sleep(0.5)
    endpoint = LiveEndpoint(c, run_dir)
    try:
        # cut once cycle 1's first weight step is on record. Stopped through the client: the `ray job stop` CLI
        # makes the same REST call, but on a loaded 2-core machine it takes 20-60 s just to start, and in two
        # runs its stop landed after the run had finished.
        while not ((run_dir / "state.json").is_file() and state(run_dir)["ledger"]["weight_rollouts"]):
            running(first)
            endpoint.check()
            time.sleep(1)
        assert jobs.stop_job(first)
        assert wait_job(jobs, first, timeout=300) == "STOPPED"
        cut = state(run_dir)
        assert not cut["finished"]
        second = jobs.submit_job(entrypoint=entry, runtime_env={"working_dir": str(c["checkout"])})
        # one look at the status a round: the job may end between two looks
        while (status := jobs.get_job_status(second).value) in ("PENDING", "RUNNING"):
            assert time.monotonic() < deadline, jobs.get_job_logs(second)[-4000:]
            endpoint.check()
            time.sleep(2)
        assert status == "SUCCEEDED", jobs.get_job_logs(second)[-4000:]
        final = state(run_dir)["weight_version"]
        while not endpoint.seen or endpoint.seen[-1][2] < final:  # the last checkpoint lands within a poll or two
            assert time.monotonic() < deadline
            endpoint.check()
            time.sleep(0.5)
    finally:
        code, text = endpoint.stop()
    (c["root"].parent / f"{c['root'].name}-whale-serve.txt").write_text("\n".join(endpoint.transcript(text)) + "\n")

    done, reference = state(run_dir), state(uninterrupted[0])
    assert done["finished"] and done["phases_done"][:len(cut["phases_done"])] == cut["phases_done"]
    # the ledger is the planned one: every unit once, nothing lost or counted twice (tests/run_truth.py)
    check_ledger(load_config(run_dir / "config.yaml"), run_dir, done)
    # and the same as the uninterrupted run's of the same config and seed
    counts = ("weight_rollouts", "harness_rollouts", "eval_rollouts", "weight_steps", "harness_iterations",
              "candidates_proposed", "candidates_invalid")  # the ledger less its wall times
    assert {k: done["ledger"][k] for k in counts} == {k: reference["ledger"][k] for k in counts}
    assert done["phases_done"] == reference["phases_done"] and done["weight_version"] == reference["weight_version"]
    assert [r["best"] for r in done["history"]] == [r["best"] for r in reference["history"]]

    last: dict[int, int] = {}
    for _, i, v, fp in endpoint.seen:
        assert fp == f"whale-v{v}"  # every reply names the weights it came from
        assert v >= last.get(i, 0), (i, v, last)  # and no client ever sees the version go down
        last[i] = v
    versions = {v for _, _, v, _ in endpoint.seen}
    # the steps and the last; θ0 too only when a client's first call beats the first weight step, which on a
    # loaded machine it need not
    assert final > 0 and final in versions and len(versions) >= 3, versions
    assert endpoint.replicas == 2, f"the endpoint never scaled past {endpoint.replicas} replica(s)"
    assert code == 0 and "the endpoint is down" in text, text[-3000:]
    assert "whale" not in serve_apps(c)  # the app is gone (and Serve with it: this `whale serve` started it)


# ------------------------------------------------------------------------------------------- bad input
def whale_run(*args: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "whale_ray.cli", "run", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_unreachable_address_is_one_line(tmp_path):
    (port,) = free_ports(1)  # nothing listens there
    out = whale_run("--ray-address", f"127.0.0.1:{port}", "--run-dir", str(tmp_path / "r"), cwd=tmp_path,
                    env=dict(os.environ))
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stdout.strip().count("\n") == 0 and "no Ray cluster answers at" in out.stdout and f":{port} (" in out.stdout
    assert not (tmp_path / "r").exists()


def test_role_no_node_can_hold_is_one_line(cluster, tmp_path):
    c = cluster
    # the head has 4 CPUs and no GPU: a GPU PolicyServer can never be placed
    cfg = tmp_path / "gpu.yaml"
    cfg.write_text(yaml.safe_dump({**yaml.safe_load((c["checkout"] / "study.yaml").read_text()),
                                   "run_dir": str(tmp_path / "g"),
                                   "resources": {"policy_server": {"num_cpus": 1, "num_gpus": 1}}}))
    out = whale_run("--config", str(cfg), "--ray-address", c["head"].gcs_address, cwd=c["checkout"], env=c["env"])
    assert out.returncode == 2, out.stdout + out.stderr
    line = out.stdout.strip()
    assert line.count("\n") == 0 and "resources.policy_server asks for {CPU: 1, GPU: 1}" in line, line
    assert not (tmp_path / "g").exists()


def test_infeasible_names_the_role_and_the_shortfall():
    from whale_ray.resources import infeasible

    nodes = [{"CPU": 4.0, "memory": 1e9}, {"CPU": 2.0, "GPU": 1.0}]
    assert infeasible({"policy_server": (1, {"CPU": 1.0, "GPU": 1.0}), "evaluator": (8, {"CPU": 0.5})}, nodes) is None
    why = infeasible({"trainer_worker": (1, {"CPU": 3.0, "GPU": 1.0})}, nodes)
    assert why.startswith("resources.trainer_worker asks for {CPU: 3, GPU: 1} per actor, but no node")
    why = infeasible({"evaluator": (13, {"CPU": 0.5})}, nodes)
    assert "CPU 6.5 of 6" in why and "evaluator 13 x {CPU: 0.5}" in why
    assert "custom" in infeasible({"retriever": (1, {"CPU": 0.0, "custom": 1.0})}, nodes)
