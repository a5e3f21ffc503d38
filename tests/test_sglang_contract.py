"""megarl against the real SGLang package (sglang==0.5.23, its CPU-importable parts; see tests/sglang_contract.py):
launch commands through SGLang's own argument parser, request bodies through its request types, buckets through its
flattened-bucket code, and exported tensor names through its model classes' own `load_weights`.

Skipped only where the pinned SGLang is not installed; the README's test command (and so CI) installs it.
"""

from __future__ import annotations

import base64
import contextlib
import io
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import sglang_contract
import torch

from megarl.rollout.config import SamplingParams, SGLangEngineConfig
from megarl.rollout.engine import GenerateRequest
from megarl.rollout.sglang_engine import build_generate_payload
from megarl.rollout.sglang_model import context_length_of
from megarl.rollout.sglang_server import NodePlace, build_server_args
from megarl.rollout.sglang_weights import flatten_bucket, unflatten

TESTS = Path(__file__).parent


def parse_server_args(args: list[str]):
    """SGLang's own parsing of a launch command's arguments (what `python -m sglang.launch_server` does first);
    returns (ServerArgs, what SGLang printed: deprecation notices and the like)."""
    server_args = sglang_contract.sglang_module("sglang.srt.server_args")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
        parsed = server_args.prepare_server_args(args)
    return parsed, printed.getvalue()


# ---- launch commands -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config",
    [
        SGLangEngineConfig(),
        SGLangEngineConfig(
            tp=8,
            dp=4,
            ep=8,
            enable_dp_attention=True,
            mem_fraction_static=0.55,
            dtype="bfloat16",
            trust_remote_code=True,
            random_seed=7,
            deterministic=True,
            enable_memory_saver=True,
            context_length=4096,
            extra_args={"chunked_prefill_size": "8192", "disable_radix_cache": ""},
        ),
    ],
    ids=["defaults", "everything"],
)
@pytest.mark.parametrize("nodes", [1, 2], ids=["one-node", "two-nodes"])
def test_sglang_parses_every_flag_megarl_sets(config, nodes):
    place = NodePlace(nodes, nodes - 1, "10.0.0.1:30100" if nodes > 1 else None)
    args = build_server_args(config, "/ckpt/hf", host="0.0.0.0", port=30001, load_format="dummy", node=place)
    parsed, printed = parse_server_args(args)
    assert "deprecated" not in printed.lower(), printed
    assert (parsed.model_path, parsed.host, parsed.port, parsed.load_format) == ("/ckpt/hf", "0.0.0.0", 30001, "dummy")
    assert (parsed.tp_size, parsed.nnodes, parsed.node_rank) == (config.tp, nodes, nodes - 1)
    assert parsed.dist_init_addr == place.dist_init_addr
    assert parsed.enable_memory_saver == config.enable_memory_saver
    assert parsed.context_length == config.context_length
    if config.enable_dp_attention:
        assert (parsed.ep_size, parsed.mem_fraction_static, parsed.dtype) == (8, 0.55, "bfloat16")
        assert parsed.chunked_prefill_size == 8192 and parsed.disable_radix_cache


def test_sglang_serves_fp8_from_the_launch_command_of_rollout_weights_format_fp8(hf_checkpoint):
    # the engine's folder describes bf16 weights (a megarl checkpoint's hf/config.json); the launch command gives
    # SGLang the quantization the synced weights arrive in, merged with the user's own config overrides
    from megarl.bridge.fp8 import DEEPSEEK_QUANTIZATION

    folder = str(hf_checkpoint("tiny-deepseek-v3"))
    config = SGLangEngineConfig(extra_args={"json_model_override_args": '{"max_position_embeddings": 512}'})
    args = build_server_args(config, folder, host="0.0.0.0", port=30001, quantization=DEEPSEEK_QUANTIZATION)
    parsed, printed = parse_server_args(args)
    assert "deprecated" not in printed.lower(), printed
    model_config = sglang_contract.sglang_module("sglang.srt.configs.model_config").ModelConfig.from_server_args(parsed)
    assert model_config.quantization == "fp8"
    assert model_config.hf_config.quantization_config == DEEPSEEK_QUANTIZATION
    assert model_config.hf_config.max_position_embeddings == 512


# ---- request bodies ------------------------------------------------------------------------------------------------


