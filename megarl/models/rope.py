"""RoPE inverse frequencies for each HF `rope_type`, computed exactly as the HF model computes them.

Megatron-Core's rotary embedding knows Llama-3 scaling only with fixed low/high frequency factors and original
context (1, 4, 8192); computing the frequencies here and handing them to the model matches the checkpoint's own
settings for every supported type.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from megarl.errors import UserError


def _default(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    return inv_freq


def _linear(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    """Position interpolation: every frequency divided by `factor`."""
    return inv_freq / params["factor"]


def _llama3(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by `factor`, short ones kept, a smooth blend in between."""
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    old_context = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


ROPE_SCALINGS: dict[str, Callable[[torch.Tensor, dict[str, Any]], torch.Tensor]] = {
    "default": _default,
    "linear": _linear,
    "llama3": _llama3,
}


def rope_inv_freq(rotary_dim: int, params: dict[str, Any]) -> torch.Tensor:
    """Inverse frequencies (fp32, length rotary_dim / 2) for `params` as given by `hf_config.rope_parameters`."""
    rope_type = params.get("rope_type", "default")
    scaling = ROPE_SCALINGS.get(rope_type)
    if scaling is None:
        raise UserError(
            f"config.json rope_type={rope_type!r} is not supported for this architecture; "
            f"valid: {', '.join(sorted(ROPE_SCALINGS))}"
        )
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    inv_freq = 1.0 / (float(params["rope_theta"]) ** exponents)
    return scaling(inv_freq, params)
