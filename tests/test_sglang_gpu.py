"""GPU tier of the sglang backend: a real SGLang server with a tiny model.

Skipped unless CUDA and sglang are importable (SGLang's full install is CUDA-only; the CPU tiers in
test_sglang_server.py, test_sglang_engine.py and test_sglang_weights.py cover everything up to SGLang's boundary).
Checks what only a real server can: the command line starts it, generated log-probs follow megarl's convention
(log_softmax(logits / T) before top-k / top-p) against the HF model, weights load through update_weights_from_tensor
(CUDA IPC) and update_weights_from_distributed, and per-request seeds reproduce completions in deterministic mode.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from megarl.rollout.config import SamplingParams, SGLangEngineConfig
from megarl.rollout.engine import GenerateRequest

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(
        importlib.util.find_spec("sgl_kernel") is None,  # the contract tests' `--no-deps` install cannot serve
        reason="needs a full SGLang install (pip install -e '.[sglang]')",
    ),
]

PROMPTS = [[5, 17, 42, 9, 100], [300, 2, 77]]


def server_config(**kwargs) -> SGLangEngineConfig:
    # tiny-llama has head_dim 16: triton attention handles it; no CUDA graphs to keep start-up short
    extra = {"attention_backend": "triton", "cuda_graph_backend_decode": "disabled", "log_level": "warning"}
    return SGLangEngineConfig(dtype="bfloat16", mem_fraction_static=0.2, extra_args=extra, **kwargs)


@pytest.fixture(scope="module")
def checkpoints(hf_checkpoint, tmp_path_factory):
    from megarl.testing.tiny_checkpoint import make_hf_checkpoint

    first = hf_checkpoint("tiny-llama", dtype=torch.bfloat16)
    second = make_hf_checkpoint("tiny-llama", tmp_path_factory.mktemp("second"), dtype=torch.bfloat16, seed=1)
    return first, second


@pytest.fixture(scope="module")
def engine(checkpoints, tmp_path_factory):
    from megarl.rollout.sglang_engine import SGLangEngine

    engine = SGLangEngine(checkpoints[0], server_config(), log_path=tmp_path_factory.mktemp("log") / "sglang.log")
    yield engine
    engine.shutdown()


def hf_state(folder) -> list[tuple[str, torch.Tensor]]:
    from safetensors.torch import load_file

    return sorted(load_file(str(folder / "model.safetensors")).items())


def reference_logprobs(folder, prompt: list[int], tokens: list[int], temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) of the HF model at each generated token (fp32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).cuda().eval()
    ids = torch.tensor([prompt + tokens], device="cuda")
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    return logprobs.gather(-1, torch.tensor(tokens, device="cuda")[:, None])[:, 0].cpu()


def check_logprobs(folder, engine, temperature: float = 0.7) -> None:
    sampling = SamplingParams(temperature=temperature, top_k=5, top_p=0.9, max_new_tokens=8, ignore_eos=True)
    results = engine.generate([GenerateRequest(p) for p in PROMPTS], sampling)
    for prompt, (completion,) in zip(PROMPTS, results):
        assert len(completion.token_ids) == 8 and completion.finish_reason == "length"
        got = torch.tensor(completion.logprobs)
        want = reference_logprobs(folder, prompt, completion.token_ids, temperature)
        unscaled = reference_logprobs(folder, prompt, completion.token_ids, 1.0)
        assert (got - want).abs().max() < 0.1, (got, want)  # a bf16 server against an fp32 reference
        assert (got - want).abs().mean() < (got - unscaled).abs().mean()  # temperature-scaled, not raw


def test_generate_with_logprobs_in_megarl_convention(checkpoints, engine):
    assert engine.health()["ok"]
    check_logprobs(checkpoints[0], engine)


def test_update_weights_from_tensor(checkpoints, engine):
    engine.update_weights([hf_state(checkpoints[1])], version=1)
    check_logprobs(checkpoints[1], engine)
    (completion,) = engine.generate([GenerateRequest(PROMPTS[0])], SamplingParams(max_new_tokens=2))[0]
    assert completion.weight_version == 1 and completion.token_versions == [1, 1]
    # the sync check: SGLang's own checksums of the norm weights equal those of the tensors sent
    norms = [(name, t) for name, t in hf_state(checkpoints[1]) if "norm" in name]
    assert engine.verify_weights(norms) == []
    assert len(engine.verify_weights([(norms[0][0], norms[0][1] + 1)])) == 1


def test_a_server_started_on_dummy_weights_serves_after_the_first_sync(checkpoints, tmp_path):
    import shutil

    from megarl.rollout.sglang_engine import SGLangEngine

    config_only = tmp_path / "hf"  # as a megarl checkpoint's hf/ folder: config and tokenizer, no weights
    shutil.copytree(checkpoints[1], config_only, ignore=shutil.ignore_patterns("*.safetensors"))
    engine = SGLangEngine(config_only, server_config(), log_path=tmp_path / "s.log")
    try:
        assert engine.load_format == "dummy"
        with pytest.raises(Exception, match="refuses to generate"):
            engine.generate([GenerateRequest(PROMPTS[0])], SamplingParams(max_new_tokens=2))
        engine.update_weights([hf_state(checkpoints[1])], version=1)
        check_logprobs(checkpoints[1], engine)
    finally:
        engine.shutdown()


def test_update_weights_from_distributed(checkpoints, engine):
    from megarl.rollout.sglang_weights import SGLangWeightSender

    # one GPU cannot hold two NCCL ranks: gloo carries the broadcast here (nccl across GPUs in production)
    sender = SGLangWeightSender([engine.endpoint], master_address="127.0.0.1", backend="gloo", device="cpu")
    with sender:
        engine.begin_weight_update(2)
        state = hf_state(checkpoints[0])
        sender.send([state[: len(state) // 2], state[len(state) // 2 :]])
        engine.finish_weight_update(2)
    check_logprobs(checkpoints[0], engine)
    assert engine.weight_version == 2


def test_release_and_resume_memory(checkpoints, tmp_path):
    from megarl.rollout.sglang_engine import SGLangEngine

    engine = SGLangEngine(checkpoints[0], server_config(enable_memory_saver=True), log_path=tmp_path / "s.log")
    try:
        engine.release_memory()
        engine.resume_memory()
        check_logprobs(checkpoints[0], engine)
    finally:
        engine.shutdown()


@pytest.mark.slow
def test_seeds_reproduce_completions_in_deterministic_mode(checkpoints, tmp_path):
    from megarl.rollout.sglang_engine import SGLangEngine

    engine = SGLangEngine(checkpoints[0], server_config(deterministic=True), log_path=tmp_path / "s.log")
    try:
        sampling = SamplingParams(n=4, temperature=1.0, max_new_tokens=12, ignore_eos=True)
        first = engine.generate([GenerateRequest(PROMPTS[0], seed=3)], sampling)[0]
        again = engine.generate([GenerateRequest(PROMPTS[1]), GenerateRequest(PROMPTS[0], seed=3)], sampling)[1]
        assert [c.token_ids for c in first] == [c.token_ids for c in again]
        assert len({tuple(c.token_ids) for c in first}) > 1  # each sample its own seed
    finally:
        engine.shutdown()


def test_update_weights_from_disk(checkpoints, engine, tmp_path):
    """The road of engines across nodes (rollout.weight_sync=disk): the senders' files, read by every rank."""
    from unittest import mock

    import torch.distributed as dist

    from megarl.workers.weight_sync import SenderState, _write_bucket

    state = hf_state(checkpoints[1])
    for rank, bucket in enumerate([state[: len(state) // 2], state[len(state) // 2 :]]):  # two sending ranks
        with (
            mock.patch.object(dist, "is_initialized", lambda: True),
            mock.patch.object(dist, "get_rank", lambda rank=rank: rank),
        ):
            _write_bucket(bucket, str(tmp_path), SenderState())
    engine.begin_weight_update(3)
    assert engine.load_weights_from_disk(str(tmp_path))[0] == len(state)
    engine.finish_weight_update(3)
    check_logprobs(checkpoints[1], engine)


def test_fp8_rollout_serves_the_quantized_weights(tmp_path):
    """rollout.weights_format=fp8: a server told the quantization_config (DeepSeek's 128 x 128 blocks) takes the
    FP8 buckets megarl's senders make and generates with the log-probs of the dequantized model."""
    import shutil

    from megarl.bridge.fp8 import DEEPSEEK_QUANTIZATION, BlockFP8, dequantize, quantize_bucket
    from megarl.rollout.sglang_engine import SGLangEngine
    from megarl.testing.tiny_checkpoint import make_hf_checkpoint, tiny_config

    # widths multiples of 128, as SGLang's block-FP8 layers need
    config = dict(tiny_config("tiny-llama"), hidden_size=256, intermediate_size=512, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64)  # fmt: skip
    folder = make_hf_checkpoint(config, tmp_path / "bf16", dtype=torch.bfloat16)
    fp8 = BlockFP8.from_config(DEEPSEEK_QUANTIZATION, "test")
    sent = quantize_bucket(hf_state(folder), fp8)
    reference = tmp_path / "dequantized"  # what the FP8 weights stand for, as a bf16 HF folder
    shutil.copytree(folder, reference)
    from safetensors.torch import save_file

    by_name = dict(sent)
    save_file({name: dequantize(t, by_name[name + "_scale_inv"], fp8.block, torch.bfloat16) if name + "_scale_inv"
               in by_name else t for name, t in sent if not name.endswith("_scale_inv")},
              str(reference / "model.safetensors"))  # fmt: skip
    config_only = tmp_path / "hf"
    shutil.copytree(folder, config_only, ignore=shutil.ignore_patterns("*.safetensors"))
    engine = SGLangEngine(config_only, server_config(), log_path=tmp_path / "s.log", quantization=fp8.config)
    try:
        engine.update_weights([sent], version=1)
        sampling = SamplingParams(temperature=0.7, max_new_tokens=8, ignore_eos=True)
        for prompt, (completion,) in zip(PROMPTS, engine.generate([GenerateRequest(p) for p in PROMPTS], sampling)):
            want = reference_logprobs(reference, prompt, completion.token_ids, 0.7)
            # FP8 activations (dynamic per-token-group scales) on top of a bf16 server: looser than check_logprobs
            assert (torch.tensor(completion.logprobs) - want).abs().mean() < 0.2
    finally:
        engine.shutdown()


def test_routed_experts_are_the_hf_models_routing(hf_checkpoint, tmp_path):
    """R3's SGLang side: a MoE server started with --enable-return-routed-experts returns, for every token of
    prompt + completion but the last, the experts the HF model (bf16) routes it to; near-ties may flip in bf16."""
    from helpers import hf_routing

    from megarl.models.hf_config import load_hf_config
    from megarl.models.registry import routing_layout
    from megarl.rollout.sglang_engine import SGLangEngine

    folder = hf_checkpoint("tiny-mixtral", dtype=torch.bfloat16)  # every layer MoE, as SGLang builds it
    layout = routing_layout(load_hf_config(folder))
    engine = SGLangEngine(folder, server_config(), log_path=tmp_path / "s.log", record_routing=True)
    try:
        sampling = SamplingParams(temperature=0.7, max_new_tokens=8, ignore_eos=True)
        agree = total = 0
        for prompt, (completion,) in zip(PROMPTS, engine.generate([GenerateRequest(p) for p in PROMPTS], sampling)):
            ids = torch.tensor([prompt + completion.token_ids])
            assert completion.routed_experts.shape == (ids.shape[1] - 1, len(layout.moe_layers), layout.topk)
            expected = hf_routing(folder, ids)
            for index, layer in enumerate(layout.moe_layers):
                got = torch.zeros_like(expected[layer][:-1]).scatter_(1, completion.routed_experts[:, index].long(), 1)
                agree += (got == expected[layer][:-1]).all(dim=1).sum().item()
                total += got.shape[0]
        assert agree / total > 0.9
    finally:
        engine.shutdown()
