"""Rows from data files, checked before training starts.

Reads JSON Lines (one object per line; locations `file:line`, counting from 1), JSON (a list of objects; `file row
N`) and Parquet (`file row N`; row numbers count from 0 as in pandas and `datasets`). Rows stream one at a time
(Parquet in record batches of the needed columns only), so a large file is never held whole except a `.json`
list. Every problem found (invalid JSON, a missing column, a wrong type, an empty prompt) is collected with its
location, and all rows of all files are read before one UserError lists the first few: a bad row fails the run at
start, not hours in.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from megarl.data.config import DATA_FILE_SUFFIXES, check_data_files
from megarl.errors import UserError

T = TypeVar("T")

MISSING = object()
"""What `lookup` returns for a key a row does not have."""

PARQUET_BATCH_ROWS = 1024


@dataclass
class Row:
    location: str
    """Where the row is, for messages: `file:line` or `file row N`."""
    values: dict[str, Any]


class RowError(ValueError):
    """One row cannot be used; the message says what was expected (the caller adds the location)."""


class ProblemLog:
    """Collects what is wrong with the rows of a dataset and raises one UserError naming the first few."""

    def __init__(self, what: str, max_listed: int = 5):
        self.what = what
        self.max_listed = max_listed
        self.num_problems = 0
        self.listed: list[str] = []

    def add(self, location: str, message: str) -> None:
        self.num_problems += 1
        if len(self.listed) < self.max_listed:
            self.listed.append(f"{location}: {message}")

    def raise_if_any(self) -> None:
        if not self.num_problems:
            return
        shown = "" if self.num_problems <= len(self.listed) else f" (the first {len(self.listed)} shown)"
        raise UserError(
            f"{self.num_problems} problem(s) in {self.what}{shown}:\n  " + "\n  ".join(self.listed) + "\nFix the "
            "rows or the column keys; no training starts with malformed data."
        )


# -- reading -----------------------------------------------------------------------------------------------------


def read_rows(paths: Sequence[str], key: str, columns: Sequence[str], problems: ProblemLog) -> Iterator[Row]:
    """The rows of all files in order; rows that are not JSON objects are logged in `problems` and skipped.
    `columns` are the (possibly dotted) keys the caller needs: Parquet reads only their top-level columns."""
    check_data_files(list(paths), key)
    for index, path in enumerate(paths):
        reader = _READERS[next(suffix for suffix in DATA_FILE_SUFFIXES if path.endswith(suffix))]
        num_rows, problems_before = 0, problems.num_problems
        for row in reader(path, columns, problems):
            num_rows += 1
            yield row
        if num_rows == 0 and problems.num_problems == problems_before:
            problems.add(f"{key}[{index}]={path!r}", "holds no rows (an empty file); give a file with data")


def _read_jsonl(path: str, columns: Sequence[str], problems: ProblemLog) -> Iterator[Row]:
    with open(path, "rb") as file:
        for line_number, line in enumerate(file, start=1):
            if not line.strip():
                continue  # blank lines (a trailing newline) carry no row
            location = f"{path}:{line_number}"
            try:
                values = json.loads(line)
            except ValueError as error:  # JSONDecodeError or UnicodeDecodeError
                problems.add(location, f"invalid JSON ({_short(error)})")
                continue
            if not isinstance(values, dict):
                problems.add(location, f"is {describe(values)}; expected a JSON object with keys {_keys(columns)}")
                continue
            yield Row(location, values)


def _read_json(path: str, columns: Sequence[str], problems: ProblemLog) -> Iterator[Row]:
    try:
        with open(path, "rb") as file:
            data = json.load(file)
    except ValueError as error:
        problems.add(path, f"invalid JSON ({_short(error)})")
        return
    if not isinstance(data, list):
        problems.add(path, f"holds {describe(data)}; expected a list of objects (or use a .jsonl file)")
        return
    for index, values in enumerate(data):
        location = f"{path} row {index}"
        if not isinstance(values, dict):
            problems.add(location, f"is {describe(values)}; expected an object with keys {_keys(columns)}")
            continue
        yield Row(location, values)


def _read_parquet(path: str, columns: Sequence[str], problems: ProblemLog) -> Iterator[Row]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError(f"reading {path} needs pyarrow: pip install pyarrow (or datasets, which brings it)") from None
    try:
        parquet = pq.ParquetFile(path)
    except Exception as error:  # pyarrow raises its own error types for a corrupt file
        problems.add(path, f"not a readable Parquet file ({_short(error)})")
        return
    available = set(parquet.schema_arrow.names)
    roots = list(dict.fromkeys(name if name in available else name.split(".")[0] for name in columns))
    absent = [name for name in roots if name not in available]
    if absent:
        # A missing column fails every row: say it once, for the file.
        problems.add(path, f"has no column {_keys(absent)}; its columns: {_keys(sorted(available))}")
        return
    index = 0
    for record_batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=roots):
        for values in record_batch.to_pylist():
            yield Row(f"{path} row {index}", values)
            index += 1


_READERS: dict[str, Callable[[str, Sequence[str], ProblemLog], Iterator[Row]]] = {
    ".jsonl": _read_jsonl,
    ".json": _read_json,
    ".parquet": _read_parquet,
}


# -- checking ----------------------------------------------------------------------------------------------------


def lookup(values: Mapping[str, Any], key: str) -> Any:
    """`values[key]`, or for a dotted key absent at the top level, the nested value (`a.b` -> values["a"]["b"]);
    MISSING when there is none."""
    if key in values:
        return values[key]
    node: Any = values
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return MISSING
        node = node[part]
    return node


def describe(value: Any) -> str:
    """The kind of a JSON value, as a message says it: 'a number (42)', 'empty text', 'null' ..."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"a boolean ({json.dumps(value)})"
    if isinstance(value, int | float):
        return f"a number ({value})"
    if isinstance(value, str):
        return "empty text" if not value.strip() else "text"
    if isinstance(value, list | tuple):
        return "an empty list" if not value else "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def check_text(value: Any) -> None:
    if not isinstance(value, str) or not value.strip():
        raise RowError(f"is {describe(value)}; expected non-empty text")


