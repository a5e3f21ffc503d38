"""The config loader on toy schemas shaped like the real ones: defaults, files, overrides, interpolation, extends.

Error messages are tested in tests/test_config_errors.py; dumping and hashing in tests/test_config_dump.py.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest

from megarl.config import load_config, parse_override
from megarl.errors import UserError


@dataclass(frozen=True)
class ParallelToy:
    """A frozen section validated in __post_init__ (the loader must name the section in its errors)."""

    tp: int = 1
    pp: int = 1
    vpp: int = 1
    etp: int | None = None
    sequence_parallel: bool = False

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise UserError(f"parallel.tp={self.tp} must be >= 1")


@dataclass
class OptimToy:
    lr: float = 1e-6
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    schedule: Literal["constant", "cosine"] = "constant"
    warmup_steps: int = 0

    def check(self, key: str) -> None:
        if self.warmup_steps < 0:
            raise UserError(f"{key}.warmup_steps={self.warmup_steps} must be >= 0")


@dataclass
class RoleToy:
    parallel: ParallelToy = field(default_factory=ParallelToy)
    optim: OptimToy = field(default_factory=OptimToy)
    dtype: Literal["float32", "bfloat16"] = "float32"
    attention: Literal["sdpa", "flash"] | None = None
    extra_args: dict[str, str] = field(default_factory=dict)
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] | None = None
    max_tokens: int | None = None
    micro_batch_size: int = 1

    def check(self, key: str) -> None:
        if self.parallel.sequence_parallel and self.parallel.tp == 1:
            raise UserError(f"{key}.parallel.sequence_parallel=true needs {key}.parallel.tp > 1")


@dataclass
class RewardToy:
    weight: float = 1.0
    verifier: str = "math"


@dataclass
class JobToy:
    actor: RoleToy = field(default_factory=RoleToy)
    critic: RoleToy | None = None
    rewards: dict[str, RewardToy] = field(default_factory=dict)
    name: str = "run"
    seed: int = 0
    tags: list[str] = field(default_factory=list)
    output_dir: Path = Path("runs")
    debug: bool = False

    def check(self, key: str) -> None:
        if self.critic is not None and self.critic.micro_batch_size > self.actor.micro_batch_size:
            raise UserError(
                f"critic.micro_batch_size={self.critic.micro_batch_size} exceeds "
                f"actor.micro_batch_size={self.actor.micro_batch_size}"
            )


def write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text).lstrip("\n"))
    return path


def test_defaults_load_without_a_file():
    assert load_config(JobToy) == JobToy()


def test_file_then_overrides_in_order(tmp_path):
    path = write(
        tmp_path,
        "run.yaml",
        """
        name: from-file
        seed: 7
        actor:
          parallel: {tp: 2, sequence_parallel: true}
          optim:
            lr: 1e-5
            schedule: cosine
          extra_args: {a: "1"}
          stop: ["</s>"]
        rewards:
          math: {weight: 0.5}
        """,
    )
    config = load_config(JobToy, path, ["seed=11", "actor.optim.lr=2e-5", "actor.extra_args.b=two"])
    assert config.name == "from-file"
    assert config.seed == 11
    assert config.actor.optim.lr == 2e-5
    assert config.actor.optim.schedule == "cosine"
    assert config.actor.optim.betas == [0.9, 0.999]  # untouched default
    assert config.actor.parallel == ParallelToy(tp=2, sequence_parallel=True)
    assert config.actor.extra_args == {"a": "1", "b": "two"}  # dict[str, X] takes new keys, merged
    assert config.actor.stop == ["</s>"]
    assert config.rewards == {"math": RewardToy(weight=0.5)}
    assert isinstance(config.actor, RoleToy) and isinstance(config.actor.parallel, ParallelToy)
    # Later overrides win over earlier ones.
    assert load_config(JobToy, path, ["seed=1", "seed=2"]).seed == 2


@pytest.mark.parametrize(
    ("override", "attribute", "expected"),
    [
        ("seed=3", "seed", 3),
        ("seed=1_000", "seed", 1000),
        ("actor.optim.lr=0.5", "actor.optim.lr", 0.5),
        ("actor.optim.lr=1e-5", "actor.optim.lr", 1e-5),
        ("actor.optim.lr=3", "actor.optim.lr", 3.0),
        ("actor.optim.betas=[0.8, 0.9]", "actor.optim.betas", [0.8, 0.9]),
        ("actor.max_tokens=128", "actor.max_tokens", 128),
        ("actor.max_tokens=null", "actor.max_tokens", None),
        ("actor.attention=flash", "actor.attention", "flash"),
        ("actor.stop_token_ids=[1,2]", "actor.stop_token_ids", [1, 2]),
        ("debug=true", "debug", True),
        ("actor.parallel.etp=2", "actor.parallel.etp", 2),
        ('name="3"', "name", "3"),
        ("name='a b=c'", "name", "a b=c"),
        ("name=no", "name", "no"),  # YAML 1.2 typing: `no` is a string, not false
        ("name=null", "name", None),  # checked below: str is not optional
        ("name=", "name", ""),
        ("name=a:b", "name", "a:b"),
        ("tags=[x, y]", "tags", ["x", "y"]),
        ("output_dir=/tmp/out", "output_dir", Path("/tmp/out")),
        ("critic={}", "critic", RoleToy()),
        ("critic.micro_batch_size=1", "critic", RoleToy()),
        ("rewards.fmt={weight: 2}", "rewards", {"fmt": RewardToy(weight=2.0)}),
    ],
)
def test_override_values_are_typed_like_yaml(override, attribute, expected):
    if expected is None and attribute == "name":
        with pytest.raises(UserError, match="name must be a string; got null"):
            load_config(JobToy, overrides=[override])
        return
    value = load_config(JobToy, overrides=[override])
    for part in attribute.split("."):
        value = getattr(value, part)
    assert value == expected
    assert type(value) is type(expected)


def test_parse_override():
    assert parse_override("a.b-c.d=[1, {x: y}]") == ("a.b-c.d", [1, {"x": "y"}])
    assert parse_override(" a = 1e3") == ("a", 1000.0)


def test_interpolation(tmp_path, monkeypatch):
    path = write(
        tmp_path,
        "run.yaml",
        """
        name: run-${seed}
        seed: ${oc.env:MEGARL_TEST_SEED,5}
        tags: ["${name}", "${actor.dtype}"]
        actor:
          dtype: bfloat16
          micro_batch_size: 4
        critic:
          optim: {lr: "${actor.optim.lr}"}
          parallel: ${actor.parallel}
          micro_batch_size: ${actor.micro_batch_size}
        """,
    )
    monkeypatch.delenv("MEGARL_TEST_SEED", raising=False)
    config = load_config(JobToy, path, ["actor.optim.lr=0.25", "actor.parallel.tp=2"])
    assert config.seed == 5  # the env default, converted to the field's type
    assert config.name == "run-5"
    assert config.tags == ["run-5", "bfloat16"]
    assert config.critic.optim.lr == 0.25  # interpolations see the overrides
    assert config.critic.parallel == ParallelToy(tp=2)
    assert config.critic.micro_batch_size == 4

    monkeypatch.setenv("MEGARL_TEST_SEED", "9")
    assert load_config(JobToy, path).name == "run-9"
    # An escaped interpolation is a literal string.
    assert load_config(JobToy, overrides=[r"name=\${seed}"]).name == "${seed}"


def test_extends_chain_relative_to_each_file(tmp_path):
    write(tmp_path, "base/common.yaml", "seed: 1\nname: common\nactor: {micro_batch_size: 2, optim: {lr: 0.1}}\n")
    write(tmp_path, "base/model.yaml", "extends: common.yaml\nactor: {dtype: bfloat16}\nname: model\n")
    write(tmp_path, "extra.yaml", "tags: [extra]\nseed: 3\n")
    path = write(tmp_path, "exp/run.yaml", "extends: [../base/model.yaml, ../extra.yaml]\nactor: {optim: {lr: 0.5}}\n")
    config = load_config(JobToy, path, ["seed=4"])
    assert config.name == "model"  # model.yaml over common.yaml
    assert config.tags == ["extra"]
    assert config.actor.micro_batch_size == 2  # from the far base
    assert config.actor.dtype == "bfloat16"
    assert config.actor.optim.lr == 0.5  # the file over its bases
    assert config.seed == 4  # overrides over everything
    assert load_config(JobToy, path).seed == 3  # later bases over earlier ones


def test_extends_diamond_is_not_a_cycle(tmp_path):
    write(tmp_path, "root.yaml", "seed: 1\n")
    write(tmp_path, "left.yaml", "extends: root.yaml\nname: left\n")
    write(tmp_path, "right.yaml", "extends: root.yaml\ntags: [right]\n")
    path = write(tmp_path, "run.yaml", "extends: [left.yaml, right.yaml]\n")
    config = load_config(JobToy, path)
    assert (config.seed, config.name, config.tags) == (1, "left", ["right"])


def test_checks_run_with_key_paths(tmp_path):
    # an amount (the schema's own rule, before the dataclass's check)
    with pytest.raises(
        UserError, match=r": critic\.optim\.warmup_steps=-1 is negative; it is an amount: give 0 or more$"
    ):
        load_config(JobToy, overrides=["critic={optim: {warmup_steps: -1}}"])
    with pytest.raises(UserError, match=r"}': actor\.parallel\.sequence_parallel=true needs actor\.parallel\.tp > 1$"):
        load_config(JobToy, overrides=["actor.parallel={sequence_parallel: true}"])
    # Where the key the check names was set, the message says so.
    with pytest.raises(UserError, match=r"^override 'critic.micro_batch_size=2': critic\.micro_batch_size=2 exceeds "):
        load_config(JobToy, overrides=["critic.micro_batch_size=2"])
    path = write(tmp_path, "run.yaml", "seed: 1\ncritic:\n  optim:\n    warmup_steps: -2\n")
    with pytest.raises(UserError, match=r"run\.yaml:4: critic\.optim\.warmup_steps=-2 is negative"):
        load_config(JobToy, path)


def test_yaml_typing_in_files(tmp_path):
    path = write(
        tmp_path,
        "run.yaml",
        """
        name: off
        seed: 010
        tags: [yes, 1e-3, ~, 2024-01-01]
        actor: {optim: {lr: 5e-7}}
        """,
    )
    with pytest.raises(UserError, match=r"run\.yaml:3: tags\[2\] must be a string; got null"):
        load_config(JobToy, path)
    path.write_text(path.read_text().replace("~, ", ""))
    config = load_config(JobToy, path)
    assert (config.name, config.seed, config.actor.optim.lr) == ("off", 10, 5e-7)
    assert config.tags == ["yes", "0.001", "2024-01-01"]