def test_generate_bodies_pass_sglangs_request_types():
    requests = [GenerateRequest([1, 2, 3], seed=5, request_id="a"), GenerateRequest([4] * 9, prefix_ids=[7],
                prefix_logprobs=[-0.5], prefix_versions=[0])]  # fmt: skip
    sampling = SamplingParams(n=2, temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=4, stop=["\n\n"],
                              stop_token_ids=[2])  # fmt: skip
    body, _ = build_generate_payload(requests, sampling, draw_seed=lambda: 3, context_len=12)
    request = sglang_contract.validate_request("/generate", body)
    assert request.batch_size == 4 and request.rid == ["a/0", "a/1", body["rid"][2], body["rid"][3]]
    assert request.return_logprob == [True] * 4


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        ("/pause_generation", {"mode": "abort", "flush": True}, "has no field"),
        ("/pause_generation", {"mode": "sideways"}, "Invalid enum value"),
        (
            "/init_weights_update_group",
            {"master_address": "a", "master_port": "x", "rank_offset": 1, "world_size": 2},
            "Expected `int`, got `str`",
        ),
        ("/generate", {"input_ids": [[1]], "sampling_params": [{"max_tokens": 3}], "rid": ["x"]}, "max_tokens"),
    ],
)
def test_sglangs_request_types_refuse_bodies_sglang_would_refuse(path, body, message):
    # the fake SGLang server of the engine tests validates through these same types: not a rubber stamp
    with pytest.raises(Exception, match=message):
        sglang_contract.validate_request(path, body)


# ---- flattened buckets ---------------------------------------------------------------------------------------------


def mixed_bucket():
    g = torch.Generator().manual_seed(0)
    return [
        ("a.bf16", torch.randn(5, 3, generator=g).to(torch.bfloat16)),  # odd byte count before wider tensors
        ("b.f32", torch.randn(4, 6, generator=g).t()),  # not contiguous
        ("c.u8", torch.tensor([1, 2, 3], dtype=torch.uint8)),
        ("d.i64", torch.tensor([7, -(2**40)])),
        ("e.f16", torch.randn(3, generator=g).to(torch.float16)),
        ("f.scalar", torch.tensor(2.5)),
    ]


def test_sglang_rebuilds_megarls_flattened_buckets_bit_exactly():
    tensor_bucket = sglang_contract.sglang_module("sglang.srt.weight_sync.tensor_bucket")
    bucket = mixed_bucket()
    part = flatten_bucket(bucket)
    # colocated: what update_weights_from_tensor decodes (FlattenedTensorMetadata built as sglang_serializer does)
    metadata = [
        tensor_bucket.FlattenedTensorMetadata(e.name, torch.Size(e.shape), e.dtype, e.start, e.end, e.nbytes)
        for e in part.entries
    ]
    rebuilt = dict(
        tensor_bucket.FlattenedTensorBucket(flattened_tensor=part.flat, metadata=metadata).reconstruct_tensors()
    )
    # split: what a broadcast receiver allocates from the request's names, dtypes and shapes, then fills
    receiver = tensor_bucket.FlattenedTensorBucket.empty(part.names, part.dtypes, part.shapes, "cpu")
    receiver.get_flattened_tensor().copy_(part.flat)
    received = dict(receiver.reconstruct_tensors())
    for name, tensor in bucket:
        for got in (rebuilt[name], received[name]):
            assert got.dtype == tensor.dtype and got.shape == tensor.shape, name
            assert torch.equal(got.reshape(-1).view(torch.uint8), tensor.contiguous().reshape(-1).view(torch.uint8))
    # and SGLang's own flattening of the same tensors in the same order gives the same bytes
    ours = dict(unflatten(part))
    theirs = tensor_bucket.FlattenedTensorBucket(named_tensors=[(n, ours[n]) for n in part.names])
    assert torch.equal(theirs.get_flattened_tensor(), part.flat)


def test_update_weights_from_tensor_body_carries_bytes_per_rank():
    body = {"serialized_named_tensors": [base64.b64encode(b"rank0").decode(), base64.b64encode(b"rank1").decode()],
            "load_format": "flattened_bucket", "flush_cache": False}  # fmt: skip
    request = sglang_contract.validate_request("/update_weights_from_tensor", body)
    assert request.serialized_named_tensors == [b"rank0", b"rank1"]


