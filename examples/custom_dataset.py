"""A custom dataset: your own columns, nested fields and a prompt template, read without any conversion code.

This writes a small Parquet file whose rows look like

    {"problem": {"text": "What is 12 * 7?", "source": "drill"}, "solution": {"final": "84"}}

and prints the config overrides that train on it: a template builds the prompt from the row's nested columns, the
label comes from a dotted key, and extra columns ride along as metadata.

    python examples/custom_dataset.py /tmp/mydata
    megarl train --config configs/quickstart.yaml <the printed overrides>
"""

from __future__ import annotations

import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq


def write_dataset(folder: Path, num_rows: int = 200) -> Path:
    rows = [
        {"problem": {"text": f"What is {a} * {b}?", "source": "drill"}, "solution": {"final": str(a * b)}}
        for a, b in ((i % 13 + 2, i % 7 + 3) for i in range(num_rows))
    ]
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def overrides(path: Path) -> list[str]:
    """The config keys that read this file: the template formats the row's own (nested) columns."""
    return [
        f"data.train_files=[{path}]",
        f"data.eval_files=[{path}]",
        "data.template=Q: {problem[text]} A:",
        "data.label_key=solution.final",
        "data.meta_keys=[problem.source]",
    ]


def main(argv: list[str]) -> int:
    path = write_dataset(Path(argv[0] if argv else "/tmp/megarl-custom-data"))
    print(" ".join(f"'{override}'" for override in overrides(path)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
