"""Rebuilds the schema files of this folder from the KubeRay release's CRDs (see README.md):

    python tests/data/kuberay-1.7.0/extract.py ray.io_rayjobs.yaml ray.io_rayclusters.yaml
"""

import json
import sys
from pathlib import Path

import yaml

HERE = Path(__file__).parent
NAMES = {"RayJob": "rayjob.v1.schema.json", "RayCluster": "raycluster.v1.schema.json"}


def strip(node):
    """The schema without its prose: `description` keys only (every type, enum and required list stays)."""
    if isinstance(node, dict):
        return {k: strip(v) for k, v in node.items() if k != "description"}
    if isinstance(node, list):
        return [strip(v) for v in node]
    return node


for path in sys.argv[1:]:
    crd = yaml.safe_load(Path(path).read_text())
    v1 = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    schema = strip(v1["schema"]["openAPIV3Schema"])
    schema["properties"].pop("status")  # written by the operator, never by a manifest
    (HERE / NAMES[crd["spec"]["names"]["kind"]]).write_text(json.dumps(schema, separators=(",", ":"), sort_keys=True))
