"""The GPU kit (tools/gpu/) on CPU, as far as a machine without a GPU takes it.

- what run.sh would run (--dry-run): the GPU test files named, every GPU test in one step, limits within 7 minutes;
- prepare.py's plan (dry run), which image packages the install keeps, the refusal over 64 MiB, the sums check, the
  summary of a run's files;
- without a GPU the kit fails, saying "no GPU visible", and leaves its files in OUT;
- end to end in a fresh virtual environment built from a carry alone: the carry is prepared here for this Python
  (the GPU machine's is 3.12, whose wheels cannot run here) from PyPI, and the environment gets only what the GPU
  machine's image brings that megarl needs (this environment's torch, numpy, pip and pytest, linked in); then the
  kit's install, its GPU test files collecting, a test step, and a step stopped by its limit keeping its partial
  results. Skipped, saying so, when PyPI cannot be reached.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import urllib.request
from importlib import metadata
from pathlib import Path

import pytest
from job_helpers import REPO

sys.path.insert(0, str(REPO / "tools" / "gpu"))
import kit
import prepare

HERE = f"{sys.version_info.major}.{sys.version_info.minor}"
DEFAULT_STEPS = ["device", "install", "first", "guards", "archs", "bench-train-step", "bench-refit", "summary"]


def kit_env(tmp: Path, **folders: Path | str) -> dict[str, str]:
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", str(tmp)), "PYTHON": sys.executable}
    return env | {name.upper(): str(value) for name, value in folders.items()}


def run_sh(*args: str, env: dict, cwd: Path = REPO, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(REPO / "tools/gpu/run.sh"), *args], cwd=cwd, env=env, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip


def dry_run_steps(stdout: str) -> list[tuple[str, int, str]]:
    """[(step, limit, command)] from run.sh --dry-run."""
    lines = stdout.splitlines()
    steps = []
    for i, line in enumerate(lines):
        if match := re.match(r"^(\S+)\s+(\d+) s  ", line):
            steps.append((match[1], int(match[2]), lines[i + 1].strip()))
    return steps


def test_dry_run_names_the_gpu_test_files_and_fits_in_7_minutes(tmp_path):
    env = kit_env(tmp_path, carry="carry", out=tmp_path / "out", site=tmp_path / "site")  # CARRY relative to cwd
    out = run_sh("--dry-run", env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0].startswith(f"CARRY={tmp_path / 'carry'} OUT={tmp_path / 'out'} ")
    steps = dry_run_steps(out.stdout)
    assert [name for name, _, _ in steps] == DEFAULT_STEPS
    total = sum(limit for _, limit, _ in steps)
    assert f"total limit: {total} s" in out.stdout.splitlines()[-1] and total <= 420
    commands = {name: cmd for name, _, cmd in steps}
    first = (
        "-m pytest tests/test_gpu.py::test_bf16_logits_and_logprobs_match_transformers[tiny-qwen3] "
        "tests/test_gpu.py::test_one_colocated_step_on_one_gpu_hands_the_memory_over[grpo] -v -rA"
    )
    assert first in commands["first"]
    for name in ("first", "guards", "archs"):
        assert f"--kit-junit {tmp_path}/out/junit-{name}.xml --timeout=" in commands[name]
        assert " -m gpu" not in commands[name] and " tests " not in commands[name]
    assert commands["archs"].count("tests/test_gpu.py::") == 5 and "tests/test_sglang_gpu.py " in commands["archs"]
    assert commands["bench-refit"].endswith(f"tools/bench/gpu_refit.py --reps 3 --jsonl {tmp_path}/out/bench.jsonl")
    # what comes back from a device call: at most 8 files, none in a subfolder, whichever parts ran
    assert kit.out_files() == ["status.tsv", "kit.log", "junit-first.xml", "junit-guards.xml", "junit-archs.xml",
                               "junit-extras.xml", "bench.jsonl", "gpu-results.json"]  # fmt: skip
    # one part again: the install comes along while SITE does not hold the carry there is, the summary always
    again = dry_run_steps(run_sh("--dry-run", "guards", env=env, cwd=tmp_path).stdout)
    assert [name for name, _, _ in again] == ["guards", "summary"]  # no carry: the environment as it is
    (tmp_path / "carry").mkdir()
    (tmp_path / "carry" / "manifest.json").write_text("{}")
    again = dry_run_steps(run_sh("--dry-run", "guards", env=env, cwd=tmp_path).stdout)
    assert [name for name, _, _ in again] == ["install", "guards", "summary"]


def gpu_test_ids(path: str) -> list[str]:
    """The node ids pytest gives the tests of `path` (plain functions, one parametrize at most): read from the module
    here, as collecting in a subprocess costs a minute on a shared 2-core machine (the end-to-end test collects)."""
    module = importlib.import_module(Path(path).stem)
    ids = []
    for name, fn in vars(module).items():
        if name.startswith("test_") and callable(fn):
            params = [mark.args[1] for mark in getattr(fn, "pytestmark", []) if mark.name == "parametrize"]
            ids += [f"{path}::{name}[{value}]" for value in params[0]] if params else [f"{path}::{name}"]
    return ids


def test_every_gpu_test_runs_in_exactly_one_step():
    gpu_tests = gpu_test_ids(kit.GPU_TESTS) + gpu_test_ids(kit.SGLANG_TESTS)
    assert len(gpu_test_ids(kit.GPU_TESTS)) == 14
    covered = []
    for step in kit.STEPS:
        for node in step.nodes:
            covered += [t for t in gpu_tests if t == node or t.startswith(node + "::")]
    assert sorted(covered) == sorted(gpu_tests)  # each once, none left out


def test_the_dry_run_manifest_carries_what_megarl_needs_and_never_torch(tmp_path):
    out = subprocess.run(
        [sys.executable, "tools/gpu/prepare.py", "--out", str(tmp_path / "carry"), "--dry-run"],
        cwd=REPO, capture_output=True, text=True, check=True,
    )  # fmt: skip
    manifest = json.loads((tmp_path / "carry" / "manifest.json").read_text())
    packages = manifest["packages"]
    assert packages["megatron-core"] == "0.16.1" and packages["pytest-timeout"] == "2.4.0"
    for name in ("omegaconf", "transformers", "tokenizers", "huggingface-hub", "jsonschema", "rpds-py", "pytest"):
        assert name in packages, name
    assert not {"torch", "triton", "numpy", "sympy", "ray"} & set(packages)  # the GPU machine's own, or unpacked
    assert not any(name.startswith("nvidia-") for name in packages)
    assert manifest["ray"]["archive"] == "ray-slim.tar.xz" and "ray/rllib" in manifest["ray"]["dropped"]
    assert manifest["python"] == "3.12" and manifest["dry_run"] is True and manifest["limit_bytes"] == 64 * 2**20
    assert re.search(r"0 files, 0.0 MiB \(Ray 0.0 MB\); with the checkout's \d+\.\d MiB", out.stdout)


def test_the_install_keeps_what_the_image_has_within_megarl_s_requirements():
    """The reference GPU machine's versions (its image, read 2026-11): transformers 5.17 is older than megarl's
    minimum, so the carried one is installed; its huggingface-hub 1.33 and tokenizers 0.23.2 satisfy what the
    carried transformers requires, so they stay (the old kit replaced huggingface-hub with 2.4.0)."""
    packages, wanted = prepare.dependency_closure("3.12")
    assert wanted["transformers"] == "<5.40,>=5.19" and wanted["megatron-core"] == "==0.16.1"
    wheels = [{"name": n, "version": v, "file": f"wheels/{n}.whl", "requires": wanted[n]} for n, v in packages.items()]
    image = {"transformers": "5.17.0", "huggingface-hub": "1.33.0", "tokenizers": "0.23.2", "safetensors": "0.8.0",
             "pytest": "9.0.1", "protobuf": "6.33.0", "rich": "14.2.0", "psutil": "7.1.3"}  # fmt: skip
    chosen, kept = kit.choose_wheels(wheels, image)
    assert kept == {name: image[name] for name in image if name != "transformers"}
    installed = {w["name"] for w in chosen}
    assert {"transformers", "megatron-core", "omegaconf", "pytest-timeout", "jsonschema"} <= installed
    assert not installed & set(kept)


def test_prepare_refuses_when_the_carry_and_the_checkout_exceed_64_mib(tmp_path, monkeypatch, capsys):
    assert prepare.size_problem(int(59.1 * 2**20), int(3.5 * 2**20)) is None
    problem = prepare.size_problem(int(61.0 * 2**20), int(3.5 * 2**20))
    assert problem.startswith("the carry (61.0 MiB) and the checkout's travelling files (3.5 MiB, git ls-files) add up")
    assert "64.5 MiB, over the 64 MiB one device call carries by 0.5 MiB" in problem
    # what travels: tracked and untracked-not-ignored files; the ignored carry is not counted twice
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / ".gitignore").write_text("/carry/\n")
    (tmp_path / "tracked.txt").write_bytes(b"x" * 1000)
    (tmp_path / "carry").mkdir()
    with open(tmp_path / "carry" / "big.bin", "wb") as f:
        f.truncate(70 * 2**20)  # sparse: no disk used
    assert prepare.travelling_bytes(tmp_path) == 1000 + len("/carry/\n")
    # a checkout already over the limit is refused before anything is downloaded
    monkeypatch.setattr(prepare, "travelling_bytes", lambda leave_out=None: 65 * 2**20)
    assert prepare.main(["--out", str(tmp_path / "carry2")]) == 1
    assert "prepare: the carry (0.0 MiB) and the checkout's travelling files (65.0 MiB" in capsys.readouterr().err
    assert not (tmp_path / "carry2").exists()


def test_verify_finds_a_changed_file(tmp_path):
    (tmp_path / "wheels").mkdir()
    (tmp_path / "wheels" / "a-1.0-py3-none-any.whl").write_bytes(b"wheel bytes")
    (tmp_path / "ray-slim.tar.xz").write_bytes(b"ray")
    manifest = prepare.write_manifest(tmp_path, {"a": "1.0"}, {"a": ">=1"}, "2.60.0")
    assert manifest["wheels"] == [{"name": "a", "version": "1.0", "file": "wheels/a-1.0-py3-none-any.whl",
                                   "requires": ">=1"}]  # fmt: skip
    assert kit.verify(tmp_path) == []
    (tmp_path / "ray-slim.tar.xz").write_bytes(b"yar")
    assert kit.verify(tmp_path) == ["ray-slim.tar.xz: size or sha256 differs from the manifest"]


def test_the_summary_reads_every_step_s_files(tmp_path, capsys):
    (tmp_path / "status.tsv").write_text(
        "device\t0\t3\t30\tdevice: NVIDIA H100 80GB HBM3, 79 GiB\n"
        "first\t124\t115\t115\t\n"
        "archs\t0\t20\t55\t6 skipped\n"
        "first\t1\t100\t115\t1 failed, 1 passed\n"  # a rerun of a part: the last line of a step counts
    )
    (tmp_path / "junit-first.xml").write_text(
        '<testsuites><testsuite><testcase file="tests/test_gpu.py" name="test_a" time="20.5"/>'
        '<testcase file="tests/test_gpu.py" name="test_b" time="70"><failure message="assert 0.3 &lt; 0.05"/>'
        '</testcase></testsuite></testsuites>'
    )  # fmt: skip
    (tmp_path / "junit-archs.xml").write_text(
        '<testsuites><testsuite><testcase file="tests/test_gpu.py" name="test_c" time="0">'
        '<skipped type="pytest.skip" message="needs a CUDA GPU"/></testcase></testsuite></testsuites>'
    )
    (tmp_path / "bench.jsonl").write_text(
        '{"bench": "refit", "measurement": "cuda_ipc", "gb_per_s": 1.0}\n'
        '{"bench": "refit", "measurement": "cuda_ipc", "gb_per_s": 2.0}\n'
    )
    results = kit.summarize(tmp_path)
    assert [(s["name"], s["verdict"]) for s in results["steps"]] == [
        ("device", "ok"), ("archs", "ALL SKIPPED"), ("first", "FAILED")
    ]  # fmt: skip
    assert results["steps"][2]["tests"][1] == {"node": "tests/test_gpu.py::test_b", "outcome": "failed",
                                               "seconds": 70.0, "message": "assert 0.3 < 0.05"}  # fmt: skip
    assert results["device"] == "device: NVIDIA H100 80GB HBM3, 79 GiB" and results["ok"] is False
    assert results["benchmarks"] == {"refit": {"cuda_ipc": {"bench": "refit", "measurement": "cuda_ipc",
                                                            "gb_per_s": 2.0}}}  # fmt: skip
    assert json.loads((tmp_path / "gpu-results.json").read_text()) == results
    assert kit.print_summary(results, tmp_path) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == "device            ok             3 s of  30  device: NVIDIA H100 80GB HBM3, 79 GiB"
    assert lines[2] == "archs             ALL SKIPPED   20 s of  55  1 skipped"
    assert lines[4] == "first             FAILED       100 s of 115  1 passed, 1 failed"
    assert lines[-1] == "kit: FAILED"


def test_without_a_gpu_the_kit_fails_saying_no_gpu_visible(tmp_path):
    out_dir = tmp_path / "out"
    env = kit_env(tmp_path, carry=tmp_path / "carry", out=out_dir, site=tmp_path / "site", limit_scale=6)
    out = run_sh(env=env)  # the limits scaled for a shared 2-core machine, where importing torch alone can take 15 s
    assert out.returncode == 1, out.stdout + out.stderr
    import torch

    no_gpu = f"no GPU visible: torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device"
    assert no_gpu in out.stdout and "kit: stopping: device failed" in out.stdout
    assert re.search(r"^device +FAILED +\d+ s of 180  no GPU visible", out.stdout, re.M)
    assert out.stdout.splitlines()[-1] == "kit: FAILED"
    assert sorted(p.name for p in out_dir.iterdir()) == ["gpu-results.json", "kit.log", "status.tsv"]
    results = json.loads((out_dir / "gpu-results.json").read_text())
    assert results["ok"] is False and results["device"] == no_gpu and len(results["steps"]) == 1
    assert not (tmp_path / "site").exists()  # stopped before installing anything


# ----------------------------------------------------------------------------------- end to end, from a carry alone
IMAGE = (*sorted(prepare.ON_THE_GPU_MACHINE), "pip", "pytest", "pluggy", "iniconfig", "packaging")
"""What the GPU machine's image brings of megarl's needs, linked here from this environment."""


def link_image(folder: Path) -> None:
    folder.mkdir()
    for name in IMAGE:
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # torch's platform-conditional requirements
        base = Path(dist.locate_file(""))
        for top in {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}:
            if not (folder / top).exists() and (base / top).exists():
                (folder / top).symlink_to(base / top)


def pypi_reachable() -> bool:
    index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")
    try:
        with urllib.request.urlopen(f"{index}/pytest-timeout/", timeout=15):
            return True
    except OSError:
        return False


def cached_carry(root: Path) -> Path:
    """A carry for this Python, prepared from PyPI once per set of versions and kept in the user's cache (like pip's
    own): the plan's packages name the folder, and a folder whose files differ from its manifest is prepared anew."""
    subprocess.run([sys.executable, "tools/gpu/prepare.py", "--out", str(root / "plan"), "--python", HERE,
                    "--dry-run"], cwd=REPO, capture_output=True, check=True)  # fmt: skip
    plan = json.loads((root / "plan" / "manifest.json").read_text())
    key = hashlib.sha256(json.dumps([plan["packages"], plan["ray"]["version"]]).encode()).hexdigest()[:12]
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "megarl" / f"gpu-kit-py{HERE}-{key}"
    if (cache / "manifest.json").is_file() and kit.verify(cache) == []:
        return cache
    if not pypi_reachable():
        pytest.skip("PyPI cannot be reached: the carry for the kit's end-to-end test is downloaded from it")
    prepared = subprocess.run(
        # the fastest archive, larger than a device call carries: this carry never travels
        [sys.executable, "tools/gpu/prepare.py", "--out", str(cache), "--python", HERE, "--xz-preset", "0",
         "--max-mib", "512"],
        cwd=REPO, capture_output=True, text=True,
    )  # fmt: skip
    assert prepared.returncode == 0, prepared.stdout + prepared.stderr
    return cache


