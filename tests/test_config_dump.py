"""Writing configs back out (YAML round trip, the run folder copy), the config hash, and the suggestion helpers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from test_config import JobToy, OptimToy, RewardToy, RoleToy, write

from megarl.config import closest, config_hash, describe_valid, load_config, save_resolved, to_dict, to_yaml
from megarl.config.suggest import close_matches, unknown_choice

AWKWARD_STRINGS = ["yes", "no", "1e-5", "0x10", "null", "~", "", "true", "a: b", "- x", "#c", "${seed}", "multi\nline"]


def awkward_config() -> JobToy:
    return JobToy(
        actor=RoleToy(optim=OptimToy(lr=1e-5, betas=[0.5, 1.0]), stop=["</s>", "\n"], max_tokens=None),
        critic=RoleToy(dtype="bfloat16", extra_args={"z": "1", "a": "${x}"}, stop_token_ids=[0, 2]),
        rewards={"math": RewardToy(weight=0.25), "format": RewardToy(verifier="fmt")},
        name="on",
        seed=-3,
        tags=AWKWARD_STRINGS,
        output_dir=Path("/tmp/runs"),
    )


def test_to_yaml_reads_back_equal(tmp_path):
    config = awkward_config()
    path = write(tmp_path, "dumped.yaml", to_yaml(config))
    assert load_config(JobToy, path) == config
    assert load_config(JobToy, path).critic.extra_args["a"] == "${x}"  # literal, not an interpolation


def test_to_yaml_is_plain_readable_yaml():
    text = to_yaml(JobToy())
    assert text.startswith("actor:\n  parallel:\n    tp: 1\n    pp: 1\n")
    assert "critic: null\n" in text and "rewards: {}\n" in text and "output_dir: runs\n" in text
    assert "    betas:\n      - 0.9\n      - 0.999\n" in text and "lr: 1.0e-06\n" in text


def test_to_dict_is_plain_data():
    data = to_dict(awkward_config())
    assert json.loads(json.dumps(data)) == data
    assert data["output_dir"] == "/tmp/runs"
    assert data["rewards"]["format"] == {"weight": 1.0, "verifier": "fmt"}


def test_save_resolved_into_run_folder(tmp_path):
    config = awkward_config()
    written = save_resolved(config, tmp_path)
    assert written == tmp_path / "config.yaml"
    assert written.read_text().startswith(f"# Resolved megarl config; config_hash: {config_hash(config)}\n")
    assert load_config(JobToy, written) == config
    assert save_resolved(config, tmp_path / "sub" / "resolved.yaml") == tmp_path / "sub" / "resolved.yaml"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml", "sub"]  # no temporary files left


def test_config_hash_stable_and_sensitive(tmp_path):
    config = awkward_config()
    reordered = awkward_config()
    reordered.rewards = dict(reversed(list(reordered.rewards.items())))
    reordered.critic.extra_args = {"a": "${x}", "z": "1"}
    assert config_hash(config) == config_hash(reordered)
    assert len(config_hash(config)) == 16
    # A reloaded copy hashes the same (floats and ints come back as the same types).
    assert config_hash(load_config(JobToy, save_resolved(config, tmp_path))) == config_hash(config)

    changed = awkward_config()
    changed.actor.optim.lr = 1.1e-5
    assert config_hash(changed) != config_hash(config)
    changed = awkward_config()
    changed.tags = [*AWKWARD_STRINGS, "x"]
    assert config_hash(changed) != config_hash(config)
    assert config_hash(JobToy(seed=1)) != config_hash(JobToy(seed=2))
    assert config_hash(JobToy(seed=1), exclude=["seed"]) == config_hash(JobToy(seed=2), exclude=["seed"])
    assert config_hash(changed, exclude=["actor.optim.lr"]) != config_hash(config, exclude=["actor.optim.lr"])

    # Across processes (another hash seed): the same digest for the same data.
    data = to_dict(config)
    script = (
        "import json, sys; from megarl.config.dump import config_hash; print(config_hash(json.loads(sys.stdin.read())))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "123"}
    output = subprocess.run(
        [sys.executable, "-c", script], input=json.dumps(data), capture_output=True, text=True, env=env, check=True
    )
    assert output.stdout.strip() == config_hash(config)


def test_suggestions():
    assert closest("grpoo", ["gae", "grpo", "rloo"]) == "did you mean 'grpo'?"
    assert closest("GRPO", ["gae", "grpo"]) == "did you mean 'grpo'?"
    assert closest("zzz", ["gae", "grpo"]) == ""
    assert closest("tpp", ["tp", "pp", "etp"], quote=False, n=2) == "did you mean tp or pp?"
    assert close_matches("micro_batch", ["micro_batch_size", "global_batch_size"]) == ["micro_batch_size"]
    assert describe_valid(["a", "b"]) == "a, b"
    assert describe_valid([]) == "(none)"
    assert describe_valid([str(i) for i in range(5)], limit=3) == "0, 1, 2, ... (2 more)"
    assert unknown_choice("algorithm.advantage.estimator", "grpoo", ["gae", "grpo", "rloo"]) == (
        "algorithm.advantage.estimator='grpoo' is not known; valid: gae, grpo, rloo; did you mean 'grpo'?"
    )
    assert unknown_choice("x", "q", ["a"], problem="is not a verifier") == "x='q' is not a verifier; valid: a"


def test_suggest_and_package_import_light():
    script = (
        "import sys; import megarl.config; from megarl.config.suggest import closest; "
        "heavy = [m for m in ('omegaconf', 'yaml', 'torch', 'megatron', 'transformers', 'ray') if m in sys.modules]; "
        "import megarl.config.loader, megarl.config.dump; "
        "heavier = [m for m in ('torch', 'megatron', 'transformers', 'ray') if m in sys.modules]; "
        "print(heavy, heavier)"
    )
    output = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert output.stdout.strip() == "[] []"
