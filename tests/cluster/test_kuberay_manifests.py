"""cluster/'s KubeRay manifests against the RayJob and RayCluster CRD schemas of KubeRay v1.7.0
(tests/data/kuberay-1.7.0, with kubectl's strict field validation on top), and against what they run: the
image cluster/Dockerfile builds, the config file the entrypoint names (it loads, and its run directory and
every path it reads are on volumes every pod mounts, the run directory on a ReadWriteMany claim), a cluster at
its minimum replicas that can hold every role of that config, and the pod settings bubblewrap needs."""

from __future__ import annotations

import copy
import json
import re
import shlex
from pathlib import Path

import jsonschema
import pytest
import yaml

from whale_ray.config import WhaleConfig, load_config
from whale_ray.resources import infeasible, resolve_run_dir, role_demands, storage_root
from whale_ray.schedules import has_phase

REPO = Path(__file__).resolve().parents[2]
CLUSTER = REPO / "cluster"
DATA = Path(__file__).resolve().parents[1] / "data" / "kuberay-1.7.0"
SCHEMA_FILES = {"RayJob": "rayjob.v1.schema.json", "RayCluster": "raycluster.v1.schema.json"}
MANIFESTS = ["rayjob.yaml", "raycluster.yaml"]


def strict(node):
    """kubectl's strict field validation: an object's fields are the ones its schema names, unless it keeps
    unknown fields (x-kubernetes-preserve-unknown-fields) or says what the others are (additionalProperties)."""
    if isinstance(node, list):
        return [strict(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: strict(v) for k, v in node.items()}
    if "properties" in out and "additionalProperties" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


def validator(kind: str) -> jsonschema.Draft7Validator:
    return jsonschema.Draft7Validator(strict(json.loads((DATA / SCHEMA_FILES[kind]).read_text())))


def schema_errors(doc: dict) -> list[str]:
    return [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message[:200]}"
            for e in validator(doc["kind"]).iter_errors(doc)]


def load(name: str) -> dict:
    (doc,) = [d for d in yaml.safe_load_all((CLUSTER / name).read_text()) if d]
    return doc


def cluster_spec(doc: dict) -> dict:
    return doc["spec"]["rayClusterSpec"] if doc["kind"] == "RayJob" else doc["spec"]


def pods(doc: dict) -> list[dict]:
    """(group name, minReplicas, rayStartParams, pod spec) of the head and every worker group."""
    spec = cluster_spec(doc)
    head = spec["headGroupSpec"]
    out = [{"name": "head", "min": 1, "params": head.get("rayStartParams", {}), "spec": head["template"]["spec"]}]
    for g in spec.get("workerGroupSpecs", []):
        out.append({"name": g["groupName"], "min": g.get("minReplicas", 0), "max": g.get("maxReplicas"),
                    "params": g.get("rayStartParams", {}), "spec": g["template"]["spec"]})
    return out


def dockerfile() -> dict:
    text = (CLUSTER / "Dockerfile").read_text()
    (image,) = re.findall(r"docker build -f cluster/Dockerfile -t (\S+) \.", text)
    (base,) = re.findall(r"^ARG BASE=rayproject/ray:(\d+\.\d+\.\d+)", text, re.M)
    (workdir,) = re.findall(r"^WORKDIR (\S+)", text, re.M)
    return {"image": image, "ray": base, "workdir": workdir}


def study_config(doc: dict) -> tuple[Path, WhaleConfig]:
    """The config the manifest runs: the RayJob's entrypoint (a path in the image's checkout), or for the
    RayCluster the README's `ray job submit` command (a path in the shipped working dir)."""
    if doc["kind"] == "RayJob":
        argv = shlex.split(doc["spec"]["entrypoint"])
        assert argv[:2] == ["whale", "run"] and argv[argv.index("--ray-address") + 1] == "auto", argv
        in_image = Path(argv[argv.index("--config") + 1])
        path = REPO / in_image.relative_to(dockerfile()["workdir"])
    else:
        readme = (CLUSTER / "README.md").read_text()
        submit = re.search(r"ray job submit [^\n]*(?:\\\n[^\n]*)*", readme).group(0)
        argv = shlex.split(submit.replace("\\\n", " "))
        assert "--working-dir" in argv and argv[argv.index("--working-dir") + 1] == "."
        path = REPO / argv[argv.index("--config") + 1]
    assert path.is_file(), path
    return path, load_config(path)


def mounts(pod: dict) -> dict[str, dict]:
    """mountPath -> {"readOnly", "volume"} over the pod's containers (the Ray container is the first)."""
    volumes = {v["name"]: v for v in pod["spec"].get("volumes", [])}
    out = {}
    for m in pod["spec"]["containers"][0].get("volumeMounts", []):
        out[m["mountPath"]] = {"readOnly": m.get("readOnly", False), "volume": volumes[m["name"]]}
    return out


def claims() -> dict[str, dict]:
    docs = [d for d in yaml.safe_load_all((CLUSTER / "storage.yaml").read_text()) if d]
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == "PersistentVolumeClaim"}


def mount_of(pod: dict, path: Path) -> tuple[str, dict] | None:
    hits = [(mp, m) for mp, m in mounts(pod).items() if Path(path).is_relative_to(mp)]
    return max(hits, key=lambda h: len(h[0]), default=None)