@pytest.fixture(scope="session")
def fresh_env(tmp_path_factory):
    """(root, {python, carry, site}): a venv holding only the linked image, and a carry prepared for it."""
    root = tmp_path_factory.mktemp("kit")
    carry = cached_carry(root)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / "venv")], check=True)
    link_image(root / "image")
    (site_packages,) = (root / "venv" / "lib").glob("python3*/site-packages")
    (site_packages / "gpu-image.pth").write_text(f"{root / 'image'}\n")
    return root, {"python": root / "venv" / "bin" / "python", "carry": carry, "site": root / "site"}


@pytest.mark.slow
def test_the_kit_installs_from_the_carry_alone_and_its_gpu_tests_collect(fresh_env):
    root, folders = fresh_env
    out_dir = root / "out"
    env = kit_env(root, out=out_dir, limit_scale=10, **folders)  # a shared 2-core machine can be far slower
    outside = subprocess.run([str(folders["python"]), "-c", "import transformers"], env=env, capture_output=True)
    assert outside.returncode == 1  # the venv alone has no transformers: whatever imports later came from the carry
    run = run_sh("install", "collect", "first", env=env)
    status = {line.split("\t")[0]: line.split("\t") for line in (out_dir / "status.tsv").read_text().splitlines()}
    assert [status[s][1] for s in ("install", "collect", "first")] == ["0", "0", "0"], run.stdout[-5000:]
    manifest = json.loads((folders["carry"] / "manifest.json").read_text())
    kept = ", ".join(f"{n} {metadata.version(n)}" for n in ("iniconfig", "packaging", "pluggy", "pytest"))
    log = (out_dir / "kit.log").read_text()
    assert f"keeping from the image: {kept}\n" in log
    assert f"installed into {folders['site']}: {len(manifest['wheels']) - 4} wheels and ray " in status["install"][4]
    import torch

    assert f"torch {torch.__version__} (the image's); transformers {metadata.version('transformers')}, " in log
    # every node id the kit names collects in that environment (a GPU machine fails the same way if one does not)
    collect = log[log.index("===== collect (") : log.index("===== collect: exit 0")]
    collected = [line for line in collect.splitlines() if line.startswith("tests/test_")]
    assert re.search(rf"^{len(collected)} tests collected in ", collect, re.M)
    for node in (node for step in kit.STEPS for node in step.nodes):
        assert node in collected or any(c.startswith(node + "::") for c in collected), node
    # the first step ran as on the GPU machine, where CUDA is missing every test skips: the kit does not call it ok
    junit = kit.read_junit(out_dir / "junit-first.xml")
    assert [(t["node"], t["outcome"], t["message"]) for t in junit] == [
        (kit.PARITY.format("tiny-qwen3"), "skipped", "needs a CUDA GPU"),
        (kit.COLOCATED.format("grpo"), "skipped", "needs a CUDA GPU"),
    ]
    assert run.returncode == 1 and re.search(r"^first +ALL SKIPPED ", run.stdout, re.M)
    assert sorted(p.name for p in out_dir.iterdir()) == ["gpu-results.json", "junit-first.xml", "kit.log",
                                                         "status.tsv"]  # fmt: skip
    # a later call brings a fresh copy of the carry: the install in SITE (outside the carry) still stands
    shutil.copytree(folders["carry"], root / "carry-again")  # the same carry at another path
    env["CARRY"] = str(root / "carry-again")
    assert [n for n, _, _ in dry_run_steps(run_sh("--dry-run", "first", env=env).stdout)] == ["first", "summary"]
    again = run_sh("install", env=env)
    assert f"installed already for this carry in {folders['site']}: " in again.stdout


