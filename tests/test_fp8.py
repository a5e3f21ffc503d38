"""Block-wise FP8 checkpoints (DeepSeek-V3/R1's format): read dequantized, exactly as `w.float() * scale` computed
block by block here, for `megarl convert` and for `model.path`; quantized again for FP8 rollout into the names,
shapes and dtypes of the real checkpoint."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from helpers import hf_logits, megatron_logits, one_result, sample_ids
from safetensors.torch import save_file

from megarl.bridge.fp8 import DEEPSEEK_QUANTIZATION, QUANTIZED_LINEAR, BlockFP8, dequantize, quantize, quantize_bucket
from megarl.bridge.safetensors_io import SINGLE_FILE, HFCheckpoint
from megarl.cli import main
from megarl.errors import UserError
from megarl.runtime.parallel import ParallelConfig as P
from megarl.testing.fp8_checkpoint import make_tiny_fp8_deepseek


def reference_dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The independent reference: one block at a time, in float32, rounded to bf16 once."""
    out = torch.empty(weight.shape, dtype=torch.float32)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            rows, cols = slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1])
            out[rows, cols] = weight[rows, cols].float() * scale[i, j]
    return out.to(torch.bfloat16)


def test_dequantize_handles_partial_last_blocks():
    weight = (torch.randn(40, 50) * 50).to(torch.float8_e4m3fn)
    scale = torch.rand(3, 3) + 0.5  # 40 = 16 + 16 + 8 rows, 50 = 24 + 24 + 2 columns
    expected = reference_dequantize(weight, scale, (16, 24))
    assert torch.equal(dequantize(weight, scale, (16, 24), torch.bfloat16), expected)
    with pytest.raises(UserError, match=r"a scale of shape \(2, 3\) for a weight of \(40, 50\): expected \(3, 3\)"):
        dequantize(weight, scale[:2], (16, 24), torch.bfloat16)


def test_quantize_round_trip_error_is_within_e4m3_rounding():
    weight = torch.randn(300, 200, dtype=torch.bfloat16) * torch.logspace(-3, 1, 200)  # columns of many magnitudes
    q, scale = quantize(weight, (128, 128))
    assert q.dtype == torch.float8_e4m3fn and q.shape == (300, 200)
    assert scale.dtype == torch.float32 and scale.shape == (3, 2)
    back = dequantize(q, scale, (128, 128), torch.float32)
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 for normal values, absolute <= scale * 2^-10 below them
    bound = weight.float().abs() / 16 + scale.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :200] / 512
    assert ((back - weight.float()).abs() <= bound).all()
    assert q.float().abs().amax() == 448  # every block uses the whole e4m3 range: the block maximum maps to 448
    zero_q, zero_scale = quantize(torch.zeros(5, 5))
    assert torch.equal(zero_q.float(), torch.zeros(5, 5)) and torch.equal(zero_scale, torch.ones(1, 1))


# deepseek-ai/DeepSeek-V3's model.safetensors.index.json: the tensors of a dense layer (0-2) and a MoE layer (3-60)
# that have a weight_scale_inv, written out by hand (not by megarl's rule) for the tiny model's layer 0 and 1.
DEEPSEEK_V3_FP8_TENSORS = [
    f"model.layers.0.{part}"
    for part in (
        "self_attn.q_a_proj.weight",
        "self_attn.q_b_proj.weight",
        "self_attn.kv_a_proj_with_mqa.weight",
        "self_attn.kv_b_proj.weight",
        "self_attn.o_proj.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
    )
] + [
    f"model.layers.1.{part}"
    for part in (
        "self_attn.q_a_proj.weight",
        "self_attn.q_b_proj.weight",
        "self_attn.kv_a_proj_with_mqa.weight",
        "self_attn.kv_b_proj.weight",
        "self_attn.o_proj.weight",
        *(f"mlp.experts.{e}.{p}_proj.weight" for e in range(8) for p in ("gate", "up", "down")),
        "mlp.shared_experts.gate_proj.weight",
        "mlp.shared_experts.up_proj.weight",
        "mlp.shared_experts.down_proj.weight",
    )
]


@pytest.fixture(scope="module")
def fp8_deepseek(tmp_path_factory):
    return make_tiny_fp8_deepseek(tmp_path_factory.mktemp("fp8") / "tiny-deepseek-v3-fp8")


