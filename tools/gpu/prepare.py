"""Bring what a GPU machine without network lacks, in one git-ignored folder that travels with the checkout.

Run on a machine that reaches PyPI, in the checkout that will travel (its tracked tree counts toward the same limit),
with megarl installed (its environment names the versions to carry):

    python tools/gpu/prepare.py --out .gpu-carry [--python 3.12] [--xz-preset 6] [--max-mib 64] [--dry-run]

The reference GPU machine has Python 3.12, torch with CUDA and an older transformers, but no megatron-core, Ray or
omegaconf, and no network. This downloads, for CPython `--python` on manylinux x86_64 and at the versions installed
here:
  - wheels of what megarl imports there (ROOTS) and their dependency closure, except torch and what torch brings (the
    GPU machine's CUDA torch is never replaced); `tools/gpu/kit.py install` later installs only those the machine
    lacks or has at a version outside what megarl and the carried packages require (`requires` in the manifest);
  - Ray as `ray-slim.tar.xz`: its wheel (about 79 MB) unpacked without the Java jars, the dashboard's web build and
    the RLlib / Serve / Data / Tune / Train libraries, which megarl does not use; the kit unpacks it next to the wheels.
`manifest.json` lists every file with its size and sha256, and each wheel's package, version and requirement.
What travels (the checkout's tracked and untracked-not-ignored files, plus this folder) must stay within 64 MiB: this
refuses (exit 1) when it would not. --dry-run writes the manifest of the plan and downloads nothing.
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
from packaging.specifiers import SpecifierSet

REPO = Path(__file__).resolve().parents[2]
LIMIT_BYTES = 64 * 2**20
"""What one device call carries: the checkout's travelling files plus the carried folders."""
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_28_x86_64", "manylinux_2_17_x86_64")
ROOTS = (
    *("megatron-core", "omegaconf", "transformers", "ray", "psutil", "rich", "safetensors", "huggingface-hub"),
    *("pytest", "pytest-timeout"),  # the kit's test runner and its per-test limit (kept from the image if there)
)
"""What megarl's GPU tests and benchmarks import on the GPU machine; their dependencies follow."""
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


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def target_markers(python: str) -> dict[str, str]:
    """The GPU machine, for evaluating requirement markers."""
    return {"python_version": python, "python_full_version": python + ".0", "sys_platform": "linux",
            "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix", "implementation_name":
            "cpython", "platform_python_implementation": "CPython", "extra": ""}  # fmt: skip


def dependency_closure(python: str = "3.12", roots: tuple[str, ...] = ROOTS) -> tuple[dict[str, str], dict[str, str]]:
    """({package: version installed here}, {package: what megarl and the closure require of it}) for `roots` and
    everything they require (no extras), less what the GPU machine's torch brings."""
    markers = target_markers(python)
    found: dict[str, str] = {}
    wanted: dict[str, SpecifierSet] = {}
    todo = [Requirement(r) for r in requires("megarl") or [] if canonical(Requirement(r).name) in map(canonical, roots)]
    missing = [r for r in roots if _installed(r) is None]
    if missing:
        raise SystemExit(f"not installed here: {', '.join(missing)} (pip install -e '.[dev]' -c constraints.txt)")
    todo += [Requirement(r) for r in roots]
    while todo:
        requirement = todo.pop()
        name = canonical(requirement.name)
        if name in ON_THE_GPU_MACHINE or name.startswith("nvidia-"):
            continue
        wanted[name] = wanted.get(name, SpecifierSet()) & requirement.specifier
        if name in found or (installed := _installed(name)) is None:
            continue  # seen, or a platform-conditional requirement not installed here
        found[name] = installed
        for text in requires(name) or []:
            child = Requirement(text)
            if child.marker is None or child.marker.evaluate(markers):  # extras are never asked for
                todo.append(child)
    return dict(sorted(found.items())), {name: str(wanted[name]) for name in sorted(found)}


