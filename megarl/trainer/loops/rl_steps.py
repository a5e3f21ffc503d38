"""The steps of one RL iteration between rollout and weight sync, as functions over a Batch.

Role calls split the batch by data-parallel rank and collect from the DP leaders (megarl/cluster). Algorithm math
is the algorithms package's; this module only wires it: which tensors go in, which come out, which metrics are
logged. Shapes: B rows (prompt groups contiguous), S columns.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from megarl.algorithms.advantages import AdvantageInputs, apply_kl_penalty, compute_advantages
from megarl.algorithms.aggregation import loss_weights
from megarl.algorithms.config import AlgorithmConfig
from megarl.algorithms.dapo import add_to_last_token, apply_overlong_penalty
from megarl.algorithms.distillation import distillation_advantages, distillation_metrics
from megarl.algorithms.kl import adaptive_kl_coef
from megarl.data.batch import Batch
from megarl.rewards.runner import RewardRunner
from megarl.rewards.types import RewardSample
from megarl.rollout.engine import sample_seed
from megarl.trainer.loops.dp_balance import balanced_for
from megarl.trainer.rollout_side.routing import (
    ROUTING_FIELDS,
    RoutingPlan,
    agreement_metrics,
    check_agreement,
    without_routing,
)

LOGPROB_TENSORS = {"ref": "ref_logprobs", "teacher": "teacher_logprobs"}
"""The frozen policies (lifecycle/roles.py FROZEN_POLICIES) and the batch tensor each one's log-probs fill."""

KL_COEF = "kl_coef"
"""Key of the adaptive KL controller's coefficient in the trainer state's `extra` (saved with run checkpoints)."""


def score_rollout(
    batch: Batch, runner: RewardRunner, reward_model=None, rm_coef: float = 1.0
) -> tuple[torch.Tensor, dict[str, float], list[dict[str, float]]]:
    """(scores_B, metrics, per-sample extras): the rule reward (and reward-model score) of every completion."""
    samples = [
        RewardSample(prompt, response, label)
        for prompt, response, label in zip(batch.meta["prompt"], batch.meta["response"], batch.meta["label"])
    ]
    result = runner.score(samples)
    scores = torch.tensor(result.scores, dtype=torch.float32)
    metrics = {f"reward/{name}": value for name, value in result.metrics.items()}
    if reward_model is not None:
        rm_scores = reward_model.call("compute_scores", batch, dispatch="dp_split", collect="dp_leaders")["scores"]
        metrics["reward/model_score"] = rm_scores.mean().item()
        scores = scores + rm_coef * rm_scores
    if "score_override" in batch:  # agent episodes whose environment failed score agent.failure_reward
        override = batch["score_override"]
        scores = torch.where(override.isnan(), scores, override)
    metrics.update({"reward/mean": scores.mean().item(), "reward/std": scores.std().item() if len(scores) > 1 else 0})
    return scores, metrics, result.extras


def reward_batch(
    batch: Batch,
    runner: RewardRunner,
    algorithm: AlgorithmConfig,
    max_new_tokens: int,
    reward_model=None,
    rm_coef: float = 1.0,
) -> tuple[Batch, dict[str, float]]:
    """Score a rollout batch and place the rewards on its tokens (the reward phase of both RL loops)."""
    scores, metrics, _ = score_rollout(batch, runner, reward_model, rm_coef)
    return token_rewards(batch, scores, algorithm, max_new_tokens), metrics


def token_rewards(batch: Batch, scores_B: torch.Tensor, algorithm: AlgorithmConfig, max_new_tokens: int) -> Batch:
    """Scores placed on each sample's last response token, with DAPO's overlong shaping when configured; agent
    episodes add their environments' per-turn rewards (`env_rewards`)."""
    mask = batch["response_mask"]
    rewards = add_to_last_token(torch.zeros(mask.shape), mask, scores_B)
    if "env_rewards" in batch:
        rewards = rewards + batch["env_rewards"]
    if algorithm.dapo.overlong_buffer_len > 0:
        rewards, _ = apply_overlong_penalty(rewards, mask, algorithm.dapo, max_new_tokens)
    return batch.with_tensors(token_rewards=rewards, scores=scores_B)


