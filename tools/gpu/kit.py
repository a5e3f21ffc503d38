"""The GPU kit's driver: megarl's GPU checks on one GPU, in one command of at most 7 minutes (tools/gpu/README.md).

    python3 tools/gpu/kit.py run [--dry-run] [PART ...]    the checks in order (tools/gpu/run.sh calls this)
    python3 tools/gpu/kit.py pytest NAME LIMIT_S PER_TEST_S NODE ...   any tests, run as the kit runs its own
    python3 tools/gpu/kit.py device | install | verify | summarize     one piece

Folders come from the environment, relative ones resolved from the current folder: CARRY (what
`tools/gpu/prepare.py` filled; default .gpu-carry), OUT (the results; default gpu-out), SITE (where the carry is
installed, outside CARRY so that a later call with a fresh carry finds it; default /tmp/megarl-gpu-site),
LIMIT_SCALE (every step's time limit times this, for a slower machine; default 1).
Standard library only: this runs on the GPU machine's own Python before anything is installed.

Each step runs in its own process group under its time limit (SIGINT shortly before it, SIGKILL at it), streams its
output to stdout and OUT/kit.log, and appends `name, exit code, seconds, limit, last line` to OUT/status.tsv; pytest
steps rewrite OUT/junit-STEP.xml after every test (kit_pytest.py), the benchmarks append OUT/bench.jsonl after every
measurement, so a step stopped by its limit keeps what it finished. The summary writes OUT/gpu-results.json.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MANIFEST = "manifest.json"
MARKER = ".megarl-gpu-kit.json"
"""In SITE: which carry was installed there (the sha256 of its manifest) and what was kept from the image."""
TOTAL_LIMIT_S = 420
"""The default run's step limits add up to at most this: 7 minutes, leaving a 15-minute lease room for a rerun."""
GPU_TESTS = "tests/test_gpu.py"
SGLANG_TESTS = "tests/test_sglang_gpu.py"
PARITY = f"{GPU_TESTS}::test_bf16_logits_and_logprobs_match_transformers[{{}}]"
COLOCATED = f"{GPU_TESTS}::test_one_colocated_step_on_one_gpu_hands_the_memory_over[{{}}]"


@dataclass(frozen=True)
class Step:
    name: str
    limit_s: int
    what: str
    nodes: tuple[str, ...] = ()
    """pytest node ids (a pytest step), in the order they run."""
    per_test_s: int = 0
    """pytest-timeout's limit for each test of the step."""
    script: str = ""
    """A benchmark (tools/bench/...) that appends OUT/bench.jsonl after each measurement."""
    default: bool = True


