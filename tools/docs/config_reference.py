"""Write docs/config_reference.md: every key of the job config, read from the schema itself.

    python tools/docs/config_reference.py           # rewrite docs/config_reference.md
    python tools/docs/config_reference.py --check   # exit 1 when the committed file is not current

Each key gets its type (in the words the config errors use), its default, its docstring (the attribute docstring
under the dataclass field, where every field is documented) and where it applies (the section's own docstring,
the module that defines it, and which stages read the section). `tests/test_docs.py` runs the check, so a field
added, renamed or re-documented without regenerating this page fails the suite.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import enum
import functools
import importlib
import inspect
import itertools
import json
import sys
import textwrap
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parents[2]
OUTPUT = ROOT / "docs" / "config_reference.md"
COMMAND = "python tools/docs/config_reference.py"

SECTION_USE = {
    "run": "every stage",
    "cluster": "every stage (Ray: local, or a cluster's address)",
    "placement": "every stage; `split` is needed for `rl.mode=async`",
    "model": "every stage (the starting weights of every role)",
    "actor": "every stage (`sft` and `rm` train it too: the policy, or the reward model's start)",
    "critic": "`ppo` (`algorithm.advantage.estimator=gae`)",
    "ref": "`grpo`, `ppo` when a KL to the reference is on (`algorithm.kl.coef` or `policy_loss.kl_loss_coef`)",
    "reward_model": "`grpo`, `ppo` with `reward_model.enabled`; trained by the `rm` stage",
    "teacher": "`grpo`, `ppo` with on-policy distillation (`algorithm.distill_coef` > 0)",
    "rollout": "`grpo`, `ppo` (and evaluation after `sft`)",
    "agent": "`grpo`, `ppo` with `agent.env` set (multi-turn episodes)",
    "algorithm": "`grpo`, `ppo`",
    "reward": "`grpo`, `ppo`, and evaluation",
    "data": "`grpo`, `ppo` (prompts) and evaluation",
    "rl": "`grpo`, `ppo`",
    "sft": "`sft`",
    "rm": "`rm`",
    "checkpoint": "every stage",
    "logging": "every stage",
    "plan": "`megarl plan`, `megarl train --dry-run` and the pre-flight memory check of `megarl train`",
}
"""Where each top-level section applies: the stages (run.stages) or commands that read it."""


def job_config_class() -> type:
    """The root of the schema, `JobConfig`, wherever the package layout puts it."""
    sys.path.insert(0, str(ROOT))
    for path in sorted((ROOT / "megarl").rglob("*.py")):
        if "\nclass JobConfig" in path.read_text(encoding="utf-8"):
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            return importlib.import_module(module).JobConfig
    raise SystemExit("no `class JobConfig` under megarl/: where did the job config go?")


@functools.cache
def attribute_docstrings(cls: type) -> dict[str, str]:
    """{field name: the string literal right under its annotated assignment} of `cls` and its dataclass bases."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass) or klass is object:
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        body = tree.body[0].body  # type: ignore[attr-defined]
        for node, after in itertools.pairwise(body):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def section_class(tp: Any) -> type | None:
    """The dataclass a field holds (`X` or `X | None`), or None for a plain value."""
    members = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
    classes = [m for m in members if isinstance(m, type) and dataclasses.is_dataclass(m)]
    return classes[0] if classes else None


def render_default(value: Any) -> str:
    """A default as it would be written in YAML."""
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    if isinstance(value, enum.Enum):
        return f"`{value.name}`"
    if isinstance(value, str):
        return f"`{value}`" if value else '`""`'
    if isinstance(value, (list, tuple, dict)):
        return f"`{json.dumps(value, default=str)}`"
    return f"`{value}`"


def cell(text: str) -> str:
    """Text for one table cell: one line, pipes escaped."""
    return " ".join(text.split()).replace("|", "\\|")


class Section(NamedTuple):
    key: str
    cls: type
    rows: list[tuple[str, str, str, str]]
    """(key, type, default, what it does) per field, as table cells."""


