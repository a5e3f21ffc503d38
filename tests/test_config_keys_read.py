"""Every config key does something: a static walk of the whole job config schema (megarl/job.py and every section
it nests) that fails for any field no product code reads.

A field counts as read when megarl/ accesses its name as an attribute (`.name`) or as a string constant (`"name"`:
getattr, a dict of the dumped config), outside the validation of the config classes themselves (their `check` and
`__post_init__`: a key that is only validated does nothing). Names are matched by spelling, so this is a net for
keys nothing reads at all (a key wired by name somewhere passes); a field read only indirectly (the dataclass
copied field by field, or an interpolation) is listed in `READ_INDIRECTLY` with its reader.
"""

from __future__ import annotations

import ast
import dataclasses
import typing
from pathlib import Path

from megarl.config.schema import field_types
from megarl.job import JobConfig

PACKAGE = Path(__file__).resolve().parents[1] / "megarl"

READ_INDIRECTLY: dict[str, str] = {}
"""`Class.field` -> where it is read, for fields whose name appears in no attribute or string access."""

VALIDATION_METHODS = {"check", "__post_init__"}


def _sections(tp: typing.Any) -> list[type]:
    """The dataclasses a field's type holds: X, X | None, list[X], dict[str, X]."""
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return [tp]
    return [section for arg in typing.get_args(tp) for section in _sections(arg)]


def schema_fields(root: type = JobConfig) -> tuple[dict[str, str], set[type]]:
    """`Class.field` -> the first key path it appears at (e.g. `ModelSettings.dtype` -> `actor.model.dtype`), and
    the config classes walked."""
    found: dict[str, str] = {}
    classes: set[type] = set()

    def walk(cls: type, prefix: str) -> None:
        classes.add(cls)
        for name, tp in field_types(cls).items():
            key = f"{prefix}{name}"
            found.setdefault(f"{cls.__name__}.{name}", key)
            for section in _sections(tp):
                if section not in classes:
                    walk(section, f"{key}.")

    walk(root, "")
    return found, classes


def names_read(config_classes: set[str], package: Path = PACKAGE) -> set[str]:
    """Attribute names and string constants used in `package`, outside the config classes' validation methods."""
    names: set[str] = set()

    def visit(node: ast.AST, in_validation: bool) -> None:
        if isinstance(node, ast.ClassDef) and node.name in config_classes:
            for child in node.body:
                skip = isinstance(child, ast.FunctionDef) and child.name in VALIDATION_METHODS
                visit(child, skip)
            return
        if not in_validation:
            if isinstance(node, ast.Attribute):
                names.add(node.attr)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names.add(node.value)
        for child in ast.iter_child_nodes(node):
            visit(child, in_validation)

    for path in package.rglob("*.py"):
        visit(ast.parse(path.read_text()), False)
    return names


def unread_fields() -> list[str]:
    fields, classes = schema_fields()
    read = names_read({cls.__name__ for cls in classes})
    return [
        f"{field} (e.g. {key})"
        for field, key in sorted(fields.items())
        if field.split(".")[1] not in read and field not in READ_INDIRECTLY
    ]


def test_every_config_key_is_read_by_product_code():
    assert unread_fields() == []


def test_the_indirect_readers_are_fields_of_the_schema():
    assert sorted(set(READ_INDIRECTLY) - set(schema_fields()[0])) == []


@dataclasses.dataclass
class _Section:
    used: int = 0
    validated_only: int = 0

    def check(self, key: str) -> None:
        assert self.validated_only >= 0


def test_a_key_that_is_only_validated_counts_as_unread(tmp_path):
    (tmp_path / "section.py").write_text(
        "class _Section:\n    def check(self, key):\n        return self.validated_only\n"
        "def run(section):\n    return section.used\n"
    )
    read = names_read({"_Section"}, tmp_path)
    fields, _ = schema_fields(_Section)
    assert [name for name in fields if name.split(".")[1] not in read] == ["_Section.validated_only"]
