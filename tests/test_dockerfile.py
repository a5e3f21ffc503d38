"""tools/slurm/Dockerfile: the one image of the Slurm and KubeRay templates, checked on CPU against what megarl's
tests run with (the image itself needs a GPU build machine and is not built here).

The image starts FROM SGLang's release image and keeps its torch and transformers; those are SGLang's exact pins
(read from the installed sglang package's metadata, as the README's test command installs it), so they must fall
within megarl's own ranges in pyproject.toml. The versions the Dockerfile installs on top must be the ones
pyproject.toml and constraints.txt name.
"""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

import yaml
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = (REPO / "tools" / "slurm" / "Dockerfile").read_text()


def build_args() -> dict[str, str]:
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", DOCKERFILE, re.MULTILINE))


def megarl_requirements() -> dict[str, Requirement]:
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return {Requirement(text).name: Requirement(text) for text in project["dependencies"]}


def constraint(name: str) -> str:
    return re.search(rf"^{name}==(\S+)$", (REPO / "constraints.txt").read_text(), re.MULTILINE).group(1)


def test_the_image_starts_from_the_sglang_release_megarl_is_tested_with():
    args = build_args()
    ci = (REPO / ".ci" / "run").read_text()
    tested = re.search(r"sglang==(\S+)", ci).group(1)
    assert args["SGLANG_VERSION"] == tested == metadata.version("sglang")
    assert args["SGLANG_IMAGE"].startswith("lmsysorg/sglang:v${SGLANG_VERSION}")
    assert re.search(r"^FROM \$\{SGLANG_IMAGE\}$", DOCKERFILE, re.MULTILINE)
    assert "nvcr.io/nvidia/pytorch" not in DOCKERFILE  # its torch would fight SGLang's pin


def test_sglangs_torch_and_transformers_are_within_megarls_ranges():
    pins = {Requirement(text).name: Requirement(text) for text in metadata.distribution("sglang").requires or []}
    ours = megarl_requirements()
    for name in ("torch", "transformers"):
        (spec,) = pins[name].specifier  # an exact pin: torch==2.14.1
        assert spec.operator == "==", pins[name]
        assert ours[name].specifier.contains(spec.version), f"SGLang pins {pins[name]}, megarl needs {ours[name]}"


def test_what_the_image_adds_is_what_megarl_pins():
    args = build_args()
    (megatron,) = megarl_requirements()["megatron-core"].specifier
    assert args["MEGATRON_CORE_VERSION"] == megatron.version == constraint("megatron-core")
    assert args["RAY_VERSION"] == constraint("ray")
    for manifest in (REPO / "tools" / "k8s").glob("*.yaml"):
        text = re.sub(r"\$\{\w+(:-[^}]*)?\}", "x", manifest.read_text())  # variables do not matter here
        (job,) = [doc for doc in yaml.safe_load_all(text) if doc and doc["kind"] == "RayJob"]
        assert job["spec"]["rayClusterSpec"]["rayVersion"] == args["RAY_VERSION"], manifest.name
    for name in ("TRANSFORMER_ENGINE_REF", "APEX_REF"):  # built from source at a fixed ref, never a branch
        assert args[name] not in ("main", "master", "HEAD"), name


def test_the_templates_point_at_this_image():
    assert "tools/slurm/Dockerfile" in (REPO / "tools" / "slurm" / "megarl.sbatch").read_text()
    for manifest in (REPO / "tools" / "k8s").glob("*.yaml"):
        assert "tools/slurm/Dockerfile" in manifest.read_text(), manifest.name