# ---- tensor names: SGLang's model classes load every tensor megarl exports ------------------------------------------

ARCHITECTURES = ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mixtral", "tiny-qwen3-moe-all-sparse",
                 "tiny-deepseek-v3", "tiny-deepseek-v3-lite", "tiny-glm4-moe", "tiny-kimi-k2",
                 "tiny-gpt-oss", "tiny-qwen3-next", "tiny-qwen3.5-moe"]  # fmt: skip


@pytest.fixture(scope="module")
def sglang_checkpoint(hf_checkpoint, tmp_path_factory):
    def make(name: str) -> Path:
        if name == "tiny-qwen3-moe-all-sparse":  # SGLang builds every Qwen3-MoE layer sparse (see test below)
            from megarl.testing.tiny_checkpoint import make_hf_checkpoint, tiny_config

            config = tiny_config("tiny-qwen3-moe") | {"mlp_only_layers": []}
            return make_hf_checkpoint(config, tmp_path_factory.mktemp("qwen3-moe") / name)
        return hf_checkpoint(name)

    return make


@pytest.fixture(scope="module")
def sglang_load_check(tmp_path_factory):
    """sglang_load_check(folder, *flags) -> the JSON of tests/sglang_load_check.py: every check of this module in one
    process that imports SGLang's model classes once and forks a child per check (`--serve`)."""
    if not sglang_contract.installed():
        pytest.skip(sglang_contract.INSTALL_HINT)
    folder = tmp_path_factory.mktemp("sglang-load-check")
    log = (folder / "server.log").open("w")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    server = subprocess.Popen(
        [sys.executable, str(TESTS / "sglang_load_check.py"), "--serve"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, env=env,
    )  # fmt: skip
    checks = itertools.count()

    def check(model_dir: Path, *extra: str) -> dict:
        out = folder / f"check-{next(checks)}.json"
        server.stdin.write(json.dumps({"argv": [str(model_dir), *extra], "out": str(out)}) + "\n")
        server.stdin.flush()
        answer = server.stdout.readline()
        tail = (folder / "server.log").read_text()[-3000:]
        assert answer and json.loads(answer)["rc"] == 0, f"the load check of {model_dir} {extra} failed:\n{tail}"
        return json.loads(out.read_text().strip().splitlines()[-1])

    try:
        yield check
    finally:
        server.stdin.close()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_sglang_model_class_loads_every_exported_tensor(sglang_checkpoint, sglang_load_check, name):
    # the export stream's names are exactly the HF checkpoint's (tests/test_bridge_parity.py); loaded in the buckets
    # megarl's weight sync forms (every tensor alone, fused groups together), every one must change a parameter of
    # SGLang's model and every parameter must be written
    result = sglang_load_check(sglang_checkpoint(name))
    assert result["params"] > 20
    assert result["no_effect"] == [] and result["unwritten"] == []


def test_deepseek_fused_projections_load_only_together(sglang_checkpoint, sglang_load_check):
    # the defect the travel groups fix, reproduced with SGLang's own DeepseekV2 loader: alone, neither lands
    result = sglang_load_check(sglang_checkpoint("tiny-deepseek-v3"), "--one-by-one")
    assert result["unwritten"] == [f"model.layers.{i}.self_attn.fused_qkv_a_proj_with_mqa.weight" for i in range(4)]
    assert len(result["no_effect"]) == 8 and all("_a_proj" in n for n in result["no_effect"])


def test_sglang_fp8_model_loads_every_tensor_of_megarls_fp8_buckets(sglang_checkpoint, sglang_load_check):
    # rollout.weights_format=fp8: SGLang's DeepseekV2 built with its own Fp8Config (block-wise, as DeepSeek-V3's
    # checkpoint declares) takes every FP8 weight and weight_scale_inv megarl's sender makes, fused groups included;
    # only the attention's KV-cache scales stay SGLang's own (DeepSeek-V3's checkpoint has none either)
    result = sglang_load_check(sglang_checkpoint("tiny-deepseek-v3"), "--fp8")
    assert result["no_effect"] == []
    kv_scales = [f"model.layers.{i}.self_attn.attn_{a}.{kv}_scale" for i in range(4) for a in ("mha", "mqa")
                 for kv in ("k", "v")]  # fmt: skip
    assert result["unwritten"] == sorted(kv_scales)
    assert len(result["fp8_params"]) == 30  # SGLang's fused FP8 projections and expert stacks of the 4 layers
    sent = result["sent_dtypes"]
    assert sent["model.layers.1.mlp.experts.7.down_proj.weight"] == "torch.float8_e4m3fn"
    assert sent["model.layers.1.mlp.experts.7.down_proj.weight_scale_inv"] == "torch.float32"
    assert sent["model.layers.1.mlp.gate.weight"] == sent["lm_head.weight"] == "torch.float32"  # as trained


def test_sglang_reads_the_folder_of_a_disk_sync(sglang_checkpoint, sglang_load_check, tmp_path):
    # rollout.weight_sync=disk: two sending ranks write their buckets (FP8 ones included) with megarl's writer;
    # SGLang's own loader, as update_weights_from_disk runs it on every node, yields every tensor, bit for bit
    import torch.distributed as dist

    from megarl.bridge.fp8 import DEEPSEEK_QUANTIZATION, BlockFP8, quantize_bucket
    from megarl.workers.weight_sync import SenderState, _write_bucket

    sent = {}
    for rank, bucket in enumerate([
        [("model.norm.weight", torch.randn(64)), ("lm_head.weight", torch.randn(10, 64, dtype=torch.bfloat16))],
        quantize_bucket([("model.layers.0.mlp.down_proj.weight", torch.randn(64, 200))], BlockFP8.from_config(
            DEEPSEEK_QUANTIZATION, "test")),
    ]):  # fmt: skip
        is_rank = mock.patch.object(dist, "get_rank", lambda rank=rank: rank)
        with mock.patch.object(dist, "is_initialized", lambda: True), is_rank:
            _write_bucket(bucket, str(tmp_path), SenderState())
        sent.update(bucket)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "rank00000-000000.safetensors",
        "rank00001-000000.safetensors",
    ]
    found = sglang_load_check(sglang_checkpoint("tiny-deepseek-v3"), "--read-folder", str(tmp_path))
    assert found == {name: [str(t.dtype), list(t.shape), t.double().sum().item()] for name, t in sent.items()}