def sections(key: str, cls: type, value: Any) -> Iterator[Section]:
    """The section at `key` and every section nested in it, depth first; `value` is its default instance."""
    from megarl.config.schema import describe_type, field_types

    instance = value if value is not None else cls()
    docs = attribute_docstrings(cls)
    rows, nested = [], []
    for name, tp in field_types(cls).items():
        child_cls = section_class(tp)
        child = getattr(instance, name)
        full = f"{key}.{name}"
        if child_cls is not None:
            nested.append((full, child_cls, child))
            doc = docs.get(name) or (child_cls.__doc__ or "").split("\n\n")[0]
            default = "`null` (off)" if child is None else "see below"
            rows.append((f"[`{full}`](#{anchor(full)})", "a section", default, cell(doc)))
            continue
        rows.append((f"`{full}`", cell(describe_type(tp)), cell(render_default(child)), cell(docs.get(name, ""))))
    yield Section(key, cls, rows)
    for full, child_cls, child in nested:
        yield from sections(full, child_cls, child)


def anchor(key: str) -> str:
    """The id mkdocs gives the heading `key` (lowercased, dots dropped)."""
    return key.replace(".", "").lower()


def render() -> str:
    job = job_config_class()
    root = job()
    lines = [
        "# Config reference",
        "",
        f"<!-- Generated by `{COMMAND}` from the schema; do not edit by hand. -->",
        "",
        "Every key of a job config: its type, its default, what it does, and where it applies. A key is written in "
        "the YAML file as nested sections (`rollout: {sampling: {n: 8}}`) or on the command line as "
        "`rollout.sampling.n=8`; see [Training](training.md) for files, overrides, interpolation and paths. This page "
        f"is generated from the schema's dataclasses (`{COMMAND}`), so it is what the code accepts.",
        "",
        "Sections: " + ", ".join(f"[`{name}`](#{anchor(name)})" for name in SECTION_USE) + ".",
        "",
    ]
    missing = [name for name in (f.name for f in dataclasses.fields(job)) if name not in SECTION_USE]
    if missing:
        raise SystemExit(f"tools/docs/config_reference.py: say where section(s) {missing} apply in SECTION_USE")
    from megarl.config.schema import field_types

    top_docs = attribute_docstrings(job)
    for name, tp in field_types(job).items():
        for section in sections(name, section_class(tp) or type(getattr(root, name)), getattr(root, name)):
            lines += render_section(section, top_docs.get(name, ""), SECTION_USE[name])
    return "\n".join(lines).rstrip("\n") + "\n"


def render_section(section: Section, top_doc: str, use: str) -> list[str]:
    depth = section.key.count(".")
    module = inspect.getsourcefile(section.cls)
    where = Path(module).resolve().relative_to(ROOT).as_posix() if module else section.cls.__module__
    about = " ".join(part for part in ((section.cls.__doc__ or "").strip(), top_doc if depth == 0 else "") if part)
    lines = [f"{'#' * min(depth + 2, 6)} {section.key}", ""]
    if about and not about.startswith(f"{section.cls.__name__}("):  # a dataclass without a docstring gets its repr
        lines += [" ".join(about.split()), ""]
    if depth == 0:
        lines += [f"Applies to: {use}.", ""]
    lines += [f"Defined in `{where}` (`{section.cls.__name__}`).", ""]
    lines += ["| key | type | default | what it does |", "| --- | --- | --- | --- |"]
    lines += [f"| {key} | {tp} | {default} | {doc} |" for key, tp, default, doc in section.rows]
    return [*lines, ""]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare with the committed file, do not write")
    args = parser.parse_args()
    text = render()
    if args.check:
        if not OUTPUT.is_file() or OUTPUT.read_text(encoding="utf-8") != text:
            print(f"{OUTPUT.relative_to(ROOT)} is not current: run `{COMMAND}` and commit the result", file=sys.stderr)
            return 1
        return 0
    OUTPUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUTPUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
