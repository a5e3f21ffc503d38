"""The libraries megarl reaches into, checked against the versions it supports before any command runs.

megarl relies on internals of a few libraries: transformers' checkpoint conversion tables and generation API (the hf
engine and the bridge), Megatron-Core's model and checkpoint APIs, and math-verify's judgments (the README's
verifier numbers). pyproject.toml bounds them; an environment that installed another version anyway (e.g. by a
later `pip install -U`) gets one clear error naming the library, the version found and the range, instead of a
traceback deep in a run.
"""

from __future__ import annotations

from importlib import metadata

from megarl.errors import UserError

CHECKED = ("transformers", "megatron-core", "math-verify")


def check_versions(installed: dict[str, str] | None = None) -> None:
    """Raise UserError when an installed library of CHECKED is outside megarl's declared range. `installed`
    overrides what is looked up (tests). A megarl that is not installed (run from a source tree) has no declared
    ranges to check."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    try:
        declared = [Requirement(text) for text in metadata.requires("megarl") or []]
    except metadata.PackageNotFoundError:
        return
    ranges = {canonicalize_name(r.name): r.specifier for r in declared if r.marker is None}
    for name in CHECKED:
        version = (installed or {}).get(name) or _installed_version(name)
        if name in ranges and version is not None and not ranges[name].contains(version, prereleases=True):
            raise UserError(
                f"{name} {version} is installed, but megarl supports {name}{ranges[name]} (it relies on that "
                f"library's internals). Install the tested versions: pip install -e . -c constraints.txt"
            )


def _installed_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None
