"""`megarl convert` from the command line: the catalogue of bad inputs, and the real console script.

Each bad input must give exit code 2, one paragraph naming the bad file/flag/value and what is valid, no traceback,
and leave nothing behind. These fail in pre-flight, before Megatron is touched, so they run in this process.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megarl.bridge.safetensors_io import HFCheckpoint
from megarl.cli import main
from megarl.conversion.hf_to_mcore import convert_hf_to_mcore
from megarl.conversion.mcore_to_hf import convert_mcore_to_hf
from megarl.errors import UserError
from megarl.runtime.parallel import ParallelConfig


@pytest.fixture
def src(hf_checkpoint, tmp_path):
    """A private copy of a tiny sharded HF checkpoint, free to break."""
    folder = tmp_path / "src"
    shutil.copytree(hf_checkpoint("tiny-llama", max_shard_size="100KB"), folder)
    return folder


def run_cli(capsys, *argv) -> tuple[int, str]:
    capsys.readouterr()  # drop what fixtures printed
    code = main(["convert", *argv, "--no-progress"])
    err = capsys.readouterr().err
    return code, err


def assert_clean_error(code: int, err: str, *fragments: str) -> None:
    assert code == 2, err
    assert err.startswith("megarl: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in err, (fragment, err)


def truncate(folder):
    victim = sorted(folder.glob("model-*.safetensors"))[2]
    victim.write_bytes(victim.read_bytes()[:-100])
    return victim.name


def corrupt_header(folder):
    victim = sorted(folder.glob("model-*.safetensors"))[0]
    data = bytearray(victim.read_bytes())
    data[10:30] = b"#" * 20
    victim.write_bytes(bytes(data))
    return victim.name


def set_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


CASES = {
    "missing source": (lambda s: s / "nope", [], ["nope is not a folder"]),
    "source is a file": (lambda s: s / "config.json", [], ["config.json is not a folder"]),
    "no config.json": (lambda s: (s / "config.json").unlink() or s, [], ["config.json does not exist"]),
    "unsupported model_type": (
        lambda s: set_config(s, model_type="gpt2") or s,
        [],
        ["model_type='gpt2' is not supported", "deepseek_v3, glm4_moe, gpt_oss, kimi_k2, llama, mixtral"],
    ),
    "tp does not divide heads": (
        lambda s: s,
        ["--tp", "3"],
        ["--tp=3 does not divide num_attention_heads=4", "valid: 1, 2"],
    ),
    "tp does not divide kv heads": (lambda s: s, ["--tp", "4"], ["num_key_value_heads=2", "valid: 1, 2"]),
    "pp does not divide layers": (lambda s: s, ["--pp", "3"], ["--pp=3 x --vpp=1 does not divide num_hidden_layers=4"]),
    "vpp without pp": (lambda s: s, ["--vpp", "2"], ["--vpp=2 needs pipeline parallelism (--pp > 1)"]),
    "truncated safetensors": (lambda s: s, [], ["truncated or corrupted"]),
    "corrupted header": (lambda s: s, [], ["is not a valid safetensors file"]),
    "no weights": (lambda s: [p.unlink() for p in s.glob("model*")] and s, [], ["holds no safetensors weights"]),
    "bad vocab multiple": (lambda s: s, ["--vocab-multiple", "0"], ["--vocab-multiple=0 must be a positive integer"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_hf_to_mcore_inputs(capsys, src, tmp_path, case):
    prepare, flags, fragments = CASES[case]
    if case == "truncated safetensors":
        fragments = [truncate(src), *fragments]
    if case == "corrupted header":
        fragments = [corrupt_header(src), *fragments]
    source = prepare(src)
    dst = tmp_path / "dst"
    code, err = run_cli(capsys, "--from", "hf", "--to", "mcore", str(source), str(dst), *flags)
    assert_clean_error(code, err, *fragments)
    assert not dst.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "staging folder left behind"


def test_existing_destination_needs_overwrite(capsys, src, tmp_path):
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    code, err = run_cli(capsys, "--from", "hf", "--to", "mcore", str(src), str(dst))
    assert_clean_error(code, err, "already exists; pass --overwrite")
    assert (dst / "keep.txt").read_text() == "mine"


def test_destination_inside_source(capsys, src):
    code, err = run_cli(capsys, "--from", "hf", "--to", "mcore", str(src), str(src / "out"))
    assert_clean_error(code, err, "overlaps the source")


def test_not_a_megarl_checkpoint(capsys, src, tmp_path):
    code, err = run_cli(capsys, "--from", "mcore", "--to", "hf", str(src), str(tmp_path / "dst"))
    assert_clean_error(code, err, "megarl.json does not exist", "is not a megarl Megatron checkpoint")


def test_incomplete_megarl_checkpoint(capsys, tmp_path):
    folder = tmp_path / "ckpt"
    (folder / "model").mkdir(parents=True)
    info = {"architecture": "llama", "vocab_size": 10, "padded_vocab_size": 128, "params_dtype": "float32"}
    (folder / "megarl.json").write_text(json.dumps(info))
    code, err = run_cli(capsys, "--from", "mcore", "--to", "hf", str(folder), str(tmp_path / "dst"))
    assert_clean_error(code, err, "holds no complete Megatron checkpoint (metadata.json missing)")


def test_checkpoint_missing_a_shard(ranks1, src, tmp_path, capsys):
    """A lost `.distcp` shard is named, with its checkpoint, before anything is read or written (it used to end in
    a FileNotFoundError traceback halfway through)."""
    mcore = tmp_path / "mcore"
    ranks1.run(convert_hf_to_mcore, str(src), str(mcore), ParallelConfig(), show_progress=False)
    victim = sorted((mcore / "model").glob("*.distcp"))[-1]
    victim.unlink()
    code, err = run_cli(capsys, "--from", "mcore", "--to", "hf", str(mcore), str(tmp_path / "hf"))
    assert_clean_error(code, err, f"{victim} is missing: the checkpoint in {mcore / 'model'} is incomplete")
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--from", "hf", "--to", "hf"], "--from hf --to hf is not a conversion; valid: --from hf --to mcore"),
        (["--from", "mcore", "--to", "hf", "--max-shard-size", "lots"], "--max-shard-size='lots' is not a size"),
    ],
)
def test_bad_flags(capsys, src, tmp_path, argv, fragment):
    code, err = run_cli(capsys, *argv, str(src), str(tmp_path / "dst"))
    assert_clean_error(code, err, fragment)


def test_weights_that_do_not_fit_the_config(ranks1, src, tmp_path):
    """Caught from the meta model's expected shapes, before a single tensor is converted."""
    set_config(src, intermediate_size=96)
    with pytest.raises(Exception, match=r"do not match the model described by .*tensors with the wrong shape"):
        ranks1.run(convert_hf_to_mcore, str(src), str(tmp_path / "dst"), show_progress=False)
    assert not (tmp_path / "dst").exists()


