"""tools/k8s/*.yaml: KubeRay RayJobs (and their volumes) that Kubernetes accepts, rendered by tools/k8s/render.py.

Each manifest is rendered with its defaults and a value for every required variable, then checked: the RayJob
against a structural schema written from KubeRay's v1 CRD (ray-operator/config/crd/bases/ray.io_rayjobs.yaml: the
required fields, their types - rayStartParams values are strings, replica counts integers - and what KubeRay checks
at admission: minReplicas <= replicas <= maxReplicas), since no RayJob schema ships in a Python package; every pod
template and every other object against Kubernetes' own OpenAPI schema of version K8S_VERSION (kubernetes-validate,
strict: no unknown fields).
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
MANIFESTS = sorted((REPO / "tools" / "k8s").glob("*.yaml"))
RENDER = REPO / "tools" / "k8s" / "render.py"
SBATCH = REPO / "tools" / "slurm" / "megarl.sbatch"
IMAGE_CHECKOUT = "/opt/megarl/"  # where tools/slurm/Dockerfile puts the megarl checkout
K8S_VERSION = "1.30.0"
REQUIRED = {"MEGARL_IMAGE": "registry.example.com/megarl:test", "MEGARL_STORAGE_CLASS": "lustre-rwx"}

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


sys.path.insert(0, str(RENDER.parent))
from render import render, variables  # noqa: E402


def rendered(manifest: Path, **values: str) -> list[dict]:
    text = manifest.read_text()
    given = {name: value for name, value in {**REQUIRED, **values}.items() if name in variables(text)}
    return [doc for doc in yaml.safe_load_all(render(text, given, environ={})) if doc]


def the_rayjob(documents: list[dict]) -> dict:
    (job,) = [doc for doc in documents if doc["kind"] == "RayJob"]
    return job


@pytest.fixture(params=MANIFESTS, ids=lambda path: path.name)
def manifest(request) -> Path:
    return request.param


@pytest.fixture
def rayjob(manifest) -> dict:
    return the_rayjob(rendered(manifest))


def test_there_is_a_671b_manifest():
    assert [path.name for path in MANIFESTS] == ["megarl-rayjob-671b.yaml", "megarl-rayjob.yaml"]


def pod_templates(rayjob: dict) -> dict[str, dict]:
    cluster = rayjob["spec"]["rayClusterSpec"]
    templates = {"head": cluster["headGroupSpec"]["template"]}
    templates.update({group["groupName"]: group["template"] for group in cluster["workerGroupSpecs"]})
    return templates


def test_rayjob_structure(rayjob):
    jsonschema.validate(rayjob, RAYJOB_SCHEMA)
    for group in rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"]:
        assert group["minReplicas"] <= group.get("replicas", group["minReplicas"]) <= group["maxReplicas"], group


def test_every_object_and_pod_template_is_valid_kubernetes(manifest):
    documents = rendered(manifest)
    for document in documents:
        if document["kind"] != "RayJob":
            kubernetes_validate.validate(document, K8S_VERSION, strict=True)
    for name, template in pod_templates(the_rayjob(documents)).items():
        resource = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name}, "template": template}
        kubernetes_validate.validate(resource, K8S_VERSION, strict=True)


def test_pods_mount_what_they_declare(rayjob):
    for name, template in pod_templates(rayjob).items():
        volumes = {volume["name"]: volume for volume in template["spec"]["volumes"]}
        for container in template["spec"]["containers"]:
            mounts = {mount["mountPath"]: mount["name"] for mount in container["volumeMounts"]}
            assert set(mounts.values()) <= set(volumes), (name, container["name"])
            for path in ("/data", "/models", "/checkpoints", "/cache", "/dev/shm"):
                assert path in mounts, f"{name}: nothing mounted at {path}"
            shm = volumes[mounts["/dev/shm"]]["emptyDir"]
            assert shm["medium"] == "Memory" and int(shm["sizeLimit"].removesuffix("Gi")) >= 256


def test_gpu_workers_ask_for_gpus(rayjob):
    for group in rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"]:
        (container,) = group["template"]["spec"]["containers"]
        limits = container["resources"]["limits"]
        assert int(limits["nvidia.com/gpu"]) >= 1
        assert container["resources"]["requests"]["nvidia.com/gpu"] == limits["nvidia.com/gpu"]
    head = rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0"


def test_671b_job_has_shared_volumes_a_large_shm_and_a_long_grace_period():
    documents = rendered(REPO / "tools" / "k8s" / "megarl-rayjob-671b.yaml")
    claims = {doc["metadata"]["name"]: doc for doc in documents if doc["kind"] == "PersistentVolumeClaim"}
    assert set(claims) == {"megarl-checkpoints", "megarl-cache"}
    assert all(claim["spec"]["accessModes"] == ["ReadWriteMany"] for claim in claims.values())
    assert {claim["spec"]["storageClassName"] for claim in claims.values()} == {"lustre-rwx"}
    job = the_rayjob(documents)
    (group,) = job["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    assert group["replicas"] == 16
    for template in pod_templates(job).values():
        # SIGTERM on eviction: the trainer ends its step and writes a checkpoint before the pod may be killed
        assert template["spec"]["terminationGracePeriodSeconds"] >= 600
        claimed = {
            v["persistentVolumeClaim"]["claimName"] for v in template["spec"]["volumes"] if "persistentVolumeClaim" in v
        }
        assert set(claims) <= claimed
    text = (REPO / "tools" / "k8s" / "megarl-rayjob-671b.yaml").read_text()
    assert "KubeRay operator >= 1.2" in text and "rdma/" in text  # the operator version and the RDMA block


def test_every_variable_renders_where_it_belongs(manifest):
    """A distinctive value for every variable: none is left as `${...}`, each lands in the rendered manifest, and
    the values a user most often changes land in the right fields."""
    names = variables(manifest.read_text())
    values = {name: f"v-{name.lower().replace('_', '-')}" for name in names}
    values.update(MEGARL_WORKERS="3", MEGARL_RETRIES="5", MEGARL_GPUS_PER_NODE="4", MEGARL_SHM_SIZE="300Gi")
    values = {name: value for name, value in values.items() if name in names}
    text = render(manifest.read_text(), values, environ={})
    assert "${" not in text
    for name, value in values.items():
        assert value in text, name
    job = the_rayjob([doc for doc in yaml.safe_load_all(text) if doc])
    (group,) = job["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    assert (group["replicas"], group["minReplicas"], group["maxReplicas"]) == (3, 3, 3)
    assert job["spec"]["backoffLimit"] == 5
    assert "cluster.num_nodes=3" in shlex.split(job["spec"]["entrypoint"])
    for template in pod_templates(job).values():
        assert {c["image"] for c in template["spec"]["containers"]} == {values["MEGARL_IMAGE"]}
    if "MEGARL_GPUS_PER_NODE" in values:
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == "4" and "cluster.gpus_per_node=4" in job["spec"]["entrypoint"]


def test_render_names_a_missing_value_and_an_unknown_name(tmp_path):
    manifest = REPO / "tools" / "k8s" / "megarl-rayjob-671b.yaml"
    run = lambda *args: subprocess.run([sys.executable, str(RENDER), *map(str, args)], capture_output=True, text=True)  # noqa: E731
    missing = run(manifest, "MEGARL_IMAGE=x")
    assert missing.returncode == 2 and "no value for MEGARL_STORAGE_CLASS" in missing.stderr
    typo = run(manifest, "MEGARL_IMAGE=x", "MEGARL_STORAGE_CLASS=y", "MEGARL_WORKER=3")
    assert typo.returncode == 2 and "not variables of this manifest: MEGARL_WORKER;" in typo.stderr
    listed = run("--list", manifest)
    assert "MEGARL_IMAGE (required)" in listed.stdout and "MEGARL_WORKERS=16" in listed.stdout
    ok = run(manifest, "MEGARL_IMAGE=x", "MEGARL_STORAGE_CLASS=y")
    assert ok.returncode == 0 and len([d for d in yaml.safe_load_all(ok.stdout) if d]) == 3


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
    from megarl.plan_command import load_for_planning

    words = shlex.split(rayjob["spec"]["entrypoint"])
    at = words.index("--config")
    config, _ = load_for_planning(REPO / words[at + 1].removeprefix(IMAGE_CHECKOUT), words[at + 2 :])
    groups = rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    nodes = sum(group["replicas"] for group in groups)
    gpus = {
        int(group["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]) for group in groups
    }
    assert nodes == config.cluster.num_nodes and gpus == {config.cluster.gpus_per_node}
    env = {e["name"]: e["value"] for e in groups[0]["template"]["spec"]["containers"][0]["env"]}
    assert config.plan.model_config and env["MEGARL_DATA"] == "/data" and env["MEGARL_RUNS"] == "/checkpoints"