def old_logprobs_redundant(config, routing: RoutingPlan | None) -> bool:
    """Whether the actor's old-log-prob pass would recompute what the update's own forward gives: one optimizer
    step per batch on the weights that pass would use, with nothing before the update reading old_logprobs (a KL
    reward penalty does, as does distillation's advantage; MoE models' pass measures and replays routing)."""
    rl = config.rl
    return (
        rl.old_logprobs == "auto"
        and rl.mode == "sync"
        and rl.ppo_epochs == 1
        and rl.mini_batches == 1
        and config.algorithm.kl.coef == 0
        and not config.algorithm.needs_teacher()
        and not config.algorithm.needs_sum_pi_squared()
        and routing is None
    )


def _dp_call(role, method: str, batch: Batch, *args, balance: bool = True) -> Batch:
    """A role's per-row results for `batch` (dp_split -> dp_leaders), the rows balanced over its DP ranks."""
    ordered, inverse, _ = balanced_for(batch, role, balance)
    out = role.call(method, ordered, *args, dispatch="dp_split", collect="dp_leaders")
    return out if inverse is None else out.select(inverse)


def add_logprobs(
    batch: Batch,
    roles,
    temperature: float,
    routing: RoutingPlan | None = None,
    actor_pass: bool = True,
    balance: bool = True,
    sum_pi_squared: bool = False,
) -> tuple[Batch, dict[str, float]]:
    """old_logprobs (and entropy; sum_pi_squared when asked: the optimal token baseline) from the actor,
    ref_logprobs from the ref model, teacher_logprobs from the teacher, old_values from the critic.
    MoE models (`routing`): the actor's pass compares, replays or records the routing (trainer/rollout_side/routing.py).
    actor_pass=False (see old_logprobs_redundant): no actor pass; the update takes its own log-probs as old."""
    mode = routing.logprob_pass if routing is not None else "off"
    tensors, metrics = {}, {}
    mask = batch["response_mask"].float()
    if actor_pass:
        out = _dp_call(roles.actor, "compute_logprobs", batch, temperature, True, mode, sum_pi_squared, balance=balance)
        tensors["old_logprobs"] = out["logprobs"]
        if sum_pi_squared:
            tensors["sum_pi_squared"] = out["sum_pi_squared"]
        metrics["actor/entropy"] = _masked_mean(out["entropy"], mask)
        if "routing_agree" in out:
            metrics |= agreement_metrics(out["routing_agree"], out["routing_observed"])
            check_agreement(metrics, routing)
        if mode == "record":  # old_logprob replay: the updates replay what this pass chose
            tensors |= {name: out[name] for name in ROUTING_FIELDS}
    else:
        metrics["actor/old_logprobs_from_update"] = 1.0
    for name, tensor in LOGPROB_TENSORS.items():  # the frozen policies' log-probs of the same tokens
        if (group := getattr(roles, name)) is not None:
            tensors[tensor] = _dp_call(group, "compute_logprobs", batch, temperature, balance=balance)["logprobs"]
    if (server := getattr(roles, "teacher_server", None)) is not None:  # teacher.backend=sglang (temperature 1)
        tensors["teacher_logprobs"] = server.logprobs(batch)
    if roles.critic is not None:
        values = _dp_call(roles.critic, "compute_values", batch, balance=balance)
        tensors["old_values"] = values["values"]
        metrics["critic/values"] = _masked_mean(values["values"], mask)
    batch = batch.with_tensors(**tensors)
    metrics.update(mismatch_metrics(batch))
    return batch, metrics


def add_reward_baselines(
    batch: Batch, greedy: Batch, runner: RewardRunner, reward_model=None, rm_coef: float = 1.0
) -> tuple[Batch, dict[str, float]]:
    """`reward_baselines` (remax): the score of the greedy response to each row's prompt. `greedy` holds one
    response per prompt, in the order of the batch's group ids (prompt i, group id i)."""
    scores, _, _ = score_rollout(greedy, runner, reward_model, rm_coef)
    baselines = scores[batch["group_ids"]]
    return batch.with_tensors(reward_baselines=baselines), {"reward/greedy_baseline": scores.mean().item()}


