"""The catalogue of bad inputs: configs, datasets, checkpoints and command lines that must be refused, each with
the message it must produce. Every case runs the real command line (in-process: all of these fail before Ray or
any model starts), and must exit non-zero with one paragraph naming the offending key / file / row and what would
be valid, print no traceback (`--debug` shows it), and write nothing (no run folder, no half-written output).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from megarl.cli import main


@dataclass
class Case:
    name: str
    args: list[str]
    """Command line after `megarl`; {cfg} is the base job config, {dir} the case's folder."""
    expect: list[str]
    """Fragments the error message must contain."""
    config: str = ""
    """YAML of the case's job file, which extends the base config."""
    files: dict[str, str] = field(default_factory=dict)
    """Extra files to write in the case's folder (name -> content)."""
    code: int = 2
    prepare: str = ""
    """A named preparation step (see `prepare`)."""
    model: str = "tiny-qwen3"
    """The tiny checkpoint the base config trains."""


BASE = """
run: {{name: bad, dir: {dir}/run, stages: [grpo]}}
model: {{path: {model}}}
placement: {{train_gpus: 2}}
actor: {{model: {{dtype: float32, parallel: {{tp: 2}}}}}}
reward: {{fn: gsm8k, num_workers: 0}}
data: {{train_files: [{dir}/prompts.jsonl]}}
rl: {{num_steps: 2, prompts_per_step: 4}}
"""

TRAIN = ["train", "--config", "{cfg}"]