STEPS = (
    Step("device", 30, "a CUDA GPU is visible to torch; without one the kit stops, FAILED: no GPU visible"),
    Step("install", 45, "the carry's sums; the wheels the image lacks into SITE, Ray unpacked there; imports"),
    Step("collect", 60, "pytest --collect-only of every test the kit names: not in the default run", default=False),
    Step(
        "first",
        110,
        "bf16 logits/log-probs vs transformers (tiny-qwen3); one colocated GRPO step with the memory handover",
        nodes=(PARITY.format("tiny-qwen3"), COLOCATED.format("grpo")),
        per_test_s=90,
    ),
    Step(
        "guards",
        120,
        "the non-finite gradient guard in bf16; a CUDA IPC weight sync into the colocated engine",
        nodes=(
            f"{GPU_TESTS}::test_non_finite_gradients_in_bf16_skip_the_step_then_stop_the_run",
            f"{GPU_TESTS}::test_cuda_ipc_sync_leaves_the_colocated_engine_with_the_trained_weights",
        ),
        per_test_s=100,
    ),
    Step(
        "archs",
        45,
        "bf16 parity of the other five architectures; the SGLang server tests (skip without SGLang)",
        nodes=(
            *(PARITY.format(n) for n in ("tiny-llama", "tiny-qwen2", "tiny-mixtral", "tiny-qwen3-moe")),
            PARITY.format("tiny-deepseek-v3"),
            SGLANG_TESTS,
        ),
        per_test_s=30,
    ),
    Step("bench-train-step", 35, "0.5 B update step: megarl, then transformers + AdamW", script="gpu_train_step.py"),
    Step("bench-refit", 30, "0.5 B colocated sync: CUDA IPC, object store, device copy, delta", script="gpu_refit.py"),
    Step(
        "extras",
        165,
        "one colocated PPO step (actor and critic); bf16 parity of GLM-4.5, gpt-oss, Qwen3-Next and Qwen3.5 (their "
        "Gated DeltaNet on CUDA): not in the default run",
        nodes=(
            COLOCATED.format("ppo"),
            *(PARITY.format(n) for n in ("tiny-glm4-moe", "tiny-gpt-oss", "tiny-qwen3-next", "tiny-qwen3.5-moe")),
        ),
        per_test_s=80,
        default=False,
    ),
    Step("summary", 5, "OUT/gpu-results.json; one line per step and per test"),
)
BY_NAME = {step.name: step for step in STEPS}
DEFAULT = tuple(step.name for step in STEPS if step.default)
assert sum(step.limit_s for step in STEPS if step.default) <= TOTAL_LIMIT_S, "the default run must fit 7 minutes"
NEEDS_SITE = {step.name for step in STEPS if step.nodes or step.script or step.name == "collect"}


def out_files(steps=STEPS) -> list[str]:
    """Every file `steps` can leave in OUT: at most 8 come back from a device call, all in OUT itself."""
    names = ["status.tsv", "kit.log", *(f"junit-{s.name}.xml" for s in steps if s.nodes)]
    return [*names, *(["bench.jsonl"] if any(s.script for s in steps) else []), "gpu-results.json"]


@dataclass(frozen=True)
class Folders:
    carry: Path
    out: Path
    site: Path

    @classmethod
    def from_env(cls) -> Folders:
        get = os.environ.get
        return cls(
            carry=Path(get("CARRY") or REPO / ".gpu-carry").resolve(),
            out=Path(get("OUT") or REPO / "gpu-out").resolve(),
            site=Path(get("SITE") or "/tmp/megarl-gpu-site").resolve(),
        )


