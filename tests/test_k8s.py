"""tools/k8s/megarl-rayjob.yaml: a well-formed KubeRay RayJob that runs the Slurm template's entry command.

No RayJob schema ships in a Python package, so the RayJob part is a structural check written from KubeRay's v1 CRD
(ray-operator/config/crd/bases/ray.io_rayjobs.yaml): the required fields (rayClusterSpec.headGroupSpec.template;
per worker group groupName, minReplicas, maxReplicas, template), their types (rayStartParams values are strings,
replica counts integers) and what KubeRay checks at admission (minReplicas <= replicas <= maxReplicas). The pod
templates inside are checked against Kubernetes' own OpenAPI schemas (the kubernetes-validate package, strict: no
unknown fields) where that package is installed.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import jsonschema
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
MANIFEST = REPO / "tools" / "k8s" / "megarl-rayjob.yaml"
SBATCH = REPO / "tools" / "slurm" / "megarl.sbatch"
IMAGE_CHECKOUT = "/opt/megarl/"  # where tools/slurm/Dockerfile puts the megarl checkout

_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_TEMPLATE = {"type": "object", "required": ["spec"], "properties": {"spec": {"type": "object"}}}
RAYJOB_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "ray.io/v1"},
        "kind": {"const": "RayJob"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "required": ["entrypoint", "rayClusterSpec"],
            "properties": {
                "entrypoint": {"type": "string", "minLength": 1},
                "submissionMode": {"enum": ["K8sJobMode", "HTTPMode", "InteractiveMode", "SidecarMode"]},
                "shutdownAfterJobFinishes": {"type": "boolean"},
                "ttlSecondsAfterFinished": {"type": "integer", "minimum": 0},
                "backoffLimit": {"type": "integer", "minimum": 0},
                "rayClusterSpec": {
                    "type": "object",
                    "required": ["headGroupSpec"],
                    "properties": {
                        "rayVersion": {"type": "string"},
                        "enableInTreeAutoscaling": {"type": "boolean"},
                        "headGroupSpec": {
                            "type": "object",
                            "required": ["template"],
                            "properties": {"rayStartParams": _STRING_MAP, "template": _TEMPLATE},
                        },
                        "workerGroupSpecs": {
                            "type": "array",
                            "minItems": 1,
                            "items": {
                                "type": "object",
                                "required": ["groupName", "minReplicas", "maxReplicas", "template"],
                                "properties": {
                                    "groupName": {"type": "string", "minLength": 1},
                                    "replicas": {"type": "integer", "minimum": 0},
                                    "minReplicas": {"type": "integer", "minimum": 0},
                                    "maxReplicas": {"type": "integer", "minimum": 0},
                                    "rayStartParams": _STRING_MAP,
                                    "template": _TEMPLATE,
                                },
                            },
                        },
                    },
                },
            },
        },
    },
}


@pytest.fixture(scope="module")
def rayjob() -> dict:
    (document,) = list(yaml.safe_load_all(MANIFEST.read_text()))
    return document


def pod_templates(rayjob: dict) -> dict[str, dict]:
    cluster = rayjob["spec"]["rayClusterSpec"]
    templates = {"head": cluster["headGroupSpec"]["template"]}
    templates.update({group["groupName"]: group["template"] for group in cluster["workerGroupSpecs"]})
    return templates


def test_rayjob_structure(rayjob):
    jsonschema.validate(rayjob, RAYJOB_SCHEMA)
    for group in rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"]:
        assert group["minReplicas"] <= group.get("replicas", group["minReplicas"]) <= group["maxReplicas"], group


def test_pods_mount_what_they_declare(rayjob):
    for name, template in pod_templates(rayjob).items():
        volumes = {volume["name"]: volume for volume in template["spec"]["volumes"]}
        for container in template["spec"]["containers"]:
            mounts = {mount["mountPath"]: mount["name"] for mount in container["volumeMounts"]}
            assert set(mounts.values()) <= set(volumes), (name, container["name"])
            for path in ("/data", "/models", "/checkpoints", "/cache", "/dev/shm"):
                assert path in mounts, f"{name}: nothing mounted at {path}"
            assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"


def test_gpu_workers_ask_for_gpus(rayjob):
    for group in rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"]:
        (container,) = group["template"]["spec"]["containers"]
        limits = container["resources"]["limits"]
        assert int(limits["nvidia.com/gpu"]) >= 1
        assert container["resources"]["requests"]["nvidia.com/gpu"] == limits["nvidia.com/gpu"]
    head = rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0"


def test_pod_templates_are_valid_kubernetes():
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")
    (rayjob,) = list(yaml.safe_load_all(MANIFEST.read_text()))
    for name, template in pod_templates(rayjob).items():
        resource = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name}, "template": template}
        kubernetes_validate.validate(resource, "1.30.0", strict=True)


def slurm_entry_command() -> list[str]:
    """The Slurm template's default entry command: $MEGARL_CMD --config CONFIG [overrides] cluster.address=auto."""
    text = SBATCH.read_text()
    command = re.search(r"^MEGARL_CMD=\$\{MEGARL_CMD:-(.+)\}$", text, re.MULTILINE).group(1)
    entry = re.search(r"^ENTRY=\((.+)\)$", text, re.MULTILINE).group(1)
    assert entry == '$MEGARL_CMD --config "$CONFIG" "${OVERRIDES[@]}" cluster.address=auto'
    return shlex.split(command)


def test_same_entry_command_as_slurm(rayjob):
    words = shlex.split(rayjob["spec"]["entrypoint"])
    command = slurm_entry_command()
    assert command == ["megarl", "train"]
    assert words[: len(command)] == command
    assert words[len(command)] == "--config" and words[-1] == "cluster.address=auto"
    config = words[len(command) + 1]
    assert config.startswith(IMAGE_CHECKOUT) and (REPO / config.removeprefix(IMAGE_CHECKOUT)).is_file()


def test_workers_match_the_config(rayjob):
    from megarl.plan.command import load_for_planning

    words = shlex.split(rayjob["spec"]["entrypoint"])
    config, _ = load_for_planning(REPO / words[words.index("--config") + 1].removeprefix(IMAGE_CHECKOUT))
    groups = rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    nodes = sum(group["replicas"] for group in groups)
    gpus = {
        int(group["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]) for group in groups
    }
    assert nodes == config.cluster.num_nodes and gpus == {config.cluster.gpus_per_node}
    env = {e["name"]: e["value"] for e in groups[0]["template"]["spec"]["containers"][0]["env"]}
    assert config.plan.model_config and env["MEGARL_DATA"] == "/data" and env["MEGARL_RUNS"] == "/checkpoints"