def check_prompt(value: Any) -> None:
    """Non-empty text, or a non-empty list of chat messages with text content."""
    expected = "expected non-empty text or a list of chat messages ({'role': ..., 'content': ...})"
    if isinstance(value, str) and value.strip():
        return
    if not isinstance(value, list | tuple) or not value:
        raise RowError(f"is {describe(value)}; {expected}")
    for index, message in enumerate(value):
        if not isinstance(message, Mapping):
            raise RowError(f"[{index}] is {describe(message)}; {expected}")
        for part in ("role", "content"):
            if not isinstance(message.get(part), str):
                found = "missing" if part not in message else describe(message[part])
                raise RowError(f"[{index}][{part!r}] is {found}; a chat message needs text 'role' and 'content'")
    if not any(message["content"].strip() for message in value):
        raise RowError(f"is {describe(value)} of messages with no content; {expected}")


def check_value(value: Any) -> None:
    if value is None:
        raise RowError("is null; expected a value")


def check_scalar(value: Any) -> None:
    """What a format template can write: text or a number."""
    if not isinstance(value, str | int | float) or isinstance(value, bool):
        raise RowError(f"is {describe(value)}; the template needs text or a number")


def check_any(value: Any) -> None:
    """Present (null allowed)."""


FIELD_CHECKS: dict[str, Callable[[Any], None]] = {
    "text": check_text,
    "prompt": check_prompt,
    "value": check_value,
    "scalar": check_scalar,
    "any": check_any,
}
"""How a column is checked, by kind. A check raises RowError saying what was found and what was expected."""


def field_values(row: Row, fields: Mapping[str, str]) -> dict[str, Any]:
    """The values of `fields` (key -> kind in FIELD_CHECKS) from a row, each checked; raises RowError naming the key
    of the first one that is missing or wrong."""
    values = {}
    for key, kind in fields.items():
        value = lookup(row.values, key)
        if value is MISSING:
            raise RowError(f"no key {key!r}; the row has {_keys(row.values)}")
        try:
            FIELD_CHECKS[kind](value)
        except RowError as error:
            raise RowError(f"{key!r}{'' if str(error).startswith('[') else ' '}{error}") from None
        values[key] = value
    return values


def load_rows(
    paths: Sequence[str], key: str, fields: Mapping[str, str], convert: Callable[[Row, dict[str, Any]], T], what: str
) -> list[tuple[str, T]]:
    """Read every row of `paths`, check `fields` (key -> kind) and `convert(row, values)` it; a RowError from either
    is logged with the row's location. Returns (location, converted) pairs once every row is read, or raises one
    UserError listing the first problems."""
    problems = ProblemLog(what)
    loaded = []
    for row in read_rows(paths, key, list(fields), problems):
        try:
            loaded.append((row.location, convert(row, field_values(row, fields))))
        except RowError as error:
            problems.add(row.location, str(error))
    problems.raise_if_any()
    return loaded


def _keys(names: Any) -> str:
    names = list(names)
    shown = ", ".join(repr(name) for name in names[:12])
    return (shown + ", ...") if len(names) > 12 else (shown or "none")


def _short(error: Exception, limit: int = 160) -> str:
    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."