@pytest.mark.slow
def test_a_step_stopped_by_its_limit_keeps_its_partial_results(fresh_env, tmp_path):
    root, folders = fresh_env
    tests = tmp_path / "test_steps.py"
    tests.write_text("import time\n\ndef test_quick():\n    pass\n\ndef test_hangs():\n    time.sleep(60)\n\n"
                     "def test_after():\n    pass\n")  # fmt: skip
    env = kit_env(root, out=tmp_path / "out", limit_scale=10, **folders)
    installed = run_sh("install", env=env)  # done already when the test above ran first: then it says so
    assert installed.returncode == 0 and f" {folders['site']}: " in installed.stdout, installed.stdout
    kit_py = [str(folders["python"]), "tools/gpu/kit.py", "pytest"]
    # pytest-timeout (carried) fails the test that hangs; the step goes on to the next test
    each = subprocess.run([*kit_py, "each", "60", "2", str(tests)], cwd=REPO, env=env, capture_output=True, text=True)
    assert each.returncode == 1, each.stdout
    outcomes = [(t["node"].split("::")[1], t["outcome"]) for t in kit.read_junit(tmp_path / "out/junit-each.xml")]
    assert outcomes == [("test_quick", "passed"), ("test_hangs", "failed"), ("test_after", "passed")]
    assert "Timeout (>2.0s)" in kit.read_junit(tmp_path / "out/junit-each.xml")[1]["message"]
    # the step's own limit stops it in the middle: what finished is kept, the rest says why it has no result
    cut = subprocess.run([*kit_py, "cut", "20", "120", str(tests)], cwd=REPO, env=env, capture_output=True, text=True)
    assert cut.returncode == 124, cut.stdout
    junit = kit.read_junit(tmp_path / "out/junit-cut.xml")
    assert [(t["node"].split("::")[1], t["outcome"]) for t in junit] == [
        ("test_quick", "passed"), ("test_hangs", "interrupted"), ("test_after", "not run")
    ]  # fmt: skip
    assert "test_steps.py::test_quick PASSED" in (tmp_path / "out/kit.log").read_text()  # streamed as it ran
    name, code, seconds, limit, _ = (tmp_path / "out/status.tsv").read_text().splitlines()[-1].split("\t")
    assert (name, code, limit) == ("cut", "124", "20") and 17 <= int(seconds) <= 25  # SIGINT at 17.5 s, SIGKILL at 20
    results = kit.summarize(tmp_path / "out")
    verdicts = [(s["name"], s["verdict"]) for s in results["steps"] if s["name"] != "install"]  # ok, or not run
    assert verdicts == [("each", "FAILED"), ("cut", "TIMED OUT")]