def add_advantages(
    batch: Batch, algorithm: AlgorithmConfig, state: dict | None = None
) -> tuple[Batch, dict[str, float]]:
    """KL reward penalty (if on), then advantages and returns (with distillation: mixed with the teacher's; see
    megarl/algorithms/distillation.py). With algorithm.kl_ctrl=adaptive the penalty's
    coefficient is state["kl_coef"] (the trainer state's `extra`, kept in run checkpoints; algorithm.kl.coef at
    first), updated here for the next step."""
    rewards, metrics = batch["token_rewards"], {}
    mask = batch["response_mask"]
    if algorithm.kl.coef > 0:
        adaptive = algorithm.kl_ctrl == "adaptive" and state is not None
        coef = float(state.get(KL_COEF, algorithm.kl.coef)) if adaptive else algorithm.kl.coef
        rewards, kl = apply_kl_penalty(
            rewards, batch["old_logprobs"], batch["ref_logprobs"], mask, algorithm.kl, coef=coef
        )
        mask_f = mask.float()
        sequence_kl = ((kl * mask_f).sum(1) / mask_f.sum(1).clamp(min=1)).mean().item()
        metrics |= {"kl/reward_penalty": _masked_mean(kl, mask_f), "kl/sequence_mean": sequence_kl, "kl/coef": coef}
        if adaptive:
            config = algorithm.kl
            state[KL_COEF] = adaptive_kl_coef(coef, sequence_kl, config.target_kl, config.horizon, len(mask))
    tensors = batch.tensors
    inputs = AdvantageInputs(
        rewards,
        mask,
        batch["group_ids"],
        tensors.get("old_values"),
        tensors.get("reward_baselines"),
        tensors.get("old_logprobs"),
        tensors.get("sum_pi_squared"),
    )
    advantages, returns = compute_advantages(inputs, algorithm.advantage)
    if algorithm.needs_teacher():  # on-policy distillation: the teacher's per-token reverse KL joins the advantage
        student, teacher = batch["old_logprobs"], batch["teacher_logprobs"]
        advantages, reverse_kl = distillation_advantages(
            advantages, student, teacher, mask, algorithm.distill_coef, algorithm.distill_reward_coef
        )
        metrics |= distillation_metrics(reverse_kl, teacher, mask)
    metrics["advantages/mean"] = _masked_mean(advantages, mask.float())
    metrics["advantages/abs_mean"] = _masked_mean(advantages.abs(), mask.float())
    return batch.with_tensors(advantages=advantages, returns=returns), metrics