def test_config_edited_after_conversion(ranks1, src, tmp_path):
    mcore = tmp_path / "mcore"
    ranks1.run(convert_hf_to_mcore, str(src), str(mcore), ParallelConfig(), show_progress=False)
    set_config(mcore / "hf", tie_word_embeddings=True)
    with pytest.raises(Exception, match="describes other tensors than the checkpoint recorded in hf_tensors.json"):
        ranks1.run(convert_mcore_to_hf, str(mcore), str(tmp_path / "back"), show_progress=False)


def test_user_errors_are_value_errors():
    assert issubclass(UserError, ValueError)


# ---- the real console script ------------------------------------------------------------------------------------


def megarl(*argv, check=True):
    """The installed console script, as a user runs it (next to this interpreter, where pip puts it)."""
    script = Path(sys.executable).parent / "megarl"
    out = subprocess.run([str(script), *argv], capture_output=True, text=True, timeout=300)
    if check:
        assert out.returncode == 0, out.stderr
    return out


@pytest.mark.parametrize(("script", "expected"), [("hf_to_mcore", "config.json"), ("mcore_to_hf", "megarl.json")])
def test_the_converters_scripts_run_the_convert_command(src, tmp_path, script, expected):
    """`python converters/<script>.py SRC DST` from any folder is `megarl convert` in that direction (here an HF
    folder without config.json, and an HF folder taken for a Megatron checkpoint: each refused as the CLI does)."""
    (src / "config.json").unlink()
    path = Path(__file__).resolve().parents[1] / "converters" / f"{script}.py"
    argv = [sys.executable, str(path), str(src), str(tmp_path / "dst"), "--no-progress"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 2 and out.stderr.startswith("megarl: error: "), out.stderr
    assert expected in out.stderr and "Traceback" not in out.stderr


def verified(stdout: str) -> tuple[float, float]:
    """(largest |logit difference|, top-1 agreement %) from `megarl convert --verify`'s report line."""
    import re

    line = next(line for line in stdout.splitlines() if line.startswith("verified: "))
    found = re.search(r"difference\| (\S+) \(tolerance 0.001\), top-1 agreement (\S+)% over 64 tokens", line)
    assert found, line
    return float(found.group(1)), float(found.group(2))


def test_console_script_round_trip_with_overwrite(hf_checkpoint, tmp_path):
    """A bf16 checkpoint to Megatron at TP=2, verified against transformers (--verify), and back bit for bit."""
    src = hf_checkpoint("tiny-qwen2", torch.bfloat16)
    mcore, back = tmp_path / "mcore", tmp_path / "back"
    out = megarl(
        "convert", "--from", "hf", "--to", "mcore", str(src), str(mcore), "--tp", "2", "--no-progress", "--verify"
    )
    assert f"wrote {mcore}" in out.stdout
    diff, top1 = verified(out.stdout)
    assert diff < 1e-4 and top1 == 100.0 and "Megatron at tp=2 pp=1 vpp=1 on 2 ranks" in out.stdout
    back.mkdir()
    megarl("convert", "--from", "mcore", "--to", "hf", str(mcore), str(back), "--overwrite", "--max-shard-size", "50KB")
    original, converted = HFCheckpoint(src), HFCheckpoint(back)
    assert sorted(original.names) == sorted(converted.names)
    assert all(torch.equal(original.get(n), converted.get(n)) for n in original.names)


@pytest.mark.parametrize(
    "name, layout, ranks",
    [
        ("tiny-llama", ["--pp", "2", "--pp-first-stage-layers", "1"], 2),  # uneven stages
        ("tiny-glm4-moe", ["--ep", "2"], 2),  # sigmoid routing, shared experts, partial RoPE, qk-norm, q/k/v biases
        ("tiny-gpt-oss", ["--tp", "2", "--etp", "1"], 2),  # sinks, sliding windows, YaRN, clamped SwiGLU, biases
    ],
    ids=["dense-pp2-uneven", "glm4-moe-ep2", "gpt-oss-tp2"],
)
def test_convert_verify_checks_the_written_layout_against_transformers(hf_checkpoint, tmp_path, name, layout, ranks):
    src, dst = hf_checkpoint(name), tmp_path / "mcore"
    out = megarl("convert", "--from", "hf", "--to", "mcore", str(src), str(dst), *layout, "--no-progress", "--verify")
    diff, top1 = verified(out.stdout)
    assert diff < 1e-4 and top1 == 100.0 and f"on {ranks} ranks" in out.stdout


def test_convert_verify_fails_when_the_checkpoint_is_not_the_models(hf_checkpoint, tmp_path):
    """What --verify reports for a checkpoint that does not reproduce its HF model: here the HF folder's weights are
    swapped for another model's of the same shapes after the conversion, so the comparison must fail."""
    from megarl.conversion.verify_parity import verify_conversion
    from megarl.errors import RunFailure
    from megarl.testing.tiny_checkpoint import make_hf_checkpoint

    src = make_hf_checkpoint("tiny-llama", tmp_path / "hf")
    megarl("convert", "--from", "hf", "--to", "mcore", str(src), str(tmp_path / "mcore"), "--no-progress")
    make_hf_checkpoint("tiny-llama", tmp_path / "other", seed=1)
    shutil.copy(tmp_path / "other" / "model.safetensors", src / "model.safetensors")
    with pytest.raises(RunFailure, match=r"--verify: the Megatron checkpoint .*mcore does not reproduce the HF model"):
        verify_conversion(src, tmp_path / "mcore", ParallelConfig())


def test_debug_flag_shows_the_traceback(tmp_path):
    out = megarl(
        "--debug", "convert", "--from", "hf", "--to", "mcore", str(tmp_path / "nope"), str(tmp_path / "d"), check=False
    )
    assert out.returncode != 0 and "Traceback" in out.stderr and "UserError" in out.stderr


def dry_run_job(tmp_path: Path, model: Path, *extra: str) -> Path:
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"{i}+1=", "label": str(i)}) + "\n"
                                                    for i in range(8)))  # fmt: skip
    job = tmp_path / "job.yaml"
    job.write_text(
        f"run: {{name: dry, dir: {tmp_path}/run, stages: [grpo]}}\nmodel: {{path: {model}}}\n"
        "placement: {train_gpus: 2}\nactor: {model: {parallel: {tp: 2}}}\nreward: {fn: gsm8k, num_workers: 0}\n"
        f"data: {{train_files: [{tmp_path}/prompts.jsonl]}}\nrl: {{num_steps: 2, prompts_per_step: 4}}\n"
        + "".join(f"{line}\n" for line in extra)
    )
    return job