def child_env(folders: Folders) -> dict[str, str]:
    """The steps' environment: SITE first on the path, so the carried packages win over the image's; pytest loads
    only the plugins the kit names (an image's own, built for its own pytest, could break a carried one)."""
    paths = [str(folders.site), str(REPO), str(REPO / "tools" / "gpu"), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": ":".join(filter(None, paths)),
            "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}  # fmt: skip


def pytest_command(name: str, nodes: tuple[str, ...], per_test_s: int, out: Path) -> list[str]:
    return [
        *(sys.executable, "-m", "pytest", *nodes, "-v", "-rA", "-p", "no:cacheprovider", "-p", "pytest_timeout"),
        *("-p", "kit_pytest", "--kit-junit", str(out / f"junit-{name}.xml"), f"--timeout={per_test_s}"),
    ]


def command(step: Step, folders: Folders) -> list[str]:
    kit = str(Path(__file__).resolve())
    if step.nodes:
        return pytest_command(step.name, step.nodes, step.per_test_s, folders.out)
    if step.script:
        script = REPO / "tools" / "bench" / step.script
        return [sys.executable, str(script), "--reps", "3", "--jsonl", str(folders.out / "bench.jsonl")]
    if step.name == "collect":
        nodes = [node for s in STEPS for node in s.nodes]
        return [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *nodes]
    return [sys.executable, kit, "summarize" if step.name == "summary" else step.name]


# ----------------------------------------------------------------------------------------------- running one step
def _grace_s(limit_s: float) -> float:
    """SIGINT this long before the limit: pytest then writes its summary, a training run stops Ray cleanly."""
    return max(2.0, min(10.0, limit_s / 8))


def run_step(name: str, limit_s: float, cmd: list[str], folders: Folders) -> int:
    """Run `cmd` under `limit_s`, streaming its output; its status line in OUT/status.tsv. 124: timed out."""
    folders.out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    last = [""]
    with open(folders.out / "kit.log", "a", buffering=1, errors="replace") as log:
        header = f"===== {name} (limit {limit_s:.0f} s): {' '.join(cmd)}"
        print(header, flush=True)
        log.write(header + "\n")
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=child_env(folders), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        reader = threading.Thread(target=_stream, args=(proc.stdout, log, last), daemon=True)
        reader.start()
        timed_out = _wait(proc, limit_s)
        reader.join(timeout=5)  # a grandchild still holding the pipe must not hold the kit
        _kill_group(proc.pid, signal.SIGKILL)  # what the step left behind in its group
        for partial in folders.out.glob("*.tmp"):  # a JUnit rewrite cut short: the file before it stands
            partial.unlink()
        seconds = time.monotonic() - start
        code = 124 if timed_out else proc.returncode
        footer = f"===== {name}: {'TIMED OUT' if timed_out else f'exit {code}'} after {seconds:.0f} s"
        print(footer, flush=True)
        log.write(footer + "\n")
    detail = re.sub(r"\s+", " ", last[0]).strip()[:300]
    with open(folders.out / "status.tsv", "a") as status:
        status.write(f"{name}\t{code}\t{seconds:.0f}\t{limit_s:.0f}\t{detail}\n")
    return code


def _stream(pipe, log, last: list[str]) -> None:
    """Copy the step's output to stdout and the log as it comes; remember its last line (pytest's counts, say)."""
    for raw in iter(pipe.readline, b""):
        line = raw.decode(errors="replace")
        try:
            log.write(line)
        except ValueError:  # the log is closed: the step ended, a process it left behind still writes
            break
        sys.stdout.write(line)
        sys.stdout.flush()
        if line.strip(" =\n"):
            last[0] = line.strip(" =\n")
    pipe.close()


def _wait(proc: subprocess.Popen, limit_s: float) -> bool:
    """Wait for `proc`; at the limit less the grace, SIGINT its group, at the limit SIGKILL. True: it timed out."""
    grace = _grace_s(limit_s)
    try:
        proc.wait(timeout=max(limit_s - grace, 0.1))
        return False
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid, signal.SIGKILL)
        proc.wait()
    return True


def _kill_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


# ----------------------------------------------------------------------------------------------- device and install
def device() -> int:
    """Print the GPU; exit 1 with "no GPU visible" when torch sees none (every GPU test would only skip)."""
    smi = shutil.which("nvidia-smi")
    if smi:
        listed = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10)
        print((listed.stdout + listed.stderr).strip() or "nvidia-smi -L: nothing listed")
    try:
        import torch
    except ImportError as err:
        print(f"no GPU visible: torch does not import here ({err})")
        return 1
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        print(f"no GPU visible: torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device")
        return 1
    props = torch.cuda.get_device_properties(0)
    print(
        f"device: {props.name}, {props.total_memory / 2**30:.0f} GiB, {torch.cuda.device_count()} visible; torch "
        f"{torch.__version__}, CUDA {torch.version.cuda}, Python {platform.python_version()}"
    )
    return 0