def _installed(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def download_wheels(packages: dict[str, str], folder: Path, python: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    specs = [f"{name}=={ver}" for name, ver in packages.items()]
    subprocess.run(
        [
            *(sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary", ":all:"),
            *("--python-version", python, "--implementation", "cp", *platforms, "-d", str(folder), *specs),
        ],
        check=True,
    )


def slim_ray(ray_version: str, out: Path, python: str, preset: int = 6) -> Path:
    """Ray's wheel, unpacked without what megarl never imports, as a .tar.xz of its site-packages tree."""
    with tempfile.TemporaryDirectory() as tmp:
        download_wheels({"ray": ray_version}, Path(tmp), python)
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
        with tarfile.open(target, "w:xz", preset=preset) as archive:
            for path in sorted(tree.iterdir()):
                archive.add(path, arcname=path.name)
    return target


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def travelling_bytes(repo: Path = REPO, leave_out: Path | None = None) -> int:
    """Bytes of what a device call sends besides the carried folders: tracked and untracked-not-ignored files."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=repo,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    skip = leave_out.resolve() if leave_out is not None else None
    total = 0
    for name in filter(None, listed):
        path = repo / name.decode()
        if path.is_file() and not path.is_symlink() and (skip is None or not path.resolve().is_relative_to(skip)):
            total += path.stat().st_size
    return total


def size_problem(carry_bytes: int, tree_bytes: int, limit: int = LIMIT_BYTES) -> str | None:
    """Why the carry and the checkout would not travel together (None: they fit)."""
    total = carry_bytes + tree_bytes
    if total <= limit:
        return None
    return (
        f"the carry ({carry_bytes / 2**20:.1f} MiB) and the checkout's travelling files ({tree_bytes / 2**20:.1f} "
        f"MiB, git ls-files) add up to {total / 2**20:.1f} MiB, over the {limit / 2**20:.0f} MiB one device call "
        f"carries by {(total - limit) / 2**20:.1f} MiB: drop packages the GPU machine has, or untracked files"
    )


def wheel_package(filename: str) -> str:
    return canonical(filename.split("-")[0])


def write_manifest(out: Path, packages: dict[str, str], wanted: dict[str, str], ray_version: str, **extra) -> dict:
    files = sorted(p for p in out.rglob("*") if p.is_file() and p.name != MANIFEST)
    wheels = {wheel_package(p.name): p for p in files if p.suffix == ".whl"}
    manifest = {
        "python": extra.pop("python", "3.12"),
        "platforms": list(PLATFORMS),
        "packages": packages,
        "wheels": [
            {
                "name": name,
                "version": packages[name],
                "file": str(wheels[name].relative_to(out)),
                "requires": wanted.get(name, ""),
            }
            for name in sorted(wheels)
            if name in packages
        ],
        "ray": {"version": ray_version, "archive": RAY_ARCHIVE, "dropped": list(RAY_DROPPED)},
        "install": "bash tools/gpu/run.sh install",
        "files": [{"path": str(p.relative_to(out)), "bytes": p.stat().st_size, "sha256": sha256(p)} for p in files],
        "total_bytes": sum(p.stat().st_size for p in files),
        "limit_bytes": extra.pop("limit_bytes", LIMIT_BYTES),
        "dry_run": False,
        **extra,
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(".gpu-carry"))
    parser.add_argument("--python", default="3.12", help="the GPU machine's Python (the kit's CPU test: this one's)")
    parser.add_argument("--xz-preset", type=int, default=6, choices=range(10), help="Ray's archive: 0 fast, 9 small")
    parser.add_argument("--max-mib", type=int, default=LIMIT_BYTES >> 20, help="what one device call carries")
    parser.add_argument("--dry-run", action="store_true", help="write the manifest of the plan; download nothing")
    args = parser.parse_args(argv)
    limit = args.max_mib << 20
    if not re.fullmatch(r"3\.\d+", args.python):
        parser.error(f"--python {args.python}: give MAJOR.MINOR, e.g. 3.12")
    tree_bytes = travelling_bytes(leave_out=args.out)
    problem = size_problem(0, tree_bytes, limit)
    if problem:
        print(f"prepare: {problem}", file=sys.stderr)
        return 1
    packages, wanted = dependency_closure(args.python)
    ray_version = packages.pop("ray")
    if args.out.exists():
        shutil.rmtree(args.out)
    args.out.mkdir(parents=True)
    if not args.dry_run:
        print(f"downloading {len(packages)} wheels for CPython {args.python} ...", flush=True)
        download_wheels(packages, args.out / "wheels", args.python)
        print(f"ray {ray_version}: downloading and slimming (xz preset {args.xz_preset}) ...", flush=True)
        slim_ray(ray_version, args.out, args.python, args.xz_preset)
    manifest = write_manifest(
        args.out,
        packages,
        wanted,
        ray_version,
        python=args.python,
        dry_run=args.dry_run,
        tree_bytes=tree_bytes,
        limit_bytes=limit,
    )
    size = manifest["total_bytes"]
    ray_bytes = next((f["bytes"] for f in manifest["files"] if f["path"] == RAY_ARCHIVE), 0)
    print(
        f"{args.out}: {len(manifest['files'])} files, {size / 2**20:.1f} MiB (Ray {ray_bytes / 1e6:.1f} MB); with "
        f"the checkout's {tree_bytes / 2**20:.1f} MiB: {(size + tree_bytes) / 2**20:.1f} MiB of {args.max_mib} MiB"
    )
    problem = size_problem(size, tree_bytes, limit)
    if problem:
        manifest["refused"] = problem
        (args.out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        print(f"prepare: refused: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
