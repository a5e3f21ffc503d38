"""The planner's numbers: memory and KV-cache figures against values worked out by hand here, and the verdicts on
the shipped 671B config. (Parameter counts against Megatron's own models: tests/test_plan_counts.py.)"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from megarl.plan.activations import ActivationLayout, layer_elements_per_token, train_activation_bytes
from megarl.plan.memory import GB, RoleLayout, role_memory
from megarl.plan.model_size import count_parameters, hf_config_from_dict, hf_numel, model_shape, stage_params
from megarl.plan.rollout import engine_memory
from megarl.rollout.config import SGLangEngineConfig
from megarl.runtime.parallel import ParallelConfig
from megarl.workers.config import MicroBatchSettings, ModelSettings, OptimizerSettings

REPO = Path(__file__).resolve().parents[1]
DEEPSEEK_CONFIG = REPO / "configs" / "grpo_deepseek_v3_671b.yaml"


def shape_of(name: str, spec_backend: str = "te"):
    raw = json.loads((REPO / "configs" / "models" / f"{name}.json").read_text())
    return model_shape(hf_config_from_dict(raw), spec_backend)


def test_public_model_sizes():
    """The shipped configs describe the published models: 671 B (plus a 13.5 B MTP layer), 7.6 B, 8.0 B, ..."""
    deepseek = shape_of("deepseek-v3-671b")
    assert round(count_parameters(deepseek) / 1e9, 1) == 671.0
    assert round((count_parameters(deepseek) + deepseek.hf_extra_numel) / 1e9) == 684  # the HF repo's "685B"
    assert round(count_parameters(shape_of("qwen2.5-7b")) / 1e9, 2) == 7.62
    assert round(count_parameters(shape_of("llama-3-8b")) / 1e9, 2) == 8.03
    # GLM-4.5-Air "106B" and GLM-4.5 "355B" (their HF repos, MTP layer included: 110B and 358B); Kimi K2 "1T"
    for name, size, with_mtp in [("glm-4.5-air", 106.9, 110), ("glm-4.5", 352.8, 358), ("kimi-k2", 1026.4, 1026)]:
        shape = shape_of(name)
        assert round(count_parameters(shape) / 1e9, 1) == size, name
        assert round((count_parameters(shape) + shape.hf_extra_numel) / 1e9) == with_mtp, name


# -- memory figures worked out by hand ------------------------------------------------------------------------------

# tiny-llama: vocab 1000 (padded to 1024 at tp 1 and 2), h=64, f=128, 4 layers, 4 heads, 2 KV heads, head 16.
# One layer at tp=2: norms 64 + 64 (whole), qkv (4 + 2 x 2) x 16 x 64 / 2 = 4096, proj 64 x 64 / 2 = 2048,
# fc1 2 x 128 x 64 / 2 = 8192, fc2 64 x 128 / 2 = 4096 -> 18560. Four layers 74240, embedding and output layer
# 1024 / 2 x 64 = 32768 each, final norm 64: 139840 parameters per rank.
TINY_LLAMA_TP2 = 139840


def tiny_llama_memory(distributed: bool, dtype: str = "bfloat16", offload: bool = False):
    shape = shape_of("tiny-llama")
    layout = RoleLayout(tp=2, pp=1, vpp=1, ep=1, etp=2, cp=1, sequence_parallel=False, world=8)
    settings = ModelSettings(dtype=dtype, parallel=ParallelConfig(tp=2))
    optim = OptimizerSettings(use_distributed_optimizer=distributed, offload_optimizer=offload)
    return role_memory("actor", shape, layout, settings, MicroBatchSettings(max_tokens=64), optim, longest_sample=32)


def test_rank_params_by_hand():
    assert stage_params(shape_of("tiny-llama"), tp=2).total == TINY_LLAMA_TP2
    # whole model: 4 x 36992 per layer + 2 x 65536 + 64
    assert count_parameters(shape_of("tiny-llama")) == 279104


def test_states_by_hand():
    m = tiny_llama_memory(distributed=False)
    assert m.param_bytes == 2 * TINY_LLAMA_TP2  # bf16
    assert m.grad_bytes == 4 * TINY_LLAMA_TP2  # fp32 main_grad buffers
    assert m.optimizer_bytes == 12 * TINY_LLAMA_TP2  # fp32 master + m + v, whole on every rank
    sharded = tiny_llama_memory(distributed=True)
    assert sharded.layout.dp == 4
    assert sharded.optimizer_bytes == 12 * TINY_LLAMA_TP2 / 4  # sharded over dp x cp = 8 / 2
    fp32 = tiny_llama_memory(distributed=True, dtype="float32")
    assert fp32.param_bytes == 4 * TINY_LLAMA_TP2 and fp32.optimizer_bytes == 8 * TINY_LLAMA_TP2 / 4  # no master
    offloaded = tiny_llama_memory(distributed=True, offload=True)
    assert offloaded.optimizer_bytes == 0
    assert offloaded.optimizer_host_bytes == 16 * TINY_LLAMA_TP2 / 4


def test_expert_states_shard_over_expert_data_parallel_ranks():
    """Dense Adam states shard over world / (tp pp), expert states over world / (ep etp pp)."""
    shape = shape_of("tiny-mixtral")  # 8 experts of 3 x 96 x 64 = 18432 parameters, 4 layers
    layout = RoleLayout(tp=2, pp=1, vpp=1, ep=4, etp=1, cp=1, sequence_parallel=True, world=16)
    settings = ModelSettings(dtype="bfloat16", parallel=ParallelConfig(tp=2, ep=4, etp=1, sequence_parallel=True))
    m = role_memory("actor", shape, layout, settings, MicroBatchSettings(), OptimizerSettings(), longest_sample=32)
    assert m.params.expert == 4 * (8 // 4) * 18432
    assert layout.expert_dp == 4 and layout.dp == 8
    assert m.optimizer_bytes == 12 * (m.params.dense / 8 + m.params.expert / 4)


def test_activations_by_hand():
    shape = shape_of("tiny-llama")
    lay = ActivationLayout(tp=1, pp=1, vpp=1, etp=1, cp=1, sequence_parallel=False, recompute=False)
    # attention 2h + (2a + 2g) d = 128 + 12 x 16 = 320; MLP 2h + 3f = 128 + 384 = 512
    assert layer_elements_per_token(shape, 0, lay) == 832
    logits = 100 * 1024 * 16  # tokens x padded vocab x 16 bytes
    assert train_activation_bytes(shape, lay, 100, 0, 1024, lm_head=True) == 4 * 832 * 100 * 2 + logits
    recompute = ActivationLayout(tp=1, pp=1, vpp=1, etp=1, cp=1, sequence_parallel=False, recompute=True)
    # kept: each layer's input (h per token); rebuilt: two full layers
    expected = 4 * 64 * 100 * 2 + 2 * 832 * 100 * 2 + logits
    assert train_activation_bytes(shape, recompute, 100, 0, 1024, lm_head=True) == expected
    # 1F1B: stage 0 of 2 holds 2 micro-batches of its 2 layers, the last stage 1 (plus the logits)
    pp2 = ActivationLayout(tp=1, pp=2, vpp=1, etp=1, cp=1, sequence_parallel=False, recompute=False)
    assert train_activation_bytes(shape, pp2, 100, 0, 1024, lm_head=True) == 2 * 2 * 832 * 100 * 2
    assert train_activation_bytes(shape, pp2, 100, 1, 1024, lm_head=True) == 2 * 832 * 100 * 2 + logits


def test_kv_cache_per_token_gqa():
    """Llama-3-8B: 2 (K, V) x 32 layers x 8 KV heads x 128 x 2 bytes = 128 KiB per token, split over TP until
    each GPU holds one KV head."""
    shape = shape_of("llama-3-8b")
    assert engine_memory(shape, SGLangEngineConfig(tp=1), 80 * GB).kv_bytes_per_token == 2 * 32 * 8 * 128 * 2
    assert engine_memory(shape, SGLangEngineConfig(tp=2), 80 * GB).kv_bytes_per_token == 2 * 32 * 4 * 128 * 2
    assert engine_memory(shape, SGLangEngineConfig(tp=16), 80 * GB).kv_bytes_per_token == 2 * 32 * 1 * 128 * 2
    fp8 = SGLangEngineConfig(tp=1, extra_args={"kv_cache_dtype": "fp8_e4m3"})
    assert engine_memory(shape, fp8, 80 * GB).kv_bytes_per_token == 2 * 32 * 8 * 128


def test_kv_cache_per_token_hybrid_counts_the_full_attention_layers_only():
    """Qwen3-Next-80B-A3B: every 4th of 48 layers is full attention (2 KV heads of 256): 2 x 12 x 2 x 256 x 2
    bytes per token at tp 1, one KV head per GPU from tp 2 on; its 36 Gated DeltaNet layers keep no KV cache."""
    shape = shape_of("qwen3-next-80b-a3b")
    assert shape.kv_layers == 12
    assert engine_memory(shape, SGLangEngineConfig(tp=1), 80 * GB).kv_bytes_per_token == 2 * 12 * 2 * 256 * 2
    assert engine_memory(shape, SGLangEngineConfig(tp=8, ep=8), 80 * GB).kv_bytes_per_token == 2 * 12 * 1 * 256 * 2
    assert "36 of 48 layers are Gated DeltaNet" in shape.notes[-1]


def test_kv_cache_per_token_mla():
    """DeepSeek-V3: 61 layers x (kv_lora_rank 512 + rope 64) x 2 bytes = 70272 bytes per token, on every GPU of an
    attention group; DP attention multiplies the engine's distinct tokens."""
    shape = shape_of("deepseek-v3-671b")
    tp32 = SGLangEngineConfig(tp=32, ep=32)
    dp8 = SGLangEngineConfig(tp=32, ep=32, dp=8, enable_dp_attention=True, mem_fraction_static=0.75)
    for config in (tp32, dp8):
        assert engine_memory(shape, config, 80 * GB).kv_bytes_per_token == 61 * (512 + 64) * 2
    engine = engine_memory(shape, dp8, 80 * GB)
    assert engine.token_capacity == int((0.75 * 80 * GB - engine.weight_bytes) // 70272) * 8


def test_engine_weights_dense_tp():
    """Qwen2.5-7B on an engine of tp=2, per GPU: 28 query heads and 4 KV heads split in two, MLP and vocabulary
    rows split, norms whole."""
    h, f, vocab, head = 3584, 18944, 152064, 128
    per_layer = (
        2 * h  # input and post-attention norms
        + (14 + 2 * 2) * head * h  # q, k, v rows of this GPU's heads
        + (14 + 2 * 2) * head  # their biases
        + h * h // 2  # o_proj
        + 2 * f * h // 2  # gate and up
        + h * f // 2  # down
    )
    per_gpu = 28 * per_layer + 2 * vocab * h // 2 + h
    engine = engine_memory(shape_of("qwen2.5-7b"), SGLangEngineConfig(tp=2), 80 * GB)
    assert engine.weight_bytes == per_gpu * 2


# -- the shipped 671B configuration ----------------------------------------------------------------------------------


def test_shipped_671b_config_fits(capsys):
    from megarl.plan_command import plan_command

    assert plan_command(DEEPSEEK_CONFIG) == 0
    out = capsys.readouterr().out
    assert "fits: every role within plan.gpu_memory_gb" in out
    assert "tp 2 | pp 16 (first 2, last 3 layers) | vpp 1 | ep 8 | etp 1" in out and "4 engine(s) x 32 GPUs" in out


def test_671b_on_half_the_nodes_without_offload_does_not_fit(capsys):
    from megarl.plan_command import plan_command

    overrides = [
        "cluster.num_nodes=8",
        "placement.train_gpus=64",
        "actor.model.parallel.pp=8",  # 61 = 3 + 6 x 9 + 4
        "actor.model.parallel.pp_first_stage_layers=3",
        "actor.model.parallel.pp_last_stage_layers=4",
        "actor.optim.offload_optimizer=false",
    ]
    assert plan_command(DEEPSEEK_CONFIG, overrides) == 1
    out = capsys.readouterr().out
    problem = next(line for line in out.splitlines() if line.startswith("  - actor: peak"))
    assert "exceeds plan.gpu_memory_gb=80.0 by" in problem and "largest: optimizer states" in problem
    assert "DOES NOT FIT (short by" in out


def test_run_plan_reports_per_role():
    from megarl.plan import run_plan
    from megarl.plan_command import load_for_planning

    config, _ = load_for_planning(DEEPSEEK_CONFIG)
    report = run_plan(config)
    assert [role.name for role in report.roles] == ["actor", "rollout"]
    assert report.fits and all(role.fits for role in report.roles)
    assert report.sync is not None and report.sync.num_senders == 128
    dense, expert = hf_numel(shape_of("deepseek-v3-671b"))
    assert report.sync.total_bytes == dense * 2 + expert  # FP8 rollout: the experts at one byte per weight


def test_colocated_roles_take_turns(tmp_path, monkeypatch):
    """GRPO with a KL loss on Qwen2.5-7B, colocated: in the actor's turn the frozen ref keeps its weights on the GPU
    (frozen roles are not offloaded), as do three worker processes (actor, ref, engine) and the released engine; in
    the engine's turn the actor is offloaded: only the ref weights and the processes stay."""
    from megarl.plan import run_plan
    from megarl.plan.planner import PROCESS_GB, RELEASED_ENGINE_GB
    from megarl.plan_command import load_for_planning

    config, _ = load_for_planning(REPO / "configs" / "grpo_qwen2.5_7b_gsm8k.yaml")
    report = run_plan(config)
    ref_weights = 2 * stage_params(shape_of("qwen2.5-7b"), tp=2).total
    actor = dict(report.role("actor").lines)
    (resident,) = [value for label, value in actor.items() if label.startswith("resident")]
    assert resident == 3 * PROCESS_GB * GB + RELEASED_ENGINE_GB * GB + ref_weights
    rollout = report.role("rollout")
    (resident,) = [value for label, value in rollout.lines if label.startswith("resident")]
    assert resident == 3 * PROCESS_GB * GB + ref_weights
    engine = rollout.detail
    assert rollout.peak_bytes == engine.static_bytes + resident + 4.0 * GB  # static pool + SGLang's runtime
    assert engine.static_bytes == 0.6 * 80 * GB


# -- a job larger than its cluster -------------------------------------------------------------------------------------

QUICKSTART = REPO / "configs" / "quickstart.yaml"
LARGER_THAN_ONE_NODE = ["cluster.num_nodes=1", "cluster.gpus_per_node=8", "placement.train_gpus=16"]
NEEDS_16_HAS_8 = (
    "placement: the job needs 16 GPUs (train_gpus=16); the cluster has 8 (cluster.num_nodes=1 x 8 GPUs per node)"
)


def test_a_job_needing_more_gpus_than_the_cluster_does_not_fit(capsys):
    """16 GPUs on 1 node x 8: `megarl plan` (and --dry-run) exit 1, also for a job whose GPU memory is not planned
    (the CPU quickstart's hf engine); the same job on 8 GPUs fits."""
    from megarl.cli import main

    assert main(["plan", "--config", str(QUICKSTART), *LARGER_THAN_ONE_NODE]) == 1
    assert f"DOES NOT FIT\n  - {NEEDS_16_HAS_8}" in capsys.readouterr().out
    assert main(["train", "--dry-run", "--config", str(QUICKSTART), *LARGER_THAN_ONE_NODE]) == 1
    assert main(["plan", "--config", str(QUICKSTART), "cluster.gpus_per_node=8", "placement.train_gpus=8"]) == 0


def test_train_refuses_a_job_needing_more_gpus_than_the_cluster():
    """Train's pre-flight refuses it before Ray starts (on a CPU machine too: the placement is not a memory verdict)."""
    from megarl.config import load_config
    from megarl.errors import UserError
    from megarl.job import JobConfig
    from megarl.trainer.lifecycle.preflight import preflight

    config = load_config(JobConfig, QUICKSTART, LARGER_THAN_ONE_NODE)
    with pytest.raises(UserError, match=re.escape(f"does not fit the cluster:\n  {NEEDS_16_HAS_8}")):
        preflight(config, off_machine=True)
    preflight(load_config(JobConfig, QUICKSTART, ["cluster.gpus_per_node=8"]), off_machine=True)