def verify(carry: Path) -> list[str]:
    """Problems with `carry` (empty: every file as the manifest says)."""
    if not (carry / MANIFEST).is_file():
        return [f"no {carry / MANIFEST}: run `python tools/gpu/prepare.py --out {carry}` on a machine with PyPI"]
    manifest = json.loads((carry / MANIFEST).read_text())
    problems = []
    if manifest.get("dry_run"):
        problems.append("the manifest is a dry run's: nothing was downloaded")
    if manifest.get("refused"):
        problems.append(f"prepare.py refused this carry: {manifest['refused']}")
    for entry in manifest["files"]:
        path = carry / entry["path"]
        if not path.is_file():
            problems.append(f"{entry['path']}: missing")
        elif path.stat().st_size != entry["bytes"] or _sha256(path) != entry["sha256"]:
            problems.append(f"{entry['path']}: size or sha256 differs from the manifest")
    return problems


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def image_versions(leave_out: list[Path]) -> dict[str, str]:
    """{package: version} of what this Python has without SITE (the first on sys.path wins, as at import)."""
    from importlib import metadata

    skip = [p.resolve() for p in leave_out]
    paths = [p for p in sys.path if p and not any(Path(p).resolve().is_relative_to(s) for s in skip)]
    found: dict[str, str] = {}
    for dist in metadata.distributions(path=paths):
        name = re.sub(r"[-_.]+", "-", dist.metadata["Name"] or "").lower()
        found.setdefault(name, dist.version)
    return found


def choose_wheels(wheels: list[dict], image: dict[str, str]) -> tuple[list[dict], dict[str, str]]:
    """(the wheels to install, {package: image version kept}): a package the image has at a version within what
    megarl and the carried packages require is kept; any other is installed from the carry."""
    try:
        from packaging.specifiers import SpecifierSet
    except ImportError:  # pip always brings its own copy
        from pip._vendor.packaging.specifiers import SpecifierSet

    chosen, kept = [], {}
    for wheel in wheels:
        have = image.get(wheel["name"])
        if have is not None and SpecifierSet(wheel["requires"]).contains(have, prereleases=True):
            kept[wheel["name"]] = have
        else:
            chosen.append(wheel)
    return chosen, kept


IMPORT_CHECK = """
import sys, importlib.metadata as md
import torch
assert not torch.__file__.startswith(sys.argv[1]), "torch came from the carry: " + torch.__file__
import megatron.core, omegaconf, ray, transformers
names = ("transformers", "megatron-core", "ray", "huggingface-hub", "pytest-timeout")
print(f"torch {torch.__version__} (the image's); " + ", ".join(f"{n} {md.version(n)}" for n in names))
"""


def install(folders: Folders) -> int:
    """Install the carry into SITE (never into the image's environment), once per carry: a later call with a fresh
    copy of the same carry, or a rerun of one part, finds it done."""
    carry, site = folders.carry, folders.site
    marker = site / MARKER
    manifest_path = carry / MANIFEST
    if manifest_path.is_file() and marker.is_file():
        done = json.loads(marker.read_text())
        if done.get("manifest_sha256") == _sha256(manifest_path):
            print(f"installed already for this carry in {site}: {done['summary']}")
            return 0
    problems = verify(carry)
    if problems:
        print("\n".join(f"carry: {p}" for p in problems))
        return 2
    manifest = json.loads(manifest_path.read_text())
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    if manifest["python"] != here:
        print(f"carry: prepared for Python {manifest['python']}, this is {here}: prepare.py --python {here}")
        return 2
    chosen, kept = choose_wheels(manifest["wheels"], image_versions([site, REPO]))
    print(f"keeping from the image: {', '.join(f'{n} {v}' for n, v in kept.items()) or 'nothing'}")
    print(f"installing into {site}: {', '.join(w['name'] + ' ' + w['version'] for w in chosen)}", flush=True)
    shutil.rmtree(site, ignore_errors=True)
    site.mkdir(parents=True)
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-compile"]
    pip += ["--disable-pip-version-check", "--target", str(site), *(str(carry / w["file"]) for w in chosen)]
    start = time.monotonic()
    if chosen and subprocess.run(pip, env={**os.environ, "PIP_ROOT_USER_ACTION": "ignore"}).returncode != 0:
        return 2
    print(f"pip: {time.monotonic() - start:.0f} s; unpacking ray {manifest['ray']['version']} ...", flush=True)
    with tarfile.open(carry / manifest["ray"]["archive"]) as archive:
        archive.extractall(site, filter="tar")
    print(
        f"unpacked: {time.monotonic() - start:.0f} s; importing torch, megatron.core, ray, transformers ...", flush=True
    )
    env = {**os.environ, "PYTHONPATH": f"{site}:{os.environ.get('PYTHONPATH', '')}".rstrip(":")}
    check = subprocess.run([sys.executable, "-c", IMPORT_CHECK, str(site)], env=env, capture_output=True, text=True)
    if check.returncode != 0:
        print(f"install: the imports fail after installing:\n{check.stdout}{check.stderr[-3000:]}")
        return 2
    summary = f"{len(chosen)} wheels and ray {manifest['ray']['version']} installed, {len(kept)} kept from the image"
    marker.write_text(json.dumps({"manifest_sha256": _sha256(manifest_path), "summary": summary, "kept": kept}))
    print(f"{check.stdout.strip()} ({time.monotonic() - start:.0f} s)")
    print(f"installed into {site}: {summary}")
    return 0