def test_train_dry_run_checks_everything_prints_the_launches_and_starts_nothing(hf_checkpoint, tmp_path, capsys):
    job = dry_run_job(tmp_path, hf_checkpoint("tiny-qwen3"), "rollout: {backend: sglang}")
    before = sorted(tmp_path.rglob("*"))

    assert main(["train", "--config", str(job), "--dry-run"]) == 0

    out = capsys.readouterr().out
    assert "resolved config" in out and "  rollout:\n    backend: sglang" in out
    assert "placement\n  node 0 " in out and "actor (2 GPUs" in out
    assert out.count(" -m sglang.launch_server --model-path ") == 2  # two colocated engines of one GPU
    assert "--port 30000 --load-format dummy" in out and "--port 30001 --load-format dummy" in out
    assert "dry run: every data row checked; the run would start fresh" in out
    assert sorted(tmp_path.rglob("*")) == before  # no run folder, nothing written


def test_train_dry_run_fails_on_what_train_would_fail_on(hf_checkpoint, tmp_path, capsys):
    job = dry_run_job(tmp_path, hf_checkpoint("tiny-qwen3"), "rollout: {backend: sglang}")
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "a", "label": "1"}\n{"question": "b"}\n')
    assert main(["train", "--config", str(job), "--dry-run"]) == 2
    assert "prompts.jsonl" in capsys.readouterr().err
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "a", "label": "1"}\n' * 8)
    assert main(["train", "--config", str(job), "--dry-run", "plan.gpu_memory_gb=0.5"]) == 1  # does not fit
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and " -m sglang.launch_server " in out