def test_sglang_cannot_serve_qwen3_moe_dense_layers(sglang_checkpoint, sglang_load_check):
    # SGLang 0.5.23 ignores mlp_only_layers: such checkpoints are refused for rollout.backend=sglang at pre-flight
    result = sglang_load_check(sglang_checkpoint("tiny-qwen3-moe"))
    assert result["unwritten"] == [f"model.layers.1.mlp.{p}" for p in ("experts.w13_weight", "experts.w2_weight",
                                                                       "gate.weight")]  # fmt: skip


# ---- context window ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-deepseek-v3", "tiny-mixtral"])
def test_context_window_is_sglangs(hf_checkpoint, name):
    from transformers import AutoConfig

    common = sglang_contract.sglang_module("sglang.srt.utils.hf_transformers.common")
    folder = hf_checkpoint(name)
    assert context_length_of(folder) == common.get_context_length(AutoConfig.from_pretrained(folder))


# ---- what `megarl plan` says will be launched ------------------------------------------------------------------------

CONFIGS = sorted((TESTS.parent / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
@pytest.mark.parametrize("mode", ["as-shipped", "split"])
def test_sglang_parses_every_launch_command_megarl_plan_prints(path, mode):
    from megarl.plan import run_plan
    from megarl.plan_command import load_for_planning

    overrides = ["rollout.backend=sglang"]  # the CPU quickstart too: what it would launch on a GPU node
    if mode == "split":
        overrides += ["placement.mode=split", "placement.rollout_gpus=${rollout.gpus_per_engine}"]
    config, _ = load_for_planning(path, overrides)
    report = run_plan(config, str(path))
    assert len(report.launches) == report.placement.num_engines * report.placement.engine_nodes > 0
    rendered = report.render()
    for launch in report.launches:
        assert launch.render() in rendered
        assert launch.command[1:3] == ["-m", "sglang.launch_server"]
        parsed, printed = parse_server_args(launch.command[3:])
        assert "deprecated" not in printed.lower(), printed
        assert parsed.load_format == "dummy" and parsed.tp_size == config.rollout.sglang.tp
        assert parsed.nnodes == report.placement.engine_nodes and parsed.port == launch.port


# ---- verification checksums ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_checksums_are_sglangs_weight_checker_digests(dtype):
    from megarl.rollout.sglang_engine import sglang_checksum

    checker = sglang_contract.sglang_module("sglang.srt.utils.weight_checker")
    tensor = torch.randn(7, 5).to(dtype)
    assert sglang_checksum(tensor) == checker._hash_tensor(tensor)
    assert sglang_checksum(tensor.t()) == checker._hash_tensor(tensor.t().contiguous())  # a view hashes its values
    assert sglang_checksum(tensor) != sglang_checksum(tensor + 1)


# ---- routed experts (routing replay) -------------------------------------------------------------------------------


def test_sglang_records_routed_experts_from_the_launch_command_and_the_request():
    args = build_server_args(SGLangEngineConfig(), "/ckpt/hf", host="0.0.0.0", port=30001, return_routed_experts=True)
    parsed, _ = parse_server_args(args)
    assert parsed.enable_return_routed_experts is True
    parsed, _ = parse_server_args(build_server_args(SGLangEngineConfig(), "/ckpt/hf", host="0.0.0.0", port=30001))
    assert parsed.enable_return_routed_experts is False
    body, _ = build_generate_payload([GenerateRequest([1, 2, 3], seed=1)], SamplingParams(n=2, max_new_tokens=4))
    request = sglang_contract.validate_request("/generate", {**body, "return_routed_experts": True})
    assert request.return_routed_experts is True and request.routed_experts_start_len == 0


def test_routed_experts_decode_as_sglang_records_and_returns_them(hf_checkpoint):
    # SGLang keeps every token's top-k per decoder layer (dense layers never written: zeros) in a host buffer
    # indexed by KV slot, returns rows [0, seqlen - 1) of a finished request (BaseTopkCapturer.get_topk) and sends
    # them as base64 of the int32 bytes (DetokenizerManager._b64_encode_per_request; that module needs
    # setproctitle, absent here, so its one line is repeated below).
    from types import SimpleNamespace

    from megarl.models.hf_config import load_hf_config
    from megarl.models.registry import routing_layout
    from megarl.rollout.routing import routing_problem
    from megarl.rollout.sglang_engine import parse_completion

    base = sglang_contract.sglang_module("sglang.srt.state_capturer.base")
    routed_module = sglang_contract.sglang_module("sglang.srt.state_capturer.routed_experts")
    layout = routing_layout(load_hf_config(hf_checkpoint("tiny-deepseek-v3")))  # layer 0 dense
    prompt, output = [5, 6, 7, 8], [9, 10, 2]
    seqlen = len(prompt) + len(output)
    g = torch.Generator().manual_seed(0)
    buffer = torch.zeros(64, layout.num_layers, layout.topk, dtype=torch.int32)
    slots = torch.randperm(64, generator=g)[:seqlen]  # the request's KV slots, anywhere in the pool
    for layer in layout.moe_layers:
        buffer[slots, layer] = torch.rand(seqlen, layout.num_experts, generator=g).topk(layout.topk).indices.int()
    capturer = object.__new__(base.BaseTopkCapturer)
    capturer.host_cache = SimpleNamespace(buffer=buffer)
    pool = SimpleNamespace(req_to_token=torch.cat([slots, torch.zeros(64 - seqlen, dtype=torch.long)])[None])
    rows = capturer.get_topk(req_pool_idx=0, seqlen=seqlen, req_to_token_pool=pool)
    encoded = base64.b64encode(rows.numpy().tobytes()).decode("utf-8")
    meta = {"id": "r/0", "finish_reason": {"type": "stop"}, "routed_experts": encoded,
            "output_token_logprobs": [[-0.5, t, None] for t in output]}  # fmt: skip
    assert routed_module.extract_routed_experts_from_meta_info({"meta_info": meta}).tolist() == rows.flatten().tolist()

    completion = parse_completion({"output_ids": output, "meta_info": meta}, GenerateRequest(prompt), 0, layout)
    want = rows[:, list(layout.moe_layers)].sort(dim=-1).values
    assert torch.equal(completion.routed_experts.long(), want.long())
    assert completion.routed_experts.dtype == torch.uint8
    assert routing_problem(completion.routed_experts, seqlen, layout) is None