# ----------------------------------------------------------------------------------------------- the whole run
def plan(parts: list[str], folders: Folders) -> list[Step]:
    """The steps `parts` asks for, in the kit's order, with install added when SITE lacks the carry there is."""
    unknown = [p for p in parts if p not in BY_NAME]
    if unknown:
        raise SystemExit(f"kit: unknown part {', '.join(unknown)}; valid: {', '.join(BY_NAME)}")
    wanted = set(parts or DEFAULT) | {"summary"}
    if wanted & NEEDS_SITE and (folders.carry / MANIFEST).is_file() and not _installed(folders):
        wanted.add("install")  # without a carry, the steps use the environment as it is (a box with network)
    return [step for step in STEPS if step.name in wanted]


def _installed(folders: Folders) -> bool:
    marker, manifest = folders.site / MARKER, folders.carry / MANIFEST
    if not (marker.is_file() and manifest.is_file()):
        return False
    return json.loads(marker.read_text()).get("manifest_sha256") == _sha256(manifest)


def limit_scale() -> float:
    text = os.environ.get("LIMIT_SCALE", "1")
    try:
        scale = float(text)
    except ValueError:
        scale = 0.0
    if not 0 < scale <= 10:
        raise SystemExit(f"kit: LIMIT_SCALE={text}: give a number above 0 and at most 10 (1: the limits as written)")
    return scale


def run(parts: list[str], dry_run: bool = False) -> int:
    folders = Folders.from_env()
    steps = plan(parts, folders)
    scale = limit_scale()
    limits = {step.name: round(step.limit_s * scale) for step in steps}
    if dry_run:
        print(f"CARRY={folders.carry} OUT={folders.out} SITE={folders.site} python={sys.executable}")
        for step in steps:
            print(f"{step.name:<17}{limits[step.name]:>4} s  {step.what}")
            print(f"{'':<23}{' '.join(command(step, folders))}")
        print(f"total limit: {sum(limits.values())} s")
        return 0
    if not parts:  # a whole run starts clean; a part run adds to what is there (the summary keeps the last of each)
        for name in out_files():
            (folders.out / name).unlink(missing_ok=True)
    for step in steps:
        if step.name == "summary":
            continue  # after the loop, whatever stopped it
        code = run_step(step.name, limits[step.name], command(step, folders), folders)
        if code != 0 and step.name in ("device", "install"):
            print(f"kit: stopping: {step.name} failed (see {folders.out / 'kit.log'})", flush=True)
            break
    return print_summary(summarize(folders.out), folders.out)


# ----------------------------------------------------------------------------------------------- summary
def read_status(out: Path) -> list[dict]:
    """The last status line of each step, in the order the steps first ran."""
    steps: dict[str, dict] = {}
    status = out / "status.tsv"
    for line in status.read_text().splitlines() if status.is_file() else []:
        name, code, seconds, limit, detail = (line.split("\t") + [""] * 5)[:5]
        steps.pop(name, None)
        steps[name] = {"name": name, "exit_code": int(code), "seconds": int(seconds), "limit_s": int(limit),
                       "detail": detail}  # fmt: skip
    return list(steps.values())


