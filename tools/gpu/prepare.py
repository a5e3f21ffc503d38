"""Bring what the reference GPU machine lacks (../shared/GPU.md), in one git-ignored folder of at most 64 MiB.

Run on a CPU machine that reaches PyPI, from the repo root, with megarl installed (its environment names the
versions to carry):

    python tools/gpu/prepare.py --out .gpu-carry [--dry-run]

The GPU machine has Python 3.12, torch with CUDA and an older transformers, but no megatron-core, Ray or omegaconf,
and no network. This downloads, for CPython 3.12 on manylinux x86_64 and at the versions installed here:
  - wheels of megarl's runtime dependencies and their dependency closure, except torch and what torch brings
    (the GPU machine's CUDA torch must never be replaced);
  - Ray as `ray-slim.tar.xz`: its wheel (about 79 MB) unpacked without the Java jars and the RLlib / Serve / Data /
    Tune / Train libraries, which megarl does not use (about 30 MB); `run.sh` extracts it onto PYTHONPATH.
`manifest.json` lists every file with its size and sha256, and the exact install command `tools/gpu/run.sh` runs.
--dry-run writes the manifest of what would be downloaded (no sizes or sums) and downloads nothing.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from importlib.metadata import PackageNotFoundError, requires, version
from pathlib import Path

from packaging.requirements import Requirement

LIMIT_BYTES = 64 * 2**20
PYTHON, PLATFORMS = "3.12", ("manylinux2014_x86_64", "manylinux_2_28_x86_64", "manylinux_2_17_x86_64")
ROOTS = ("megatron-core", "omegaconf", "transformers", "ray", "psutil", "rich", "safetensors", "huggingface-hub")
"""What megarl imports on the GPU machine (its tests and benchmarks); their dependencies follow."""
TARGET = {"python_version": PYTHON, "python_full_version": PYTHON + ".3", "sys_platform": "linux",
          "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix", "extra": ""}  # fmt: skip
"""The GPU machine, for evaluating requirement markers."""
ON_THE_GPU_MACHINE = {
    # torch and everything torch itself requires come with the machine's CUDA torch: never carried, never replaced
    "torch", "triton", "sympy", "mpmath", "networkx", "jinja2", "markupsafe", "fsspec", "filelock", "setuptools",
    "typing-extensions", "numpy",
}  # fmt: skip
RAY_DROPPED = (
    *("ray/jars", "ray/rllib", "ray/serve", "ray/data", "ray/tune", "ray/train", "ray/llm", "ray/air/examples"),
    "ray/dashboard/client",  # the web UI's JavaScript build: ray.init(include_dashboard=False) never serves it
)
RAY_ARCHIVE = "ray-slim.tar.xz"
MANIFEST = "manifest.json"


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def dependency_closure(roots: tuple[str, ...] = ROOTS, skip: set[str] = ON_THE_GPU_MACHINE) -> dict[str, str]:
    """{package: installed version} of `roots` and everything they require (no extras), as installed here."""
    found: dict[str, str] = {}
    todo = [_canonical(r) for r in roots]
    while todo:
        name = todo.pop()
        if name in found or name in skip or name.startswith("nvidia-"):
            continue
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            continue  # a platform-conditional requirement not installed here
        for text in requires(name) or []:
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate(TARGET):  # extras are never asked for
                todo.append(_canonical(requirement.name))
    return dict(sorted(found.items()))


def install_command(carry: str = "$CARRY") -> str:
    """What run.sh runs on the GPU machine: every carried wheel, offline, never touching torch."""
    return (
        f"python -m pip install --no-index --find-links {carry}/wheels --no-deps "
        f"--upgrade-strategy only-if-needed {carry}/wheels/*.whl"
    )


def download_wheels(packages: dict[str, str], folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    specs = [f"{name}=={ver}" for name, ver in packages.items()]
    subprocess.run(
        [
            *(sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary", ":all:"),
            *("--python-version", PYTHON, "--implementation", "cp", *platforms, "-d", str(folder), *specs),
        ],
        check=True,
    )


def slim_ray(ray_version: str, out: Path) -> Path:
    """Ray's cp312 wheel, unpacked without what megarl never imports, as a .tar.xz of its site-packages tree."""
    with tempfile.TemporaryDirectory() as tmp:
        download_wheels({"ray": ray_version}, Path(tmp))
        (wheel,) = Path(tmp).glob("ray-*.whl")
        tree = Path(tmp) / "site"
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(tree)
            for info in archive.infolist():  # zipfile drops Unix modes: raylet and gcs_server must stay executable
                mode = (info.external_attr >> 16) & 0o777
                if mode and not info.is_dir():
                    (tree / info.filename).chmod(mode)
        for dropped in RAY_DROPPED:
            shutil.rmtree(tree / dropped, ignore_errors=True)
        target = out / RAY_ARCHIVE
        with tarfile.open(target, "w:xz", preset=6) as archive:
            for path in sorted(tree.iterdir()):
                archive.add(path, arcname=path.name)
    return target


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(out: Path, packages: dict[str, str], ray_version: str, dry_run: bool) -> dict:
    files = sorted(p for p in out.rglob("*") if p.is_file() and p.name != MANIFEST)
    manifest = {
        "python": PYTHON,
        "platforms": list(PLATFORMS),
        "packages": packages,
        "ray": {"version": ray_version, "archive": RAY_ARCHIVE, "dropped": list(RAY_DROPPED)},
        "install": install_command(),
        "dry_run": dry_run,
        "files": [{"path": str(p.relative_to(out)), "bytes": p.stat().st_size, "sha256": _sha256(p)} for p in files],
        "total_bytes": sum(p.stat().st_size for p in files),
        "limit_bytes": LIMIT_BYTES,
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(".gpu-carry"))
    parser.add_argument("--dry-run", action="store_true", help="write the manifest of the plan; download nothing")
    args = parser.parse_args(argv)
    packages = dependency_closure()
    ray_version = version("ray")
    for name in ("ray", *ON_THE_GPU_MACHINE):
        packages.pop(name, None)
    if args.out.exists():
        shutil.rmtree(args.out)
    args.out.mkdir(parents=True)
    if not args.dry_run:
        print(f"downloading {len(packages)} wheels for CPython {PYTHON} ...", flush=True)
        download_wheels(packages, args.out / "wheels")
        print(f"ray {ray_version}: downloading and slimming ...", flush=True)
        slim_ray(ray_version, args.out)
    manifest = write_manifest(args.out, packages, ray_version, args.dry_run)
    size = manifest["total_bytes"]
    print(f"{args.out}: {len(manifest['files'])} files, {size / 2**20:.1f} MiB (limit {LIMIT_BYTES / 2**20:.0f} MiB)")
    if size > LIMIT_BYTES:
        print(
            f"too large by {(size - LIMIT_BYTES) / 2**20:.1f} MiB: drop packages the GPU machine has", file=sys.stderr
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
