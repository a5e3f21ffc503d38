"""Rank-side functions of the role-compute tests (they run inside the gloo rank pools of tests/conftest.py)."""

from __future__ import annotations

import torch
from helpers import as_parallel

from megarl.data.batch import Batch


def random_batch(
    num_rows: int, vocab_size: int, seed: int = 0, max_len: int = 40, samples_per_prompt: int = 1
) -> Batch:
    """Right-padded prompt+response rows of random tokens and lengths, with masks and per-token RL fields;
    `samples_per_prompt` consecutive rows with the same prompt (GRPO's groups)."""
    g = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(3, 12, (num_rows,), generator=g)
    prompt_lens = prompt_lens[torch.arange(num_rows) // samples_per_prompt * samples_per_prompt]
    response_lens = torch.randint(1, max_len - 12, (num_rows,), generator=g)
    width = int((prompt_lens + response_lens).max())
    input_ids = torch.zeros(num_rows, width, dtype=torch.long)
    attention = torch.zeros(num_rows, width, dtype=torch.long)
    response = torch.zeros(num_rows, width)
    for i in range(num_rows):
        p, r = int(prompt_lens[i]), int(response_lens[i])
        input_ids[i, : p + r] = torch.randint(1, vocab_size, (p + r,), generator=g)
        if i % samples_per_prompt:
            input_ids[i, :p] = input_ids[i - 1, :p]
        attention[i, : p + r] = 1
        response[i, p : p + r] = 1
    advantages = torch.randn(num_rows, 1, generator=g) * response
    return Batch(
        {
            "input_ids": input_ids,
            "attention_mask": attention,
            "response_mask": response,
            "advantages": advantages,
            "group_ids": torch.arange(num_rows) // 2,
        }
    )


def settings_for(path: str, layout, dtype: str = "float32", lr: float = 1e-3):
    from megarl.workers.config import ModelSettings, OptimizerSettings

    model = ModelSettings(path=path, dtype=dtype, parallel=as_parallel(layout))
    optim = OptimizerSettings(lr=lr, clip_grad=1.0, eps=1e-6)
    return model, optim


def _init(layout) -> None:
    from megarl.runtime.distributed import init_model_parallel

    init_model_parallel(as_parallel(layout))


def _dp_part(batch: Batch) -> tuple[int, Batch]:
    from megatron.core import parallel_state as ps

    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    return dp_rank, batch.split(dp_size)[dp_rank]


def policy_logprobs(
    path: str, layout, batch: Batch, temperature: float = 1.0, max_tokens: int = 64, packing: bool = True
):
    """(dp rank, Batch of logprobs, entropy and sum_pi_squared) from each output rank; None elsewhere. Packed
    micro-batches unless `packing` is false (the product default is packed)."""
    from megarl.workers.policy import compute_logprobs
    from megarl.workers.role_model import build_role_model

    _init(layout)
    model = build_role_model(settings_for(path, layout)[0])
    dp_rank, part = _dp_part(batch)
    out = compute_logprobs(
        model, part, temperature, max_tokens=max_tokens, with_entropy=True, packing=packing, with_sum_pi_squared=True
    )
    return None if out is None else (dp_rank, out)


def one_update(
    path: str,
    layout,
    batch: Batch,
    loss_weights: torch.Tensor,
    max_tokens: int = 64,
    steps: int = 1,
    packing: bool = True,
):
    """Build a trainable actor, take `steps` PPO steps on the batch; (metrics per step, exported HF weights from
    the sending ranks)."""
    from megarl.algorithms.config import PolicyLossConfig
    from megarl.algorithms.losses import PolicyLoss
    from megarl.bridge.exporter import export_hf_weights
    from megarl.workers.policy import compute_logprobs, update_policy
    from megarl.workers.role_model import build_role_model

    _init(layout)
    model_settings, optim = settings_for(path, layout)
    model = build_role_model(model_settings, optimizer=optim, total_steps=10)
    _, part = _dp_part(batch.with_tensors(loss_weights=loss_weights))
    old = compute_logprobs(model, part, max_tokens=max_tokens, packing=packing)
    old = _share_from_output_rank(old, part)
    loss_fn = PolicyLoss(PolicyLossConfig())
    history = []
    for _ in range(steps):
        mini = part.with_tensors(old_logprobs=old)
        history.append(update_policy(model, mini, loss_fn, max_tokens=max_tokens, packing=packing))
    sent = [(n, t.clone()) for bucket in export_hf_weights(model.loaded.bridge, torch.float32) for n, t in bucket]
    return history, sent


def _share_from_output_rank(result: Batch | None, part: Batch) -> torch.Tensor:
    """Every rank of a model replica needs the old log-probs its output rank computed (the controller sends them
    back in the next call's batch; here they are broadcast inside the replica)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    group = ps.get_model_parallel_group()
    flags = [None] * dist.get_world_size(group)
    dist.all_gather_object(flags, (dist.get_rank(), result is not None), group=group)
    src = next(rank for rank, has in flags if has)
    tensor = result["logprobs"] if result is not None else torch.zeros(part["input_ids"].shape)
    dist.broadcast(tensor, src=src, group=group)
    return tensor


def critic_values(path: str, layout, batch: Batch, max_tokens: int = 64, packing: bool = True):
    """(dp rank, values) from output ranks of a critic built from a causal LM (fresh value head)."""
    from megarl.workers.role_model import build_role_model
    from megarl.workers.value import compute_values

    _init(layout)
    model = build_role_model(settings_for(path, layout)[0], head="value")
    dp_rank, part = _dp_part(batch)
    out = compute_values(model, part, max_tokens, packing)
    return None if out is None else (dp_rank, out["values"])


def critic_update(
    path: str, layout, batch: Batch, loss_weights: torch.Tensor, max_tokens: int = 64, packing: bool = True
):
    """One value-loss step; (metrics, the value head weight and the final norm after the step)."""
    from megarl.algorithms.config import ValueLossConfig
    from megarl.algorithms.losses import ValueLoss
    from megarl.workers.role_model import build_role_model
    from megarl.workers.value import update_critic

    _init(layout)
    model_settings, optim = settings_for(path, layout)
    model = build_role_model(model_settings, head="value", optimizer=optim, total_steps=10)
    _, part = _dp_part(batch.with_tensors(loss_weights=loss_weights))
    returns = part["response_mask"] * 0.5
    part = part.with_tensors(old_values=torch.zeros_like(returns), returns=returns)
    metrics = update_critic(model, part, ValueLoss(ValueLossConfig(clip=None)), max_tokens, packing)
    chunk = model.loaded.chunks[-1]
    head = chunk.output_layer.weight.detach().clone() if chunk.post_process else None
    return metrics, head


def reward_model_step(
    path: str, layout, batch: Batch, pair_weights: torch.Tensor, max_tokens: int = 64, packing: bool = True
):
    """Scores before, one Bradley-Terry step, scores after: (dp rank, before, after, metrics) on output ranks."""
    from megarl.workers.role_model import build_role_model
    from megarl.workers.value import compute_scores, update_reward_model

    _init(layout)
    model_settings, optim = settings_for(path, layout, lr=1e-3)
    model = build_role_model(model_settings, head="value", optimizer=optim, total_steps=10)
    dp_rank, part = _dp_part(batch.with_tensors(pair_weights=pair_weights))
    before = compute_scores(model, part, max_tokens, packing)
    metrics = update_reward_model(model, part, max_tokens, packing)
    after = compute_scores(model, part, max_tokens, packing)
    return None if before is None else (dp_rank, before["scores"], after["scores"], metrics)


def train_and_save(path: str, layout, batch: Batch, loss_weights: torch.Tensor, folder: str, steps: int = 1):
    """Take `steps` PPO steps, save the role checkpoint; (losses per step, the helper processes left running)."""
    import multiprocessing

    from megarl.workers.role_checkpoint import save_role

    model, part, loss_fn = _trainable_actor(path, layout, batch, loss_weights)
    losses = [_ppo_step(model, part, loss_fn)["loss"] for _ in range(steps)]
    save_role(model, folder)
    return losses, [child.name for child in multiprocessing.active_children()]


def resume_and_train(path: str, layout, batch: Batch, loss_weights: torch.Tensor, folder: str, save_to: str = ""):
    """Load the role checkpoint at `layout`, optionally save it again, take one more step; (loss, grad norm)."""
    from megarl.workers.role_checkpoint import load_role, save_role

    model, part, loss_fn = _trainable_actor(path, layout, batch, loss_weights)
    load_role(model, folder)
    if save_to:
        save_role(model, save_to)
    metrics = _ppo_step(model, part, loss_fn)
    return metrics["loss"], metrics["grad_norm"], model.optimizer.num_steps


def optimizer_state(path: str, folder: str):
    """At TP=1 on one rank: the checkpoint's parameters and Adam states by parameter name."""
    from megarl.workers.role_checkpoint import load_role

    model, _, _ = _trainable_actor(path, (1, 1, 1), None, None)
    load_role(model, folder)
    names = {id(p): n for n, p in model.loaded.chunks[0].named_parameters()}
    opt = model.optimizer
    states = {}
    for param, master in zip(opt.params, opt.masters):
        state = opt.optimizer.state[master]
        states[names[id(param)]] = (param.detach().clone(), state["exp_avg"].clone(), state["exp_avg_sq"].clone())
    return states, opt.num_steps


def _trainable_actor(path: str, layout, batch: Batch | None, loss_weights):
    from megarl.algorithms.config import PolicyLossConfig
    from megarl.algorithms.losses import PolicyLoss
    from megarl.workers.role_model import build_role_model

    _init(layout)
    model_settings, optim = settings_for(path, layout)
    model = build_role_model(model_settings, optimizer=optim, total_steps=10)
    part = None
    if batch is not None:
        _, part = _dp_part(batch.with_tensors(loss_weights=loss_weights))
        # a fixed "old policy": the update differs from step to step only through the weights
        part = part.with_tensors(old_logprobs=torch.full(part["input_ids"].shape, -7.0))
    return model, part, PolicyLoss(PolicyLossConfig(clip_low=0.9, clip_high=100.0))


def _ppo_step(model, part: Batch, loss_fn) -> dict:
    from megarl.workers.policy import update_policy

    return update_policy(model, part, loss_fn, max_tokens=64)


def poisoned_updates(path: str, layout, batch: Batch, loss_weights: torch.Tensor, poisoned: list[int], limit: int):
    """PPO steps 0, 1, ... on the batch; before the optimizer step of each step in `poisoned`, one gradient element of
    global rank 1 only turns NaN. Per step: (skipped, whether any weight of this rank changed); then the text of
    the optimizer's error if it stopped the run (else "")."""
    import torch.distributed as dist

    from megarl.workers.optimizer import NonFiniteGradients

    model, part, loss_fn = _trainable_actor(path, layout, batch, loss_weights)
    model.optimizer.settings.max_consecutive_skips = limit
    optimizer_step, current = model.optimizer.step, [0]

    def step_with_poison():
        if current[0] in poisoned and dist.get_rank() == 1:
            model.optimizer.params[2].main_grad.view(-1)[0] = float("nan")
        return optimizer_step()

    model.optimizer.step = step_with_poison
    history = []
    for current[0] in range(len(poisoned) + 2):
        before = [p.detach().clone() for p in model.optimizer.params]
        try:
            metrics = _ppo_step(model, part, loss_fn)
        except NonFiniteGradients as err:
            return history, str(err)
        changed = any(not torch.equal(a, p) for a, p in zip(before, model.optimizer.params))
        history.append((bool(metrics["skipped"]), changed))
    return history, ""