def read_junit(path: Path) -> list[dict]:
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                kind = child.get("type", "")
                outcome = {"kit.not_run": "not run", "kit.interrupted": "interrupted"}.get(kind, child.tag)
                outcome = {"failure": "failed", "skipped": "skipped"}.get(outcome, outcome)
                message = child.get("message", "")
        cases.append({"node": case.get("file", "") + "::" + case.get("name", ""), "outcome": outcome,
                      "seconds": float(case.get("time", 0)), "message": message[:500]})  # fmt: skip
    return cases


def read_benchmarks(out: Path) -> dict:
    found: dict[str, dict] = {}
    path = out / "bench.jsonl"
    for line in path.read_text().splitlines() if path.is_file() else []:
        if line.strip():
            record = json.loads(line)
            found.setdefault(record["bench"], {})[record["measurement"]] = record
    return found


def verdict(step: dict, tests: list[dict]) -> str:
    if step["exit_code"] == 124:
        return "TIMED OUT"
    if step["exit_code"] != 0:
        return "FAILED"
    if tests and all(t["outcome"] == "skipped" for t in tests):
        return "ALL SKIPPED"
    return "ok"


def summarize(out: Path) -> dict:
    steps = read_status(out)
    for step in steps:
        junit = out / f"junit-{step['name']}.xml"
        step["tests"] = read_junit(junit) if junit.is_file() else []
        step["verdict"] = verdict(step, step["tests"])
    device_step = next((s for s in steps if s["name"] == "device"), None)
    results = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "ok": bool(steps) and all(s["verdict"] == "ok" for s in steps),
        "device": device_step["detail"] if device_step else "not checked",
        "steps": steps,
        "benchmarks": read_benchmarks(out),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu-results.json").write_text(json.dumps(results, indent=1) + "\n")
    return results


def print_summary(results: dict, out: Path) -> int:
    print(f"===== summary ({out / 'gpu-results.json'})")
    for step in results["steps"]:
        counts: dict[str, int] = {}
        for test in step["tests"]:
            counts[test["outcome"]] = counts.get(test["outcome"], 0) + 1
        detail = ", ".join(f"{n} {o}" for o, n in counts.items()) if step["tests"] else step["detail"]
        print(f"{step['name']:<17} {step['verdict']:<11} {step['seconds']:>4} s of {step['limit_s']:>3}  {detail}")
        for test in step["tests"]:
            note = f"  {test['message'][:150]}" if test["outcome"] != "passed" else ""
            print(f"    {test['outcome']:<11} {test['node']}  {test['seconds']:.0f} s{note}")
    for bench, measurements in results["benchmarks"].items():
        for name, record in measurements.items():
            values = {k: v for k, v in record.items() if k not in ("bench", "measurement", "device")}
            print(f"bench {bench}/{name}: {json.dumps(values)[:200]}")
    print(f"kit: {'ok' if results['ok'] else 'FAILED'}")
    return 0 if results["ok"] else 1


def main(argv: list[str]) -> int:
    folders = Folders.from_env()
    match argv:
        case ["run", *parts]:
            dry = "--dry-run" in parts
            return run([p for p in parts if p != "--dry-run"], dry_run=dry)
        case ["pytest", name, limit, per_test, *nodes] if nodes:
            return run_step(name, float(limit), pytest_command(name, tuple(nodes), int(per_test), folders.out), folders)
        case ["device"]:
            return device()
        case ["install"]:
            return install(folders)
        case ["verify"]:
            problems = verify(folders.carry)
            print("\n".join(f"carry: {p}" for p in problems) or f"{folders.carry}: every file as its manifest says")
            return 1 if problems else 0
        case ["summarize"]:
            return print_summary(summarize(folders.out), folders.out)
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