@pytest.fixture(scope="module")
def dequantized_reference(fp8_deepseek, tmp_path_factory):
    """The FP8 checkpoint dequantized by the reference above, as a bf16 HF folder without quantization_config."""
    raw = HFCheckpoint(fp8_deepseek, raw=True)
    out = tmp_path_factory.mktemp("fp8-reference") / "bf16"
    shutil.copytree(fp8_deepseek, out)
    tensors = {}
    for name in raw.names:
        if name.endswith("_scale_inv"):
            continue
        tensor = raw.get(name)
        if tensor.dtype == torch.float8_e4m3fn:
            tensor = reference_dequantize(tensor, raw.get(name + "_scale_inv"), (128, 128))
        tensors[name] = tensor
    save_file(tensors, out / SINGLE_FILE, metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    del config["quantization_config"]
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_the_rule_quantizes_exactly_what_deepseek_v3_quantizes(fp8_deepseek):
    raw = HFCheckpoint(fp8_deepseek, raw=True)
    layers_0_1 = [n for n in raw.names if n.startswith(("model.layers.0.", "model.layers.1."))]
    assert sorted(n for n in layers_0_1 if QUANTIZED_LINEAR.search(n)) == sorted(DEEPSEEK_V3_FP8_TENSORS)
    assert "model.layers.1.mlp.gate.weight" in layers_0_1 and raw.spec("lm_head.weight").dtype == torch.bfloat16


def test_reader_lists_weights_dequantized_and_hides_the_scales(fp8_deepseek, dequantized_reference):
    fp8, reference = HFCheckpoint(fp8_deepseek), HFCheckpoint(dequantized_reference)
    assert fp8.quantization == BlockFP8((128, 128)) and fp8.quantization.config == DEEPSEEK_QUANTIZATION
    assert sorted(fp8.names) == sorted(reference.names) and not any(n.endswith("_scale_inv") for n in fp8.names)
    for name in reference.names:
        assert fp8.spec(name) == reference.spec(name), name
        assert torch.equal(fp8.get(name), reference.get(name)), name
    assert len(fp8.quantized_names) == sum(bool(QUANTIZED_LINEAR.search(n)) for n in fp8.names) > 40


def test_convert_reads_fp8_and_exports_the_dequantized_weights(ranks1, fp8_deepseek, dequantized_reference, tmp_path):
    from test_convert import assert_same_checkpoint

    mcore, back = tmp_path / "mcore", tmp_path / "back"
    assert ranks1.run(main, ["convert", "--from", "hf", "--to", "mcore", str(fp8_deepseek), str(mcore)])[0] == 0
    info = json.loads((mcore / "megarl.json").read_text())
    assert info["quantization"] == DEEPSEEK_QUANTIZATION and info["params_dtype"] == "bfloat16"
    assert "quantization_config" not in json.loads((mcore / "hf" / "config.json").read_text())
    assert ranks1.run(main, ["convert", "--from", "mcore", "--to", "hf", str(mcore), str(back)])[0] == 0
    assert_same_checkpoint(dequantized_reference, back)  # bf16, bit-equal to the reference, no scales
    assert json.loads((back / "config.json").read_text()) == json.loads(
        (dequantized_reference / "config.json").read_text()
    )


def test_an_fp8_model_path_loads_with_the_reference_logits(ranks4, fp8_deepseek, dequantized_reference):
    ids = sample_ids(1000)
    logits = one_result(ranks4.run(megatron_logits, str(fp8_deepseek), P(ep=2), ids))
    assert (logits - hf_logits(dequantized_reference, ids)).abs().max().item() < 1e-4


@pytest.mark.parametrize(
    "quantization,message",
    [
        ({"quant_method": "awq", "bits": 4}, r"quant_method 'awq'; megarl reads only quant_method 'fp8' with"),
        ({"quant_method": "fp8", "activation_scheme": "static"}, r"quant_method 'fp8' without weight_block_size"),
        ({"quant_method": "compressed-tensors"}, r"has quant_method 'compressed-tensors'; megarl reads only"),
    ],
)
def test_unsupported_quantization_is_named_before_any_work(tmp_path, fp8_deepseek, quantization, message, capsys):
    src = tmp_path / "src"
    shutil.copytree(fp8_deepseek, src)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization
    (src / "config.json").write_text(json.dumps(config))
    assert main(["convert", "--from", "hf", "--to", "mcore", str(src), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"{src / 'config.json'}: quantization_config has" in err
    assert re.search(message, err) and not (tmp_path / "out").exists()


def test_fp8_rollout_buckets_have_the_checkpoints_names_shapes_and_dtypes(fp8_deepseek):
    """What an FP8 sync sends (the sender quantizes the bf16 weights) is laid out as the FP8 checkpoint itself."""
    raw, dequantized = HFCheckpoint(fp8_deepseek, raw=True), HFCheckpoint(fp8_deepseek)
    bucket = [(name, dequantized.get(name)) for name in dequantized.names]
    sent = quantize_bucket(bucket, dequantized.quantization)
    assert [(n, t.dtype, tuple(t.shape)) for n, t in sent] == [
        (s.name, s.dtype, s.shape) for s in (raw.spec(n) for n in _weights_then_scales(raw))
    ]
    # and it dequantizes back to the weights it was made from, within e4m3's rounding
    sent_by_name = dict(sent)
    for name in dequantized.quantized_names:
        weight, scale = sent_by_name[name], sent_by_name[name + "_scale_inv"]
        back = dequantize(weight, scale, (128, 128), torch.float32)
        original = dequantized.get(name).float()
        assert ((back - original).abs() <= original.abs() / 16 + scale.max() / 512).all(), name


def _weights_then_scales(raw: HFCheckpoint) -> list[str]:
    order = []
    for name in raw.names:
        if not name.endswith("_scale_inv"):
            order.append(name)
            if name + "_scale_inv" in raw:
                order.append(name + "_scale_inv")
    return order


def test_an_fp8_sync_from_an_expert_parallel_actor_sends_the_fp8_checkpoint(ranks4, fp8_deepseek):
    """The sending ranks of a bf16 actor (ep=2: each EP rank quantizes its own experts) send together exactly the
    tensors of the FP8 checkpoint the run started from, names, shapes and dtypes, in half the bytes of bf16."""
    from helpers import buckets_a_sync_sends

    raw = HFCheckpoint(fp8_deepseek, raw=True)
    quantization = HFCheckpoint(fp8_deepseek).quantization.config
    fp8_results = ranks4.run(buckets_a_sync_sends, str(fp8_deepseek), P(ep=2), quantization)
    sent = [item for buckets, _ in fp8_results for bucket in buckets for item in bucket]
    names = [name for name, _ in sent]
    assert sorted(names) == sorted(raw.names) and len(set(names)) == len(names)  # MTP layers aside: none here
    for name, tensor in sent:
        assert (tensor.dtype, tuple(tensor.shape)) == (raw.spec(name).dtype, raw.spec(name).shape), name
    for buckets, _ in fp8_results:  # a scale travels in its weight's bucket
        for bucket in buckets:
            in_bucket = {name for name, _ in bucket}
            assert all(n.removesuffix("_scale_inv") in in_bucket for n in in_bucket if n.endswith("_scale_inv"))
    bf16_results = ranks4.run(buckets_a_sync_sends, str(fp8_deepseek), P(ep=2), None)
    fp8_bytes = sum(stats["bytes"] for _, stats in fp8_results)
    bf16_bytes = sum(stats["bytes"] for _, stats in bf16_results)
    quantized = sum(raw.spec(n).nbytes for n in raw.names if raw.spec(n).dtype == torch.float8_e4m3fn)
    assert bf16_bytes - fp8_bytes == quantized - sum(raw.spec(n).nbytes for n in raw.names if n.endswith("_inv"))


def test_rollout_serves_the_format_the_run_started_from(ranks1, fp8_deepseek, hf_checkpoint, tmp_path):
    from megarl.rollout.config import RolloutConfig
    from megarl.rollout.weights_format import rollout_quantization

    mcore = tmp_path / "mcore"  # a megarl checkpoint converted from the FP8 one remembers its format
    ranks1.run(main, ["convert", "--from", "hf", "--to", "mcore", str(fp8_deepseek), str(mcore), "--no-progress"])
    sglang = RolloutConfig(backend="sglang", weights_format="auto")
    assert rollout_quantization(sglang, fp8_deepseek) == DEEPSEEK_QUANTIZATION
    assert rollout_quantization(sglang, mcore) == DEEPSEEK_QUANTIZATION
    assert rollout_quantization(sglang, hf_checkpoint("tiny-deepseek-v3")) is None
    assert rollout_quantization(RolloutConfig(backend="sglang", weights_format="bf16"), mcore) is None
    # fp8 asked of a bf16 start: DeepSeek's own 128 x 128 blocks
    fp8 = RolloutConfig(backend="sglang", weights_format="fp8")
    assert rollout_quantization(fp8, hf_checkpoint("tiny-deepseek-v3")) == DEEPSEEK_QUANTIZATION
    assert rollout_quantization(RolloutConfig(backend="hf"), mcore) is None  # the CPU engine computes in hf.dtype
    with pytest.raises(UserError, match=r"^rollout.weights_format=fp8 needs rollout.backend=sglang"):
        RolloutConfig(backend="hf", weights_format="fp8").check("rollout")


def test_an_fp8_rollout_launch_command_carries_the_quantization(fp8_deepseek, tmp_path):
    from megarl.rollout.config import RolloutConfig
    from megarl.rollout.sglang_launch import engine_launches

    rollout = RolloutConfig(backend="sglang", weights_format="auto")
    (launch,) = engine_launches(rollout, fp8_deepseek, num_engines=1, first_gpu=0, gpus_per_node=8)
    flag = launch.command.index("--json-model-override-args")
    assert json.loads(launch.command[flag + 1]) == {"quantization_config": DEEPSEEK_QUANTIZATION}
    rollout.weights_format = "bf16"
    (launch,) = engine_launches(rollout, fp8_deepseek, num_engines=1, first_gpu=0, gpus_per_node=8)
    assert "--json-model-override-args" not in launch.command


def test_the_hf_engine_serves_an_fp8_checkpoint_dequantized(fp8_deepseek, dequantized_reference):
    """CPU rollout from an FP8 model.path: the hf engine builds the model unquantized and reads the weights
    dequantized: the same model, bit for bit, as from the dequantized reference, and the same completions."""
    from megarl.rollout.config import HFEngineConfig, SamplingParams
    from megarl.rollout.engine import GenerateRequest
    from megarl.rollout.hf_engine import HFEngine

    sampling = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
    requests = [GenerateRequest([1, 5, 9, 12]), GenerateRequest([3, 3, 7])]
    engines = [HFEngine(folder, HFEngineConfig(dtype="bfloat16")) for folder in (fp8_deepseek, dequantized_reference)]
    states = [engine.model.state_dict() for engine in engines]
    assert states[0].keys() == states[1].keys()
    assert all(torch.equal(states[0][name], states[1][name]) for name in states[0])
    outputs = [[c[0].token_ids for c in engine.generate(requests, sampling)] for engine in engines]
    assert outputs[0] == outputs[1] and len(outputs[0][0]) == 6


@pytest.mark.slow  # about a minute: a real `megarl train` run
def test_a_grpo_run_trains_from_an_fp8_checkpoint(fp8_deepseek, tmp_path):
    """model.path an FP8 DeepSeek-V3-shaped checkpoint, as a user would give the official release: the run starts,
    trains a step (expert-parallel actor, CPU engine serving the dequantized weights) and saves a checkpoint that
    remembers the FP8 format and converts back to bf16."""
    from job_helpers import megarl_train, write_config

    config = write_config(tmp_path, "[grpo]", num_steps=1, tp=2)
    overrides = [f"model.path={fp8_deepseek}", "actor.model.parallel.tp=1", "actor.model.parallel.ep=2"]
    megarl_train(config, *overrides, "checkpoint.every=1", "rl.prompts_per_step=4", timeout=900)
    saved = tmp_path / "run" / "checkpoints" / "step_1" / "actor"
    info = json.loads((saved / "megarl.json").read_text())
    assert info["quantization"] == DEEPSEEK_QUANTIZATION and info["source"] == str(fp8_deepseek)
    assert "quantization_config" not in json.loads((saved / "hf" / "config.json").read_text())
