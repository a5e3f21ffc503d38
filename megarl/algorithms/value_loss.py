"""The critic's per-token loss (PPO value clipping).

Shapes: B samples, S token positions; everything is [B, S], aligned with the tokens like the values themselves.
"""

from __future__ import annotations

import torch


def clipped_value_loss(
    values_BS: torch.Tensor,
    old_values_BS: torch.Tensor,
    returns_BS: torch.Tensor,
    response_mask_BS: torch.Tensor,
    clip: float | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """loss_t = 0.5 * max((v_t - R_t)^2, (clip(v_t, old_v_t - c, old_v_t + c) - R_t)^2), or 0.5 * (v_t - R_t)^2
    when clip is None; 0 outside the mask. Metrics per token: vf_clip_frac (1 where the clipped branch is the
    larger), values, vf_error (squared error of the new values). Leaves out: the coefficient (ValueLoss applies it)
    and Huber variants."""
    mask_BS = response_mask_BS.bool()
    returns_BS = returns_BS.to(values_BS.dtype)
    error_BS = (values_BS - returns_BS).square()
    if clip is None:
        loss_BS, clipped_frac_BS = 0.5 * error_BS, torch.zeros_like(error_BS)
    else:
        old_values_BS = old_values_BS.to(values_BS.dtype)
        clipped_values_BS = old_values_BS + (values_BS - old_values_BS).clamp(-clip, clip)
        clipped_error_BS = (clipped_values_BS - returns_BS).square()
        loss_BS = 0.5 * torch.maximum(error_BS, clipped_error_BS)
        clipped_frac_BS = (clipped_error_BS > error_BS).to(values_BS.dtype)
    metrics = {
        "vf_clip_frac": torch.where(mask_BS, clipped_frac_BS, 0.0),
        "values": torch.where(mask_BS, values_BS.detach(), 0.0),
        "vf_error": torch.where(mask_BS, error_BS.detach(), 0.0),
    }
    return torch.where(mask_BS, loss_BS, 0.0), metrics
