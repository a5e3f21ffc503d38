"""GPU tier, on real CUDA (mark `gpu`; skipped without a GPU). `bash tools/gpu/run.sh` runs them on a lent GPU.

One GPU: a single rank per role (NCCL between ranks needs two GPUs; layouts > 1 are checked on CPU with gloo).
- Megatron vs transformers logits and log-probs in bf16 for the six architectures;
- one GRPO and one PPO step of a quickstart-size colocated run through Ray, the hf engine on CUDA, with the
  per-phase memory showing the handover; the non-finite guard in bf16;
- a CUDA IPC weight sync into the colocated hf engine leaves it holding exactly the trained weights.
The GPU kit (tools/gpu/kit.py STEPS) runs them by node id, most value per second first: tiny-qwen3's parity and the
GRPO step, then the guard and the IPC sync, then the other architectures, then PPO; a test added here needs a step
there (tests/test_gpu_kit.py checks that every test of this file has one).
"""

from __future__ import annotations

import pytest
import torch
from helpers import one_result, sample_ids
from job_helpers import megarl_train, metrics, write_config
from test_weight_sync import engine_tensors

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

ARCHITECTURES = [
    *("tiny-qwen3", "tiny-llama", "tiny-qwen2", "tiny-mixtral", "tiny-qwen3-moe", "tiny-deepseek-v3"),
    *("tiny-glm4-moe", "tiny-gpt-oss", "tiny-qwen3-next", "tiny-qwen3.5-moe"),  # the kit's `extras` step (not in
    # its default run)
]


def gpu_logits(path: str, input_ids: torch.Tensor, dtype: torch.dtype):
    from megarl.checkpoint.model_io import load_model
    from megarl.models.pipeline import forward_logits
    from megarl.runtime import cpu_compat
    from megarl.runtime.device import local_device, to_host
    from megarl.runtime.distributed import init_model_parallel
    from megarl.runtime.parallel import ParallelConfig

    assert not cpu_compat.is_active()
    parallel = ParallelConfig()
    init_model_parallel(parallel)
    model = load_model(path, parallel, dtype)
    for chunk in model.chunks:
        chunk.cuda()
    with torch.no_grad():
        logits = forward_logits(model.chunks, input_ids.to(local_device()), model.vocab.size)
    return to_host(logits.float())


def hf_gpu_logits(folder, input_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).cuda().eval()
    with torch.no_grad():
        return model(input_ids.cuda()).logits.float().cpu()


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_bf16_logits_and_logprobs_match_transformers(hf_checkpoint, ranks1, name):
    """bf16 keeps 8 significant bits (relative rounding 2^-9); Megatron and transformers round at different
    points (fused QKV and gate/up, where residuals and norms go to fp32), so logits differ by a few bf16 steps at
    their own magnitude. Bounds: max |dlogit| <= 4% of max |logit|; log-probs of the tokens within 0.1 at worst and
    0.02 on average (a probability ratio within ~2%). One rank process serves every architecture (`ranks1`), so
    each one after the first costs a model load, not a process start."""
    folder = hf_checkpoint(name)
    ids = sample_ids(1000)
    mine = one_result(ranks1.run(gpu_logits, str(folder), ids, torch.bfloat16))
    reference = hf_gpu_logits(folder, ids, torch.bfloat16)
    assert (mine - reference).abs().max().item() <= 0.04 * reference.abs().max().item()
    delta = (token_logprobs(mine, ids) - token_logprobs(reference, ids)).abs()
    assert delta.max().item() < 0.1 and delta.mean().item() < 0.02


GPU_RUN = [
    "placement.train_gpus=1",
    "actor.model.dtype=bfloat16",
    "critic.model.dtype=bfloat16",
    "actor.model.parallel.tp=1",
    "critic.model.parallel.tp=1",
    "rollout.hf.dtype=bfloat16",
    "rl.prompts_per_step=4",
]


