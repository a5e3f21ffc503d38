"""docs/coming_from_verl.md: every megarl key its tables name is a key of the job config, and every registry name it
says megarl shares with verl is registered."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from megarl.algorithms.registry import ADVANTAGE_ESTIMATORS, POLICY_LOSSES
from megarl.config.schema import field_types
from megarl.job import JobConfig

GUIDE = Path(__file__).parents[1] / "docs" / "coming_from_verl.md"
CODE = re.compile(r"`([^`]+)`")
KEY = re.compile(r"^[a-z_]+(\.[a-z_0-9]+)+$")


def _sections(cls: type) -> list[type]:
    """The dataclass (if any) that a field annotation holds, `X | None` included."""
    members = getattr(cls, "__args__", (cls,))
    return [m for m in members if dataclasses.is_dataclass(m)]


def is_config_key(path: str) -> bool:
    """Whether `path` (a.b.c) names a field, or a section, of JobConfig."""
    cls: type | None = JobConfig
    for name in path.split("."):
        types = field_types(cls) if cls is not None else {}
        if name not in types:
            return False
        sections = _sections(types[name])
        cls = sections[0] if sections else None  # a value: no key goes below it
    return True


def tables() -> list[tuple[list[str], list[str]]]:
    """(header cells, row cells) of every table row in the guide."""
    rows, header = [], None
    for line in GUIDE.read_text().splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        if header is None:
            header = cells
        elif not set(line) <= set("|- "):
            rows.append((header, cells))
    return rows


def megarl_keys() -> list[str]:
    """Every key in a cell of a `megarl` or `megarl key` column (`key=value` counts as key)."""
    keys = []
    for header, cells in tables():
        for column, cell in zip(header, cells):
            if column.startswith("megarl"):
                for code in CODE.findall(cell):
                    key = code.split("=")[0]
                    if KEY.match(key):
                        keys.append(key)
    return keys


def test_the_guide_names_many_keys_and_every_one_exists():
    keys = megarl_keys()
    assert len(set(keys)) >= 50, sorted(set(keys))
    missing = sorted({key for key in keys if not is_config_key(key)})
    assert not missing, f"docs/coming_from_verl.md names megarl keys the config does not have: {missing}"


def test_the_key_check_catches_a_wrong_key():
    assert is_config_key("algorithm.policy_loss.dual_clip") and is_config_key("rollout.eval_sampling")
    assert not is_config_key("algorithm.policy_loss.clip_ratio_low")
    assert not is_config_key("algorithm.kl.coef.value")


def test_the_shared_registry_names_are_registered():
    text = GUIDE.read_text()
    (estimators,) = [cells[2] for header, cells in tables() if cells[0] == "`algorithm.adv_estimator`"]
    (losses,) = [cells[2] for header, cells in tables() if cells[0] == "`policy_loss.loss_mode`"]
    assert set(CODE.findall(estimators.split(";")[0])) <= set(ADVANTAGE_ESTIMATORS.names())
    loss_names = set(CODE.findall(losses.split(";")[0]))
    assert loss_names == set(POLICY_LOSSES.names()) - {"ppo_clip"}
    assert "`algorithm.policy_loss.dual_clip=3.0`" in text