CASES = [
    # -- the command line and the config file --------------------------------------------------------------------
    Case("config file missing", ["train", "--config", "{dir}/nope.yaml"], ["config file not found", "nope.yaml"]),
    Case("yaml syntax", TRAIN, ["YAML syntax error", "job.yaml:"], config="rl: {num_steps: [1, 2\n"),
    Case("unknown top-level key", TRAIN, ["rll is not a config key", "did you mean rl"], config="rll: {}\n"),
    Case(
        "unknown nested key",
        TRAIN,
        ["actor.optim.lrr", "did you mean actor.optim.lr"],
        config="actor: {optim: {lrr: 1}}\n",
    ),
    Case("wrong type", TRAIN, ["rl.num_steps must be an integer", "'many'"], config="rl: {num_steps: many}\n"),
    Case(
        "literal outside choices",
        TRAIN,
        ["rollout.backend='vllm'", "valid: hf, sglang"],
        config="rollout: {backend: vllm}\n",
    ),
    Case("override without =", [*TRAIN, "rl.num_steps"], ["'rl.num_steps' is not of the form key=value"]),
    Case("unknown override key", [*TRAIN, "rl.nums_steps=3"], ["rl.nums_steps", "did you mean rl.num_steps"]),
    Case("unknown stage", [*TRAIN, "run.stages=[rlhf]"], ["run.stages", "sft, grpo, ppo, rm"]),
    Case("unknown estimator", [*TRAIN, "algorithm.advantage.estimator=grpoo"], ["grpoo", "did you mean 'grpo'"]),
    Case("clip out of range", [*TRAIN, "algorithm.policy_loss.clip_low=1.5"], ["algorithm.policy_loss.clip_low"]),
    Case("negative temperature", [*TRAIN, "rollout.sampling.temperature=-1"], ["rollout.sampling.temperature=-1.0"]),
    Case("mini-batches", [*TRAIN, "rl.mini_batches=3"], ["rl.mini_batches=3", "rl.prompts_per_step=4"]),
    Case("ppo without critic", [*TRAIN, "run.stages=[ppo]"], ["run.stages has ppo", "estimator=gae"]),
    Case("grpo with gae", [*TRAIN, "algorithm.advantage.estimator=gae"], ["run.stages has grpo", "ppo stage"]),
    Case("async colocated", [*TRAIN, "rl.max_staleness=1"], ["rl.max_staleness=1", "placement.mode=split"]),
    Case("split without gpus", [*TRAIN, "placement.mode=split"], ["placement.mode=split", "rollout_gpus"]),
    Case("reward module missing", [*TRAIN, "reward.fn=nope.mod:fn"], ["reward.fn", "nope.mod"]),
    Case(
        "reward attribute missing", [*TRAIN, "reward.fn={dir}/fn.py:nothere"], ["nothere"], files={"fn.py": "x = 1\n"}
    ),
    Case("wandb missing", [*TRAIN, "logging.wandb.enabled=true"], ["logging.wandb", "wandb"]),
    # -- parallel layouts against the model ----------------------------------------------------------------------
    Case(
        "tp does not divide heads",
        [*TRAIN, "actor.model.parallel.tp=3"],
        ["actor.model.parallel.tp=3", "num_attention_heads=4", "valid: 1, 2"],
    ),
    Case(
        "pp does not divide layers",
        [*TRAIN, "actor.model.parallel.pp=3"],
        ["actor.model.parallel.pp=3", "num_hidden_layers=4"],
    ),
    Case("ep on a dense model", [*TRAIN, "actor.model.parallel.ep=2"], ["actor.model.parallel.ep=2", "dense"]),
    Case(
        "gpus short of tp",
        [*TRAIN, "placement.train_gpus=3"],
        ["does not divide placement.train_gpus=3", "valid train_gpus: 2, 4"],
    ),
    Case(
        "rollout engine over parts of nodes",
        [
            *TRAIN,
            "rollout.backend=sglang",
            "rollout.sglang.tp=3",
            "rollout.gpus_per_engine=3",
            "cluster.gpus_per_node=2",
        ],
        ["rollout.gpus_per_engine=3 spans nodes of cluster.gpus_per_node=2", "use a multiple of 2"],
    ),
    # -- numbers no key accepts --------------------------------------------------------------------------------------
    Case("nan learning rate", [*TRAIN, "actor.optim.lr=.nan"], ["actor.optim.lr=nan is not a finite number"]),
    Case("nan temperature", [*TRAIN, "rollout.sampling.temperature=.nan"], ["temperature=nan is not a finite"]),
    Case("nan memory budget", [*TRAIN, "plan.gpu_memory_gb=.nan"], ["plan.gpu_memory_gb=nan is not a finite"]),
    Case(
        "infinite learning rate", TRAIN, ["actor.optim.lr=inf is not a finite"], config="actor: {optim: {lr: .inf}}\n"
    ),
    Case(
        "seed beyond 64 bits",
        [*TRAIN, "run.seed=18446744073709551616"],
        ["run.seed=18446744073709551616 does not fit in a 64-bit integer"],
    ),
    Case("negative budget", [*TRAIN, "plan.host_memory_gb=-1"], ["plan.host_memory_gb=-1.0 is negative", "0 or more"]),
    Case(
        "negative token budget",
        TRAIN,
        ["actor.micro_batch.max_tokens=-8 is negative"],
        config="actor: {micro_batch: {max_tokens: -8}}\n",
    ),
    # -- the model -----------------------------------------------------------------------------------------------
    Case("model path missing", [*TRAIN, "model.path={dir}/nomodel"], ["model.path=", "nomodel", "does not exist"]),
    Case(
        "unsupported model type",
        TRAIN,
        ["model_type='gpt2' is not supported", "supported: deepseek_v3"],
        prepare="gpt2",
    ),
    Case("truncated safetensors", TRAIN, ["model.safetensors", "truncated or corrupted"], prepare="truncate"),
    Case(
        "safetensors entry without offsets",
        TRAIN,
        ["model.safetensors is not a valid safetensors file: tensor", "has no data_offsets"],
        prepare="no_offsets",
    ),
    Case(
        "weights that do not fit config.json",
        TRAIN,
        ["model.safetensors: tensor model.layers.0.mlp.down_proj.weight has shape [64, 128]", "gives [64, 256]"],
        prepare="wrong_shape",
    ),
    Case("megatron checkpoint missing a shard", TRAIN, ["__0_0.distcp is missing", "incomplete"], prepare="lost_shard"),
    # -- data ----------------------------------------------------------------------------------------------------
    Case(
        "data file missing",
        [*TRAIN, "data.train_files=[{dir}/gone.jsonl]"],
        ["data.train_files[0]", "gone.jsonl", "does not exist"],
    ),
    Case(
        "data file type",
        [*TRAIN, "data.train_files=[{dir}/p.csv]"],
        ["p.csv", "unknown file type", ".jsonl, .json, .parquet"],
        files={"p.csv": "a\n"},
    ),
    Case(
        "data file missing, relative path",
        [*TRAIN, "data.train_files=[gone/p.jsonl]"],
        [
            "data.train_files[0]='gone/p.jsonl' does not exist (looked at",
            "gone/p.jsonl: a relative path on the command",
        ],
    ),
    Case("empty data file", TRAIN, ["prompts.jsonl'", "holds no rows (an empty file)"], prepare="empty"),
    Case("invalid json row", TRAIN, ["prompts.jsonl:3", "JSON"], prepare="bad_json"),
    Case("row missing prompt", TRAIN, ["prompts.jsonl:2", "'prompt'"], prepare="no_prompt"),
    Case("prompt is a number", TRAIN, ["prompts.jsonl:1", "'prompt' is a number"], prepare="number_prompt"),
    Case(
        "all prompts too long",
        [*TRAIN, "data.max_prompt_tokens=1"],
        ["data.train_files: none of the 8 prompts", "data.max_prompt_tokens=1", "raise the limit"],
    ),
    # -- run folders and checkpoints -----------------------------------------------------------------------------
    Case(
        "resume never with checkpoints",
        [*TRAIN, "run.resume=never"],
        ["already has checkpoints", "run.resume=auto"],
        prepare="checkpoint",
    ),
    Case(
        "latest names a missing folder",
        TRAIN,
        ["latest names step_9", "not a complete checkpoint"],
        prepare="dangling_latest",
    ),
    Case(
        "unreadable trainer state", TRAIN, ["trainer_state.json is not a readable trainer state"], prepare="bad_state"
    ),
    Case(
        "run folder is a file",
        [*TRAIN, "run.dir={dir}/afile"],
        ["run.dir=", "afile' is an existing file, not a folder"],
        files={"afile": "notes\n"},
    ),
    # -- the other commands --------------------------------------------------------------------------------------
    Case(
        "convert to an existing folder",
        ["convert", "--from", "hf", "--to", "mcore", "{model}", "{dir}"],
        ["already exists", "--overwrite"],
    ),
    Case(
        "convert at an impossible tp",
        ["convert", "--from", "hf", "--to", "mcore", "{model}", "{dir}/out", "--tp", "3"],
        ["--tp=3", "num_attention_heads=4"],
    ),
    Case("plot without metrics", ["plot", "{dir}"], ["has no metrics.jsonl", "not a megarl run folder"]),
    # -- rollout with SGLang -------------------------------------------------------------------------------------
    Case(
        "nccl weight sync into the hf engine",
        TRAIN,
        ["rollout.weight_sync=nccl broadcasts into SGLang servers", "use object_store"],
        config="rollout: {weight_sync: nccl}\n",
    ),
    Case(
        "ipc weight sync with split placement",
        TRAIN,
        ["rollout.weight_sync=ipc needs the engines on the actor's GPUs", "placement.mode=split"],
        config="rollout: {weight_sync: ipc}\nplacement: {mode: split, rollout_gpus: 1}\n",
    ),
    Case(
        "nccl weight sync into colocated engines",
        TRAIN,
        ["rollout.weight_sync=nccl is for engines on GPUs of their own", "colocated: ipc"],
        config="rollout: {backend: sglang, weight_sync: nccl}\n",
    ),
    Case(
        "in-place pause",
        TRAIN,
        ["rollout.sglang.pause_mode", "in_place"],
        config="rollout: {backend: sglang, sglang: {pause_mode: in_place}}\n",
    ),
    Case(
        "qwen3-moe dense layers on sglang",
        TRAIN,
        ["mlp_only_layers=[1] cannot be served by SGLang", "builds every Qwen3-MoE layer as a MoE layer"],
        config="rollout: {backend: sglang}\nactor: {model: {parallel: {tp: 1}}}\n",
        model="tiny-qwen3-moe",
    ),
    Case(
        "kimi k2 on sglang without its remote code",
        TRAIN,
        ["rollout.sglang.trust_remote_code=false", "model_type='kimi_k2'", "set rollout.sglang.trust_remote_code=true"],
        config="rollout: {backend: sglang}\nactor: {model: {parallel: {tp: 1}}}\n",
        model="tiny-kimi-k2",
    ),
    Case(
        "dry run of a bad config",
        [*TRAIN, "--dry-run"],
        ["rollout.weight_sync=nccl broadcasts into SGLang servers"],
        config="rollout: {weight_sync: nccl}\n",
    ),
]


