"""Every way a config can be wrong gives a UserError naming the file:line (or override), the key path and the fix.

The messages are asserted in full where their wording is the contract users and docs rely on.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest
from test_config import JobToy, write

from megarl.config import load_config
from megarl.errors import UserError

REPO = Path(__file__).resolve().parents[1]


def load_error(*args, **kwargs) -> str:
    with pytest.raises(UserError) as caught:
        load_config(*args, **kwargs)
    message = str(caught.value)
    # Nothing of OmegaConf's internals reaches the user.
    for leak in ("omegaconf", "DictConfig", "ListConfig", "full_key", "object_type", "AnyNode", "Traceback"):
        assert leak not in message, message
    assert "\n" not in message, message
    return message


def file_error(tmp_path, text: str, *overrides: str) -> tuple[str, str]:
    path = write(tmp_path, "run.yaml", text)
    return load_error(JobToy, path, list(overrides)), str(path)


def test_unknown_key_in_file_names_line_suggestion_and_valid_keys(tmp_path):
    message, path = file_error(tmp_path, "seed: 1\nactor:\n  parallel:\n    tpp: 2\n")
    assert message == (
        f"{path}:4: actor.parallel.tpp is not a config key; did you mean actor.parallel.tp? "
        "valid keys under actor.parallel: tp, pp, vpp, etp, sequence_parallel"
    )


def test_unknown_top_level_key(tmp_path):
    message, path = file_error(tmp_path, "seed: 1\nactr: {}\n")
    assert message.startswith(f"{path}:2: actr is not a config key; did you mean actor? valid top-level keys: actor,")


def test_unknown_key_inside_a_free_form_dict_of_sections(tmp_path):
    message, path = file_error(tmp_path, "rewards:\n  math:\n    wieght: 2\n")
    assert message == (
        f"{path}:3: rewards.math.wieght is not a config key; did you mean rewards.math.weight? "
        "valid keys under rewards.math: weight, verifier"
    )


def test_unknown_key_without_a_close_match_lists_the_valid_ones(tmp_path):
    message, _ = file_error(tmp_path, "actor:\n  optim:\n    zzz: 1\n")
    assert message.endswith(
        ":3: actor.optim.zzz is not a config key; valid keys under actor.optim: lr, betas, schedule, warmup_steps"
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("actor:\n  optim:\n    lr: abc\n", ":3: actor.optim.lr must be a number; got 'abc' (a string)"),
        ("seed: 1.5\n", ":1: seed must be an integer; got 1.5 (a number)"),
        ("seed: '3'\n", ":1: seed must be an integer; got '3' (a string)"),
        ("seed: true\n", ":1: seed must be an integer; got true"),
        ("debug: 1\n", ":1: debug must be true or false; got 1 (an integer)"),
        ("actor: 3\n", ":1: actor must be a section (a mapping with keys parallel, optim, dtype,"),
        ("actor:\n  parallel: [1]\n", ":2: actor.parallel must be a section"),
        ("actor:\n  parallel:\n    tp: null\n", ":3: actor.parallel.tp must be an integer; got null (this key cannot"),
        ("actor:\n  max_tokens: many\n", ":2: actor.max_tokens must be an integer or null; got 'many' (a string)"),
        ("tags: x\n", ":1: tags must be a list of strings; got 'x' (a string)"),
        ("tags:\n  - a\n  - [1]\n", ":3: tags[1] must be a string; got [1] (a list)"),
        ("actor:\n  extra_args:\n    k: [1]\n", ":3: actor.extra_args.k must be a string; got [1] (a list)"),
        ("actor:\n  extra_args: [1]\n", ":2: actor.extra_args must be a mapping of names to strings; got [1]"),
        ("actor:\n  extra_args:\n    1: x\n", ":2: actor.extra_args: keys must be strings; got 1 (an integer)"),
        ("rewards:\n  math: 3\n", ":2: rewards.math must be a section (a mapping with keys weight, verifier); got 3"),
        ("actor:\n  stop_token_ids: [1, x]\n", ":2: actor.stop_token_ids[1] must be an integer; got 'x' (a string)"),
    ],
)
def test_wrong_types_name_key_expected_type_and_value(tmp_path, text, expected):
    message, path = file_error(tmp_path, text)
    assert message.startswith(path + expected), message


def test_literal_outside_its_choices(tmp_path):
    message, path = file_error(tmp_path, "actor:\n  dtype: bfloat\n")
    assert message == (
        f"{path}:2: actor.dtype='bfloat' is not one of the choices; valid: float32, bfloat16; did you mean 'bfloat16'?"
    )
    message = load_error(JobToy, overrides=["critic.attention=flesh"])
    assert message == (
        "override 'critic.attention=flesh': critic.attention='flesh' is not one of the choices; valid: sdpa, flash; "
        "did you mean 'flash'?"
    )


@dataclass
class NeedsToy:
    model_path: str
    tokenizer: str = "???"
    seed: int = 0


def test_missing_required_values_are_listed_together(tmp_path):
    message = load_error(NeedsToy)
    assert message == (
        "missing required values: model_path (a string), tokenizer (a string); "
        "set them on the command line, e.g. model_path=..."
    )
    path = write(tmp_path, "run.yaml", "model_path: /m\n")
    assert load_error(NeedsToy, path) == (
        f"missing required value: tokenizer (a string); set it in {path} or on the command line, e.g. tokenizer=..."
    )
    assert load_config(NeedsToy, path, ["tokenizer=/t"]) == NeedsToy("/m", "/t")


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("seed", "override 'seed' is not of the form key=value (e.g. actor.parallel.tp=2)"),
        ("=3", "override '=3' is not of the form key=value"),
        ("+seed=3", "override '+seed=3': '+seed' is not a key path"),
        ("tags[0]=x", "override 'tags[0]=x': 'tags[0]' is not a key path"),
        ("tags=[a, b", "override 'tags=[a, b': the value is not valid YAML"),
        (
            "actor.parallel.tpp=2",
            "override 'actor.parallel.tpp=2': actor.parallel.tpp is not a config key; did you mean actor.parallel.tp? "
            "valid keys under actor.parallel: tp, pp, vpp, etp, sequence_parallel",
        ),
        ("actor.optim.lr=fast", "override 'actor.optim.lr=fast': actor.optim.lr must be a number; got 'fast'"),
        ("actor=null", "override 'actor=null': actor must be a section"),
        ("seed.x=1", "override 'seed.x=1': seed must be an integer; got {'x': 1} (a mapping)"),
    ],
)
def test_bad_overrides(override, expected):
    assert load_error(JobToy, overrides=[override]).startswith(expected)


def test_missing_file_and_yaml_syntax_errors(tmp_path):
    missing = tmp_path / "nope.yaml"
    assert load_error(JobToy, missing) == f"config file not found: {missing} (looked for {missing})"
    message, path = file_error(tmp_path, "seed: 1\nactor:\n  dtype: [float32\n")
    assert re.fullmatch(re.escape(path) + r":4:1: YAML syntax error: .*", message), message
    message, path = file_error(tmp_path, "seed: 1\nactor:\n   dtype: a\n  stop: []\n")
    assert message.startswith(f"{path}:4:3: YAML syntax error:"), message
    message, path = file_error(tmp_path, "seed: 1\nname: a\nseed: 2\n")
    assert message == f"{path}:3:1: YAML syntax error: duplicate key 'seed' (first given on line 1)"
    message, path = file_error(tmp_path, "- seed\n")
    assert message == f"{path}:1: the top level of a config file must be a mapping of keys (e.g. `actor:`), not a list"


def test_extends_errors(tmp_path):
    write(tmp_path, "a.yaml", "extends: b.yaml\n")
    write(tmp_path, "b.yaml", "seed: 1\nextends: [c.yaml]\n")
    write(tmp_path, "c.yaml", "extends: a.yaml\n")
    message = load_error(JobToy, tmp_path / "a.yaml")
    assert message == (
        f"config files extend each other in a cycle: {tmp_path}/a.yaml -> {tmp_path}/b.yaml -> {tmp_path}/c.yaml "
        f"-> {tmp_path}/a.yaml"
    )
    write(tmp_path, "self.yaml", "extends: self.yaml\n")
    assert "cycle" in load_error(JobToy, tmp_path / "self.yaml")

    path = write(tmp_path, "run.yaml", "seed: 1\nextends: gone.yaml\n")
    assert load_error(JobToy, path) == (
        f"{path}:2: extends: 'gone.yaml' is not a file (looked for {tmp_path / 'gone.yaml'})"
    )
    path = write(tmp_path, "run.yaml", "extends: {a: 1}\n")
    assert load_error(JobToy, path).startswith(f"{path}:1: extends must be a file name or a list of file names")
    # An error in a base file names the base file and its line.
    write(tmp_path, "base.yaml", "seed: 1\nactor:\n  dtyp: float32\n")
    path = write(tmp_path, "run.yaml", "extends: base.yaml\n")
    assert load_error(JobToy, path).startswith(f"{tmp_path}/base.yaml:3: actor.dtyp is not a config key")


def test_interpolation_errors(tmp_path, monkeypatch):
    message, path = file_error(tmp_path, "seed: 1\nactor:\n  optim:\n    lr: ${actor.optim.lrr}\n")
    assert message == (
        f"{path}:4: actor.optim.lr='${{actor.optim.lrr}}' refers to actor.optim.lrr, which is not a config key; "
        "did you mean actor.optim.lr?"
    )
    message, path = file_error(tmp_path, "name: run-${sed}\n")
    assert message == f"{path}:1: name='run-${{sed}}' refers to sed, which is not a config key; did you mean seed?"
    message = load_error(JobToy, overrides=["name=${critic.dtype}"])  # critic is None: nothing under it
    assert message == (
        "override 'name=${critic.dtype}': name='${critic.dtype}' refers to critic.dtype, which is not a config key"
    )

    monkeypatch.delenv("MEGARL_TEST_UNSET", raising=False)
    message, path = file_error(tmp_path, "name: ${oc.env:MEGARL_TEST_UNSET}\n")
    assert message == (
        f"{path}:1: name='${{oc.env:MEGARL_TEST_UNSET}}': environment variable MEGARL_TEST_UNSET is not set; "
        "set it, or give a default: ${oc.env:MEGARL_TEST_UNSET,...}"
    )
    monkeypatch.setenv("MEGARL_TEST_SEED", "many")
    message, path = file_error(tmp_path, "seed: ${oc.env:MEGARL_TEST_SEED}\n")
    assert message == (
        f"{path}:1: seed='${{oc.env:MEGARL_TEST_SEED}}' resolved to 'many' (a string), but seed must be an integer"
    )
    message, path = file_error(tmp_path, "name: ${seed\n")
    assert message.startswith(f"{path}:1: name='${{seed' is not a valid interpolation; write ${{other.key}}")
    message, path = file_error(tmp_path, "name: ${oc.evn:HOME}\n")
    assert message == f"{path}:1: name='${{oc.evn:HOME}}' uses the unknown resolver 'oc.evn'; did you mean 'oc.env'?"
    message, path = file_error(tmp_path, "actor: {stop: [a]}\ntags: [x, '${actor.stop}']\n")
    assert message == f"{path}:2: tags[1]='${{actor.stop}}' resolved to ['a'] (a list), but tags[1] must be a string"
    message, path = file_error(tmp_path, "seed: 2\ncritic: ${seed}\n")
    assert message.startswith(
        f"{path}:2: critic='${{seed}}' resolved to 2 (an integer), but critic must be a section (a mapping with keys"
    )
    message, path = file_error(tmp_path, "rewards: {m: '${actor.optim}'}\n")
    assert message.startswith(f"{path}:1: rewards.m='${{actor.optim}}' resolved to {{'lr': 1e-06")


def test_post_init_errors_name_the_section(tmp_path):
    message, path = file_error(tmp_path, "critic:\n  parallel:\n    tp: 0\n")
    assert message == f"{path}:2: critic.parallel: parallel.tp=0 must be >= 1"


def test_an_optimizer_for_a_frozen_role_is_refused_naming_the_keys(tmp_path):
    """ref and the reward model (during RL) are never trained: their `optim` keys would do nothing, so they are
    refused, in a file and as an override, saying what trains the role instead."""
    from megarl.job import JobConfig

    config = REPO / "configs" / "quickstart.yaml"
    path = write(tmp_path, "run.yaml", f"extends: {config}\nref:\n  optim: {{lr: 1.0e-5, beta1: 0.8}}\n")
    assert load_error(JobConfig, path) == (
        f"{path}:3: ref.optim.lr, ref.optim.beta1: ref.optim has no effect for a frozen role: it is never trained, "
        "so it has no optimizer; remove it"
    )
    assert load_error(JobConfig, config, ["reward_model.optim.lr=1e-5"]) == (
        "override 'reward_model.optim.lr=1e-5': reward_model.optim.lr: reward_model.optim has no effect for a frozen "
        "role: the reward model only scores samples during RL; the rm stage trains it with rm.optim"
    )
    assert load_config(JobConfig, config, ["actor.optim.lr=1e-5", "critic.optim.lr=2e-5"]).critic.optim.lr == 2e-5
