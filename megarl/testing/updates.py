"""A policy update that moves the weights, for tests and benchmarks that need them moved (weight sync, deltas)."""

from __future__ import annotations

import torch

from megarl.algorithms.aggregation import loss_weights
from megarl.algorithms.config import PolicyLossConfig
from megarl.algorithms.losses import PolicyLoss
from megarl.data.collate import make_rl_batch


def update_batch(prompts: list[list[int]], response: list[int]):
    """`response` after every prompt, each token with advantage 1 against an old log-prob of -4: every step raises
    their probability (PPO's clip is opened by `update_loss`)."""
    batch = make_rl_batch(prompts, [response] * len(prompts), pad_id=0)
    mask = batch["response_mask"]
    return batch.with_tensors(
        advantages=mask.float(),
        old_logprobs=torch.full(mask.shape, -4.0),
        loss_weights=loss_weights("token-mean", mask),
    )


def update_loss() -> PolicyLoss:
    """PPO's policy loss with the upper clip out of reach, so that the update is never clipped away."""
    return PolicyLoss(PolicyLossConfig(clip_high=100.0))


def one_update(actor, prompts: list[list[int]], response: tuple[int, ...] = (5, 6, 7, 8)) -> None:
    """One `update_policy` on an actor worker group."""
    actor.call("update_policy", update_batch(prompts, list(response)), update_loss(), dispatch="dp_split")