def mini_batches(batch: Batch, num: int, seed: int | None = None) -> Iterator[Batch]:
    """Cut the batch into `num` mini-batches of whole prompt groups: in order, or with `seed` in a random order of
    the groups drawn from it (each PPO epoch its own). A mini-batch keeps its rows in batch order."""
    if num == 1:  # the whole batch, in its order
        yield batch
        return
    group_ids = batch["group_ids"]
    groups = torch.unique_consecutive(group_ids)
    if seed is not None and num > 1:
        groups = groups[torch.randperm(len(groups), generator=torch.Generator().manual_seed(seed))]
    bounds = [len(groups) * i // num for i in range(num + 1)]
    for i in range(num):
        chosen = groups[bounds[i] : bounds[i + 1]]
        rows = torch.isin(group_ids, chosen).nonzero().squeeze(1)
        yield batch.select(rows)


def update_actor(
    batch: Batch,
    roles,
    loss_fn,
    algorithm: AlgorithmConfig,
    temperature: float,
    norm_len: int,
    balance: bool = True,
    after_submit: Callable[[], None] | None = None,
) -> dict[str, float]:
    """One optimizer step on a mini-batch; loss weights from the policy loss's aggregation over this mini-batch;
    rows balanced over the DP ranks (balance/* metrics). `after_submit` runs once the update is on its way to the
    workers, before its answer (e.g. the weight sync queued behind it: WeightSync.start)."""
    config = algorithm.policy_loss
    weights = loss_weights(config.aggregation, batch["response_mask"], config.norm_len or norm_len)
    batch, _, balance_metrics = balanced_for(batch.with_tensors(loss_weights=weights), roles.actor, balance)
    pending = roles.actor.async_call(
        "update_policy",
        batch,
        loss_fn,
        temperature,
        dispatch="dp_split",
        collect="rank0",
    )
    if after_submit is not None:
        after_submit()
    metrics = pending.result()
    routing = {"rollout/routing_replayed": metrics.pop("routing_replayed")} if "routing_replayed" in metrics else {}
    # mismatch/* come from the loss when the update measured them (no old-log-prob pass)
    named = {name if name.startswith("mismatch/") else f"actor/{name}": value for name, value in metrics.items()}
    return named | routing | balance_metrics


def update_critic(
    batch: Batch, roles, loss_fn, algorithm: AlgorithmConfig, norm_len: int, balance: bool = True
) -> dict[str, float]:
    config = algorithm.value_loss
    weights = loss_weights(config.aggregation, batch["response_mask"], config.norm_len or norm_len)
    batch, _, _ = balanced_for(batch.with_tensors(loss_weights=weights), roles.critic, balance)
    metrics = roles.critic.call("update_critic", batch, loss_fn, dispatch="dp_split", collect="rank0")
    return {f"critic/{name}": value for name, value in metrics.items()}


def mismatch_metrics(batch: Batch) -> dict[str, float]:
    """Training-inference mismatch on the rollout's own tokens: the engine's log-probs against the actor's."""
    if "rollout_logprobs" not in batch or "old_logprobs" not in batch:
        return {}
    mask = batch["response_mask"].bool()
    delta = (batch["old_logprobs"] - batch["rollout_logprobs"])[mask]
    if delta.numel() == 0:
        return {}
    ratio = delta.exp()  # pi_actor / pi_rollout per token
    return {
        "mismatch/abs_logprob_diff_mean": delta.abs().mean().item(),
        "mismatch/abs_logprob_diff_max": delta.abs().max().item(),
        "mismatch/ratio_mean": ratio.mean().item(),
        "mismatch/kl": (ratio - 1 - delta).mean().item(),  # k3 estimate of KL(rollout || actor)
    }


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    return ((values * mask).sum() / mask.sum().clamp(min=1)).item()


def average(metrics: list[dict[str, float]]) -> dict[str, float]:
    """Mean of each metric over a list of per-update dicts."""
    names = {name for m in metrics for name in m}
    return {name: sum(m[name] for m in metrics if name in m) / sum(name in m for m in metrics) for name in names}


def update(
    config,
    roles,
    batch: Batch,
    actor_loss,
    critic_loss,
    temperature: float,
    train_actor: bool = True,
    step: int = 0,
    after_last_actor_update: Callable[[], None] | None = None,
) -> dict[str, float]:
    """rl.ppo_epochs passes over the batch in rl.mini_batches mini-batches (one optimizer step each), the prompt
    groups reshuffled into mini-batches each epoch (seeded by run.seed, the global `step` and the epoch); the
    critic trains every step, the actor when `train_actor` (after rl.critic_warmup_steps).
    `after_last_actor_update`: run once the step's last actor update is submitted (see update_actor)."""
    rl, algorithm = config.rl, config.algorithm
    norm_len = config.rollout.sampling.max_new_tokens
    if algorithm.routing_replay == "off":
        batch = without_routing(batch)  # live routing in the updates
    updates = []
    for epoch in range(rl.ppo_epochs):
        seed = sample_seed(sample_seed(config.run.seed, step), epoch)
        for index, mini in enumerate(mini_batches(batch, rl.mini_batches, seed)):
            metrics = {}
            if critic_loss is not None:
                metrics |= update_critic(mini, roles, critic_loss, algorithm, norm_len, rl.balance_dp)
            if train_actor:
                last = epoch == rl.ppo_epochs - 1 and index == rl.mini_batches - 1
                then = after_last_actor_update if last else None
                metrics |= update_actor(mini, roles, actor_loss, algorithm, temperature, norm_len, rl.balance_dp, then)
            updates.append(metrics)
    return average(updates)