@pytest.mark.parametrize("stage", ["grpo", "ppo"])
def test_one_colocated_step_on_one_gpu_hands_the_memory_over(tmp_path, stage):
    megarl_train(write_config(tmp_path, f"[{stage}]", 2, tp=1), *GPU_RUN)
    steps = metrics(tmp_path / "run")
    assert len(steps) == 2
    for step in steps:
        assert step["actor/skipped"] == 0 and step["sync/ipc_engines"] == 1  # synced device to device
        assert step["mismatch/abs_logprob_diff_mean"] < 0.05  # bf16 engine vs bf16 Megatron, same weights
        # the actor's weights, grads and optimizer left the GPU while the engine generated ...
        assert step["memory/rollout/actor_allocated_gb"] < 0.25 * step["memory/update/actor_allocated_gb"]
        # ... and the engine's weights left while the actor trained
        assert step["memory/update/rollout_allocated_gb"] < step["memory/rollout/rollout_allocated_gb"] + 1e-3
        assert step["memory/update/device_used_gb"] > 0


def test_non_finite_gradients_in_bf16_skip_the_step_then_stop_the_run(tmp_path):
    config = write_config(tmp_path, "[grpo]", 3, tp=1)
    faults = {"MEGARL_FAULTS": "nan:actor.grads:2"}
    megarl_train(config, *GPU_RUN, f"run.dir={tmp_path / 'a'}", env=faults)
    steps = metrics(tmp_path / "a")
    assert [s["actor/skipped"] for s in steps] == [0, 1, 0]
    strict = megarl_train(
        config, *GPU_RUN, f"run.dir={tmp_path / 'b'}", "actor.optim.max_consecutive_skips=1", env=faults, check=False
    )
    assert strict.returncode == 1 and "first non-finite gradient: module." in strict.stderr


def test_cuda_ipc_sync_leaves_the_colocated_engine_with_the_trained_weights(hf_checkpoint):
    from megarl.algorithms.aggregation import loss_weights
    from megarl.algorithms.config import PolicyLossConfig
    from megarl.algorithms.losses import PolicyLoss
    from megarl.cluster.config import ClusterConfig
    from megarl.cluster.ray_runtime import start_ray, stop_ray
    from megarl.cluster.resource_pool import ResourcePool
    from megarl.cluster.worker_group import WorkerGroup
    from megarl.data.collate import make_rl_batch
    from megarl.rollout.config import RolloutConfig
    from megarl.runtime.parallel import ParallelConfig
    from megarl.workers.config import MicroBatchSettings, ModelSettings, OptimizerSettings
    from megarl.workers.megatron_worker import MegatronWorker
    from megarl.workers.rollout_worker import RolloutWorker
    from megarl.workers.sync_route import SyncRoute

    folder = str(hf_checkpoint("tiny-qwen3"))
    start_ray(ClusterConfig(num_cpus=8, log_to_driver=False))
    pool = ResourcePool("train", num_nodes=1, gpus_per_node=1)
    try:
        actor = WorkerGroup(MegatronWorker, pool, "actor", num_gpus_per_worker=0.5)
        rollout = WorkerGroup(RolloutWorker, pool, "rollout", world_size=1, num_gpus_per_worker=0.5)
        settings = ModelSettings(path=folder, dtype="float32", parallel=ParallelConfig())
        actor.call("setup", settings, MicroBatchSettings(max_tokens=256), "lm", OptimizerSettings(lr=5e-3), 10)
        rollout.call("setup", folder, RolloutConfig())
        batch = make_rl_batch([[1, 17, 25, 33, 9], [1, 40, 41]], [[5, 6, 7], [8, 9]], pad_id=0)
        mask = batch["response_mask"]
        batch = batch.with_tensors(
            advantages=mask.float(),
            old_logprobs=torch.full(mask.shape, -7.0),
            loss_weights=loss_weights("token-mean", mask),
        )
        actor.call("update_policy", batch, PolicyLoss(PolicyLossConfig()), dispatch="dp_split")
        devices = rollout.call("device_uuids")
        rollout.call("begin_weight_update", 1)
        route = SyncRoute.to_workers(rollout.workers, "ipc", devices)
        (sent,) = actor.call("sync_weights", route, 1, 64 * 1024, collect="all")
        rollout.call("finish_weight_update", 1)
        assert sent["ipc_engines"] == 1
        trained = dict(actor.call("export_weights", collect="rank0"))

        held = engine_tensors(rollout, list(trained))
        assert all(torch.equal(held[name], trained[name].cpu()) for name in trained)
    finally:
        pool.remove()
        stop_ray()