def prepare(case: Case, folder: Path, model: Path) -> None:
    """Make the case's broken model, data or run folder."""
    prompts = folder / "prompts.jsonl"
    rows = {
        "bad_json": '{"prompt": "a", "label": "1"}\n{"prompt": "b", "label": "2"}\n{"prompt": "c", \n',
        "no_prompt": '{"prompt": "a", "label": "1"}\n{"question": "b", "label": "2"}\n',
        "number_prompt": '{"prompt": 42, "label": "1"}\n',
        "empty": "",
    }
    if case.prepare in rows:
        prompts.write_text(rows[case.prepare])
    if case.prepare in ("gpt2", "truncate", "no_offsets", "wrong_shape"):
        copy = folder / "model"
        shutil.copytree(model, copy)
        (folder / "base.yaml").write_text((folder / "base.yaml").read_text().replace(str(model), str(copy)))
        config = json.loads((copy / "config.json").read_text())
        if case.prepare == "gpt2":
            (copy / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
        elif case.prepare == "wrong_shape":  # the weights of another model size
            (copy / "config.json").write_text(
                json.dumps({**config, "intermediate_size": 2 * config["intermediate_size"]})
            )
        elif case.prepare == "no_offsets":
            _drop_first_offsets(copy / "model.safetensors")
        else:
            data = (copy / "model.safetensors").read_bytes()
            (copy / "model.safetensors").write_bytes(data[: len(data) // 2])
    if case.prepare == "lost_shard":  # converted in a process of its own: the conversion activates Megatron's CPU mode
        import subprocess
        import sys

        converted = folder / "mcore"
        command = ["convert", "--from", "hf", "--to", "mcore", "--no-progress", str(model), str(converted)]
        subprocess.run([sys.executable, "-m", "megarl.cli", *command], check=True, capture_output=True)
        (converted / "model" / "__0_0.distcp").unlink()
        (folder / "base.yaml").write_text((folder / "base.yaml").read_text().replace(str(model), str(converted)))
    checkpoints = folder / "run" / "checkpoints"
    if case.prepare in ("checkpoint", "bad_state"):
        (checkpoints / "step_1").mkdir(parents=True)
        state = "{not json" if case.prepare == "bad_state" else json.dumps({"step": 1, "global_step": 1})
        (checkpoints / "step_1" / "trainer_state.json").write_text(state)
        (checkpoints / "latest").write_text("step_1\n")
    if case.prepare == "dangling_latest":
        checkpoints.mkdir(parents=True)
        (checkpoints / "latest").write_text("step_9\n")


def _drop_first_offsets(path: Path) -> None:
    """Rewrite a safetensors file's header without the data_offsets of its first tensor (same data)."""
    import struct

    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    first = next(name for name in header if name != "__metadata__")
    del header[first]["data_offsets"]
    encoded = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + raw[8 + length :])


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_bad_input_is_refused_clearly(case: Case, tmp_path, hf_checkpoint, capsys):
    model = hf_checkpoint(case.model)
    (tmp_path / "prompts.jsonl").write_text(
        "".join(json.dumps({"prompt": f"{i}+1=", "label": str(i + 1)}) + "\n" for i in range(8))
    )
    (tmp_path / "base.yaml").write_text(BASE.format(dir=tmp_path, model=model))
    (tmp_path / "job.yaml").write_text("extends: base.yaml\n" + case.config)
    for name, content in case.files.items():
        (tmp_path / name).write_text(content)
    prepare(case, tmp_path, model)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    args = [a.format(cfg=tmp_path / "job.yaml", dir=tmp_path, model=model) for a in case.args]

    code = main(args)

    err = capsys.readouterr().err
    assert code == case.code, err
    assert any(line.startswith("megarl: error: ") for line in err.splitlines()), err
    for fragment in case.expect:
        assert fragment.format(dir=tmp_path) in err, f"{fragment!r} not in:\n{err}"
    assert "Traceback" not in err
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before, "something was written"


def test_debug_shows_the_traceback(tmp_path):
    with pytest.raises(Exception, match="config file not found"):
        main(["--debug", "train", "--config", str(tmp_path / "nope.yaml")])


def test_the_catalogue_has_at_least_30_cases():
    assert len(CASES) >= 30


@pytest.fixture
def read_only_folder(tmp_path):
    """A folder on a file system mounted read-only (a tmpfs; needs root and mount rights, else skipped)."""
    import subprocess

    folder = tmp_path / "ro"
    folder.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(folder)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here: {done.stderr.decode().strip()[:200]}")
    yield folder
    subprocess.run(["umount", str(folder)], check=True)


def test_read_only_destinations_are_refused_before_any_work(read_only_folder, tmp_path, hf_checkpoint, capsys):
    model = hf_checkpoint("tiny-qwen3")
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"prompt": "1+1=", "label": "2"}) + "\n")
    (tmp_path / "job.yaml").write_text(BASE.format(dir=tmp_path, model=model))
    capsys.readouterr()  # the fixture's model build
    assert main(["train", "--config", str(tmp_path / "job.yaml"), f"run.dir={read_only_folder}/run"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"megarl: error: run.dir='{read_only_folder}/run' cannot be written: {read_only_folder} is read-only (a "
        "read-only file system or no write permission); give a folder on a writable file system"
    )
    assert main(["convert", "--from", "hf", "--to", "mcore", str(model), f"{read_only_folder}/out"]) == 2
    assert "cannot be written: " in capsys.readouterr().err


def test_resume_skips_a_checkpoint_that_lost_a_shard(tmp_path, caplog):
    """The newest checkpoint lost a `.distcp` shard (a disk problem, a partial copy): resuming takes the newest
    intact one and says which it skipped and why; with none intact, one error says so."""
    import torch
    import torch.distributed.checkpoint as dcp

    from megarl.errors import UserError
    from megarl.trainer.lifecycle.run_checkpoint import RunCheckpoints

    checkpoints = RunCheckpoints(tmp_path / "run", keep=0)
    for step in (1, 2):
        folder = checkpoints.root / f"step_{step}"
        dcp.save({"w": torch.full((4,), float(step))}, checkpoint_id=folder / "actor" / "model", no_dist=True)
        (folder / "trainer_state.json").write_text(json.dumps({"step": step, "global_step": step}))
    (checkpoints.root / "latest").write_text("step_2\n")
    assert checkpoints.latest() == checkpoints.root / "step_2"
    lost = next((checkpoints.root / "step_2" / "actor" / "model").glob("*.distcp"))
    lost.unlink()
    with caplog.at_level("WARNING", logger="megarl"):
        assert checkpoints.latest() == checkpoints.root / "step_1"
    assert f"checkpoint step_2 is damaged, not resuming from it: {lost} is missing" in caplog.text
    next((checkpoints.root / "step_1" / "actor" / "model").glob("*.distcp")).write_bytes(b"")  # truncated
    with pytest.raises(UserError, match=r"no intact checkpoint in .* \(the newest, step_2, and every older one"):
        checkpoints.latest()
