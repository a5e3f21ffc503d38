"""Helpers of tools/gpu/run.sh: check the carried folder against its manifest, and summarize a run.

python tools/gpu/kit.py verify CARRY      every file of the manifest present with its size and sha256
python tools/gpu/kit.py summarize OUT     OUT/gpu-results.json from the checks' status, pytest's JUnit XML and
                                          the benchmarks' JSON; one line per check on stdout
"""

from __future__ import annotations

import datetime
import hashlib
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def verify(carry: Path) -> list[str]:
    """Problems with `carry` (empty: every file as the manifest says)."""
    manifest = json.loads((carry / "manifest.json").read_text())
    problems = []
    if manifest.get("dry_run"):
        problems.append("the manifest is a dry run's: nothing was downloaded")
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


def _device() -> dict:
    try:
        import torch

        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            return {"name": props.name, "memory_gb": round(props.total_memory / 1e9, 1), "torch": torch.__version__}
        return {"name": "none (no CUDA device)", "torch": torch.__version__}
    except Exception as err:  # the summary must be written whatever broke
        return {"name": f"unknown ({err})"}


def _tests(junit: Path) -> list[dict]:
    if not junit.is_file():
        return []
    cases = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
            elif child.tag == "skipped":
                outcome = "skipped"
        cases.append({"name": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome})
    return cases


def summarize(out: Path) -> dict:
    checks = []
    status = out / "status.tsv"
    for line in status.read_text().splitlines() if status.is_file() else []:
        name, code, seconds = line.split("\t")
        checks.append({"name": name, "exit_code": int(code), "seconds": int(seconds), "timed_out": code == "124"})
    results = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": _device(),
        "checks": checks,
        "tests": _tests(out / "pytest-gpu.xml"),
        "benchmarks": {
            p.stem.removeprefix("bench-"): json.loads(p.read_text()) for p in sorted(out.glob("bench-*.json"))
        },
    }
    (out / "gpu-results.json").write_text(json.dumps(results, indent=1) + "\n")
    return results


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("verify", "summarize"):
        print(__doc__, file=sys.stderr)
        return 2
    if argv[0] == "verify":
        problems = verify(Path(argv[1]))
        for problem in problems:
            print(f"carry: {problem}", file=sys.stderr)
        return 1 if problems else 0
    results = summarize(Path(argv[1]))
    print(f"device: {results['device'].get('name')}")
    for check in results["checks"]:
        state = "ok" if check["exit_code"] == 0 else ("TIMED OUT" if check["timed_out"] else "FAILED")
        print(f"{check['name']:<18} {state:<9} {check['seconds']:>4} s   (log: {argv[1]}/{check['name']}.log)")
    for test in results["tests"]:
        print(f"  {test['outcome']:<8} {test['name']}")
    return 0 if all(c["exit_code"] == 0 for c in results["checks"]) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
