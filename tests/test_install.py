"""What the README's install commands promise: `pip install megarl[sglang]` resolves (megarl's ranges admit SGLang
0.5.23's own torch and transformers pins), and the versions the README's numbers were measured with are the ones
constraints.txt pins."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]


def pypi_reachable() -> bool:
    try:
        socket.create_connection(("pypi.org", 443), timeout=5).close()
        return True
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not pypi_reachable(), reason="resolving needs PyPI, not reachable from here")
def test_the_sglang_extra_resolves_with_sglangs_own_pins(tmp_path):
    report = tmp_path / "report.json"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet", "--report",
         str(report), "-e", f"{ROOT}[sglang]"],
        capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    chosen = {item["metadata"]["name"].lower(): item["metadata"]["version"] for item in json.loads(report.read_text())
              ["install"]}  # fmt: skip
    assert chosen["sglang"] == "0.5.23"
    assert (chosen["torch"], chosen["transformers"]) == ("2.14.1", "5.19.0")  # SGLang's pins, within megarl's ranges


def test_constraints_pin_versions_the_requirements_admit():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = {r.name: r for r in map(Requirement, project["dependencies"])}
    pins = [Requirement(line) for line in (ROOT / "constraints.txt").read_text().splitlines()
            if line.strip() and not line.startswith("#")]  # fmt: skip
    assert {p.name for p in pins} >= {"torch", "transformers", "megatron-core"}
    for pin in pins:
        (version,) = [spec.version for spec in pin.specifier]
        if pin.name in requirements:
            assert requirements[pin.name].specifier.contains(version), (pin, requirements[pin.name])
    (sglang,) = [Requirement(r) for r in project["optional-dependencies"]["sglang"]]
    assert str(sglang.specifier) == "==0.5.23"
    assert requirements["transformers"].specifier.contains("5.19.0")  # SGLang 0.5.23's pin


def test_installed_versions_are_the_pinned_ones():
    """The tests run in the environment constraints.txt describes (the README's install commands apply it), so the
    numbers they and the README state are this environment's; a difference names the package and both versions
    (after a deliberate upgrade: `python tools/lock_constraints.py`, then re-measure the README's numbers)."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import lock_constraints
    finally:
        sys.path.remove(str(ROOT / "tools"))
    assert lock_constraints.differences(ROOT / "constraints.txt") == []


def test_an_unsupported_library_version_stops_every_command_naming_it(monkeypatch, capsys):
    """megarl reaches into transformers, Megatron-Core and math-verify: a version outside pyproject.toml's range
    (e.g. after `pip install -U transformers`) is refused before any work, naming the library, both versions and
    the fix."""
    from megarl.cli import main
    from megarl.runtime import versions

    installed = {"transformers": "5.41.0", "megatron-core": "0.16.1", "math-verify": "0.9.0"}
    monkeypatch.setattr(versions, "_installed_version", installed.get)
    assert main(["plan", "--config", str(ROOT / "configs" / "quickstart.yaml")]) == 2
    assert capsys.readouterr().err.strip() == (
        "megarl: error: transformers 5.41.0 is installed, but megarl supports transformers<5.40,>=5.19 (it relies on "
        "that library's internals). Install the tested versions: pip install -e . -c constraints.txt"
    )
    monkeypatch.setattr(versions, "_installed_version", (installed | {"transformers": "5.24.0"}).get)
    versions.check_versions()  # the tested set passes
