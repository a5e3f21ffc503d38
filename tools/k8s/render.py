"""Fill in a megarl Kubernetes manifest's variables and print it, for `kubectl apply -f -`.

    python tools/k8s/render.py tools/k8s/megarl-rayjob-671b.yaml MEGARL_IMAGE=registry.example.com/megarl:0.5 \
        NUM_WORKERS=32 | kubectl apply -f -
    python tools/k8s/render.py --list tools/k8s/megarl-rayjob-671b.yaml      # the variables and their defaults

A manifest names its variables `${NAME}` (must be given) or `${NAME:-default}`. Unlike `envsubst`, which puts an
empty string where a variable is unset, a variable without a value is an error naming it, and so is a value given
for a name the manifest does not have (a typo). Values come from NAME=VALUE arguments, else the environment.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path

VARIABLE = re.compile(r"\$\{([A-Z][A-Z0-9_]*)(?::-([^}]*))?\}")


def variables(text: str) -> dict[str, str | None]:
    """{name: default (None: must be given)} of every variable in `text`, in order of first use."""
    found: dict[str, str | None] = {}
    for match in VARIABLE.finditer(text):
        name, default = match.group(1), match.group(2)
        if found.get(name) is None:
            found[name] = default
    return found


def render(text: str, values: Mapping[str, str], environ: Mapping[str, str] = os.environ) -> str:
    """`text` with every variable replaced; ValueError naming what is missing or unknown."""
    known = variables(text)
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ValueError(f"not variables of this manifest: {', '.join(unknown)}; it has: {', '.join(known)}")
    missing = [
        name for name, default in known.items() if default is None and name not in values and name not in environ
    ]
    if missing:
        raise ValueError(f"no value for {', '.join(missing)}: give NAME=VALUE (or set it in the environment)")

    def value(match: re.Match) -> str:
        name, default = match.group(1), match.group(2)
        return values.get(name, environ.get(name, default))

    return VARIABLE.sub(value, text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("manifest", type=Path)
    parser.add_argument("values", nargs="*", metavar="NAME=VALUE")
    parser.add_argument("--list", action="store_true", help="print the variables and their defaults")
    args = parser.parse_args(argv)
    text = args.manifest.read_text()
    if args.list:
        for name, default in variables(text).items():
            print(f"{name}={default}" if default is not None else f"{name} (required)")
        return 0
    bad = [item for item in args.values if "=" not in item]
    if bad:
        parser.error(f"expected NAME=VALUE, got {' '.join(bad)}")
    try:
        sys.stdout.write(render(text, dict(item.split("=", 1) for item in args.values)))
    except ValueError as err:
        print(f"render.py: {args.manifest}: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
