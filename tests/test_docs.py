"""The documentation: the README stays short and inside the repository, docs/ builds as a site with no broken link,
the config reference is what the schema says today, and every path the docs name exists."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).parents[1]
DOC_FILES = [REPO / "README.md", REPO / "CHANGELOG.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)|<(https?://[^>]+)>|(?<![(<`])\b(https?://\S+)")
REPO_PATH = re.compile(r"`[^`\n]*?\b((?:megarl|tools|configs|examples|tests|docs)/[\w./-]*[\w/])")


def mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config)]
    return subprocess.run([*command, "--site-dir", str(site)], capture_output=True, text=True, timeout=120)


def test_the_docs_build_as_a_site_with_no_broken_link(tmp_path):
    """`mkdocs build --strict`: a link to a missing page or anchor, or a page left out of the nav, fails."""
    out = mkdocs_build(REPO / "mkdocs.yml", tmp_path / "site")
    assert out.returncode == 0, f"mkdocs build --strict failed:\n{out.stdout}\n{out.stderr}"
    assert (tmp_path / "site" / "config_reference" / "index.html").is_file()


def test_the_strict_build_fails_on_a_broken_link(tmp_path):
    """The site's own settings (mkdocs.yml's validation section) catch a link to a page that does not exist."""
    settings = yaml.safe_load((REPO / "mkdocs.yml").read_text())
    settings.update(docs_dir="docs", nav=[{"Home": "index.md"}])
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "index.md").write_text("# Home\n\nSee [the guide](guide.md).\n")
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(settings))
    out = mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert out.returncode == 1
    assert "'guide.md'" in out.stdout + out.stderr


def test_the_config_reference_is_current():
    """docs/config_reference.md is what tools/docs/config_reference.py writes from today's schema."""
    spec = importlib.util.spec_from_file_location("config_reference", REPO / "tools/docs/config_reference.py")
    assert spec is not None and spec.loader is not None
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    committed = (REPO / "docs" / "config_reference.md").read_text(encoding="utf-8")
    assert committed == generator.render(), (
        "docs/config_reference.md is not current: run `python tools/docs/config_reference.py` and commit the result"
    )
    assert "| `rl.prompts_per_step` | an integer |" in committed  # every key, e.g. these two the README never named
    assert "| `actor.optim.lr` | a number |" in committed


def test_the_readme_is_short_and_every_link_stays_in_the_repository():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    for match in LINK.finditer(readme):
        target = next(group for group in match.groups() if group)
        assert not target.startswith(("http:", "https:", "/", "..")), f"README.md links out of the repository: {target}"
        path = target.split("#")[0]
        assert (REPO / path).exists(), f"README.md links to {path}, which does not exist"


OUTSIDE = "/".join(("..", "shared"))  # spelled apart, so this file does not name it either


def test_nothing_points_outside_the_repository():
    """Users have the repository only: no file cites the team's notes folder beside the checkout or the design notes
    kept there (the code's docstrings cite docs/architecture.md)."""
    suffixes = {".py", ".md", ".yml", ".yaml", ".toml", ".sh", ".txt", ".cfg", ""}
    tracked = subprocess.run(["git", "ls-files"], capture_output=True, text=True, cwd=REPO, check=True).stdout
    hits = []
    for name in tracked.splitlines():
        path = REPO / name
        if path.suffix not in suffixes or not path.is_file() or name == "tests/test_docs.py":
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        hits += [f"{name}: {word}" for word in (OUTSIDE, "DESIGN.md", "STYLE.md", "GPU.md") if word in text]
    assert hits == []


def test_every_path_the_docs_name_exists():
    """A file or folder named in backticks (`megarl/...`, `tools/...`, `configs/...`) is there: a moved module
    must take its mentions along."""
    missing = []
    for doc in DOC_FILES:
        for match in REPO_PATH.finditer(doc.read_text()):
            path = match.group(1)
            if not any(mark in path for mark in "<*{") and not (REPO / path).exists():
                missing.append(f"{doc.relative_to(REPO)}: {path}")
    assert missing == []