def nodes_at_min(doc: dict) -> list[dict[str, float]]:
    """The Ray resources of the cluster at its minimum replicas, as `ray start` would give each pod."""
    out = []
    for pod in pods(doc):
        limits = pod["spec"]["containers"][0].get("resources", {}).get("limits", {})
        p = pod["params"]
        node = {"CPU": float(p.get("num-cpus", limits.get("cpu", 0))),
                "GPU": float(p.get("num-gpus", limits.get("nvidia.com/gpu", 0)))}
        if "resources" in p:
            node.update(json.loads(json.loads(p["resources"])))  # KubeRay's '"{...}"' quoting
        out += [node] * pod["min"]
    return out


# --------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("name", MANIFESTS)
def test_manifest_matches_the_crd_schema(name):
    doc = load(name)
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] in SCHEMA_FILES
    assert schema_errors(doc) == []


def test_the_schema_check_can_fail():
    doc = load("raycluster.yaml")
    typo = copy.deepcopy(doc)
    typo["spec"]["workerGroupSpecs"][0]["minReplica"] = 1  # unknown field: kubectl apply rejects it
    assert any("minReplica" in e for e in schema_errors(typo))
    wrong = copy.deepcopy(doc)
    wrong["spec"]["workerGroupSpecs"][0]["maxReplicas"] = "eight"
    assert any("maxReplicas" in e for e in schema_errors(wrong))
    del wrong["spec"]["headGroupSpec"]["template"]["spec"]["containers"]
    assert any("containers" in e for e in schema_errors(wrong))


@pytest.mark.parametrize("name", MANIFESTS)
def test_manifest_runs_the_image_the_dockerfile_builds(name):
    doc, built = load(name), dockerfile()
    assert cluster_spec(doc)["rayVersion"] == built["ray"]
    for pod in pods(doc):
        assert [c["image"] for c in pod["spec"]["containers"]] == [built["image"]], pod["name"]
    if doc["kind"] == "RayJob":  # the image holds the code; a working_dir would be the submitter pod's folder
        assert "working_dir" not in doc["spec"].get("runtimeEnvYAML", "")


@pytest.mark.parametrize("name", MANIFESTS)
def test_config_paths_are_on_volumes_every_pod_mounts(name):
    doc = load(name)
    path, cfg = study_config(doc)
    run_dir = resolve_run_dir(cfg.run_dir, cfg.storage)
    storage = storage_root(cfg.storage)
    assert storage is not None and run_dir.is_relative_to(storage)  # run dir and policy cache together
    reads = [cfg.policy.model, cfg.data.train_path, *cfg.data.test_paths]
    rwx = {n for n, c in claims().items() if "ReadWriteMany" in c["spec"]["accessModes"]}
    for pod in pods(doc):
        hit = mount_of(pod, run_dir)
        assert hit is not None, f"{name} {pod['name']}: {run_dir} is on no volume it mounts"
        _, m = hit
        assert not m["readOnly"] and m["volume"]["persistentVolumeClaim"]["claimName"] in rwx, (pod["name"], m)
        for p in reads:
            assert mount_of(pod, p) is not None, f"{name} {pod['name']}: {p} (from {path.name}) is on no volume"


@pytest.mark.parametrize("name", MANIFESTS)
def test_groups_hold_the_roles_of_the_config(name):
    doc = load(name)
    _, cfg = study_config(doc)
    spec = cluster_spec(doc)
    assert spec["enableInTreeAutoscaling"] is True
    groups = pods(doc)[1:]
    gpu = [g for g in groups if "nvidia.com/gpu" in g["spec"]["containers"][0]["resources"]["limits"]]
    cpu = [g for g in groups if g not in gpu]
    assert gpu and cpu
    assert all(g["min"] < g["max"] for g in cpu)  # the evaluators' group autoscales
    assert pods(doc)[0]["params"]["num-cpus"] == "0"  # no actor on the head
    trains = has_phase(cfg, "weight")
    nodes = nodes_at_min(doc)
    assert infeasible(role_demands(cfg, trains, sum(n.get("CPU", 0.0) for n in nodes)), nodes) is None
    # evaluators land only where their custom resource is: the CPU group
    for key in cfg.resources.evaluator.resources:
        assert all(key in json.loads(json.loads(g["params"].get("resources", '"{}"'))) for g in cpu)
        assert not any(key in g["params"].get("resources", "") for g in gpu)
    assert cfg.resources.policy_server.num_gpus >= 1 and cfg.weight.use_gpu


@pytest.mark.parametrize("name", MANIFESTS)
def test_pods_can_run_bubblewrap(name):
    """bubblewrap makes user, pid and mount namespaces and mounts a fresh /proc: the pod needs its own user
    namespace (hostUsers: false), an unmasked /proc (procMount: Unmasked, which Kubernetes allows only with
    hostUsers: false), and no seccomp or AppArmor profile that forbids unshare and mount."""
    for pod in pods(load(name)):
        spec = pod["spec"]
        assert spec.get("hostUsers") is False, pod["name"]
        assert spec["securityContext"]["seccompProfile"] == {"type": "Unconfined"}
        assert spec["securityContext"]["appArmorProfile"] == {"type": "Unconfined"}
        for c in spec["containers"]:
            assert c["securityContext"]["procMount"] == "Unmasked", pod["name"]
            assert not c["securityContext"].get("privileged", False)
