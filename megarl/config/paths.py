"""One rule for relative paths in a config: **a relative path written in a config file is relative to the folder of
that file** (as `extends:` is); one given on the command line (`--config`, `key=value` overrides) is relative to the
working directory, as anything typed in a shell is. A config then means the same wherever it is run from: a
terminal in another folder, a Slurm job (whose working directory is its job folder) or a Kubernetes pod.

The schema marks its path fields with `path_field(kind)`; `anchor_paths` rewrites what one file layer sets before
the layers are merged, so a base file's paths stay relative to the base file. Kinds:

- `file`: a file or folder (run.dir, model.init.config, plan.model_config);
- `files`: a list of them (data.train_files, data.eval_files);
- `model`: a folder, or a Hugging Face Hub id (`org/name[@revision]`): anchored unless it reads as a Hub id and no
  such folder exists next to the file (or the section builds it: `init`);
- `spec`: `path/to/file.py:name` (the file part is anchored) or `module.path:name` / a built-in name (left alone).

Values that start with an interpolation (`${oc.env:MEGARL_DATA,/data}/...`) or `~` are left as they are: the
interpolation or the home folder decides where they point.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import field
from pathlib import Path
from typing import Any, Literal

PathKind = Literal["file", "files", "model", "spec"]
HUB_ID_RE = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<revision>[\w./-]+))?$")
"""A Hugging Face Hub model id, `org/name[@revision]` (megarl/checkpoint/hub.py fetches what it names)."""
_METADATA = "megarl_path"


def path_field(kind: PathKind, default: Any = dataclasses.MISSING, default_factory: Any = dataclasses.MISSING):
    """A dataclass field holding a path of `kind` (see the module doc)."""
    return field(default=default, default_factory=default_factory, metadata={_METADATA: kind})


def anchor_paths(schema: type, data: dict[str, Any], folder: Path) -> None:
    """Make the relative paths in `data` (one config file's content, shaped like `schema`) relative to `folder`,
    in place."""
    from megarl.config.schema import field_types

    if not (dataclasses.is_dataclass(schema) and isinstance(data, dict)):
        return
    fields = {f.name: f for f in dataclasses.fields(schema)}
    types = field_types(schema)
    for name, value in data.items():
        spec = fields.get(name)
        if spec is None:
            continue  # an unknown key: the schema check names it
        kind = spec.metadata.get(_METADATA)
        if kind is not None:
            data[name] = _anchor(kind, value, folder, data)
        else:
            anchor_paths(_dataclass_in(types.get(name)), value, folder)


def _anchor(kind: PathKind, value: Any, folder: Path, section: dict[str, Any]) -> Any:
    if kind == "files":
        return [_anchor("file", item, folder, section) for item in value] if isinstance(value, list) else value
    if not isinstance(value, str) or not value or value.startswith(("${", "~", "/")):
        return value
    if kind == "spec":
        target, sep, name = value.rpartition(":")
        return f"{os.path.normpath(folder / target)}{sep}{name}" if sep and target.endswith(".py") else value
    if kind == "model" and HUB_ID_RE.match(value) and not (folder / value).exists() and not section.get("init"):
        return value  # a Hub id
    return os.path.normpath(folder / value)  # configs/../runs/x reads as runs/x in messages and config.yaml


def _dataclass_in(tp: Any) -> Any:
    """The dataclass a field's type holds (`X`, `X | None`), else None."""
    if dataclasses.is_dataclass(tp):
        return tp
    for arg in getattr(tp, "__args__", ()):
        if dataclasses.is_dataclass(arg):
            return arg
    return None
