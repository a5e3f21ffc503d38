"""RoPE as the HF model computes it, for each HF `rope_type`: inverse frequencies and the attention factor.

Megatron-Core's rotary embedding knows Llama-3 scaling only with fixed low/high frequency factors and original
context (1, 4, 8192); computing the frequencies here and handing them to the model matches the checkpoint's own
settings for every supported type.

YaRN (`rope_type: yarn`, Qwen3 and Qwen3-MoE long-context checkpoints, gpt-oss) also multiplies the cosines and
sines by an attention factor (HF's `attention_scaling`, Megatron's "concentration factor"): queries and keys both
carry it, so every attention logit is multiplied by its square. Grouped-query attention takes it as Megatron's
`softmax_scale` (factor^2 / sqrt(head_dim)): the same numbers as scaling cos and sin, whatever the core attention
(`attention_softmax_scale`). The frequency blend and the factor are Megatron-Core's own YaRN functions (the ones its
`YarnRotaryEmbedding` and MLA use), given the HF settings: they compute HF's `_compute_yarn_parameters` formulas,
except that HF takes the rotary dimension after `partial_rotary_factor` and ignores `mscale` unless
`mscale_all_dim` is set too, which is what is passed here. Megatron-Core's own GQA YaRN path is not used: it reads
its settings from attributes that are not `TransformerConfig` fields, ignores `rotary_percent`, and Transformer
Engine's fused RoPE refuses its factor.
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


def yarn_factor(params: dict[str, Any]) -> float:
    """YaRN's context factor: `factor`, or (DeepSeek-V3's checkpoints) max / original positions."""
    factor = params.get("factor")
    if factor is None:
        factor = params["max_position_embeddings"] / params["original_max_position_embeddings"]
    return float(factor)


def _yarn(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    """YaRN ("NTK-by-parts"): wavelengths longer than the original context (fewer than `beta_slow` turns over it)
    divided by `factor`, those with more than `beta_fast` turns kept, a linear ramp over the dimensions between
    (bounds rounded outwards unless `truncate: false`, as gpt-oss sets)."""
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        _yarn_find_correction_range,
        _yarn_linear_ramp_mask,
    )

    rotary_dim = 2 * inv_freq.numel()
    low, high = _yarn_find_correction_range(
        float(params.get("beta_fast") or 32),
        float(params.get("beta_slow") or 1),
        rotary_dim,
        float(params["rope_theta"]),
        int(params["original_max_position_embeddings"]),
        bool(params.get("truncate", True)),
    )
    keep = 1.0 - _yarn_linear_ramp_mask(low, high, rotary_dim // 2, device=inv_freq.device)
    return inv_freq / yarn_factor(params) * (1 - keep) + inv_freq * keep


def _yarn_attention_factor(params: dict[str, Any]) -> float:
    """`attention_factor` if given, else 0.1 ln(factor) + 1, or with both `mscale` and `mscale_all_dim` set the
    ratio of that formula at each (DeepSeek's)."""
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import _yarn_get_concentration_factor

    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if not (mscale and mscale_all_dim):  # HF ignores one without the other
        mscale = mscale_all_dim = None
    return _yarn_get_concentration_factor(yarn_factor(params), mscale, mscale_all_dim)


ROPE_SCALINGS: dict[str, Callable[[torch.Tensor, dict[str, Any]], torch.Tensor]] = {
    "default": _default,
    "linear": _linear,
    "llama3": _llama3,
    "yarn": _yarn,
}
"""rope_type -> the HF model's inverse frequencies, from the unscaled ones and the RoPE parameters."""

ATTENTION_FACTORS: dict[str, Callable[[dict[str, Any]], float]] = {"yarn": _yarn_attention_factor}
"""rope_type -> the factor on cosines and sines (HF's `attention_scaling`); 1 for the types not listed."""


def _with_context(params: dict[str, Any], max_position_embeddings: int | None) -> dict[str, Any]:
    if max_position_embeddings is None:
        return params
    return {"max_position_embeddings": max_position_embeddings, **params}


def rope_inv_freq(rotary_dim: int, params: dict[str, Any], max_position_embeddings: int | None = None) -> torch.Tensor:
    """Inverse frequencies (fp32, length rotary_dim / 2) for `params` as given by `hf_config.rope_parameters`
    (rotary_dim: head_dim x partial_rotary_factor; max_position_embeddings: config.json's, which YaRN without a
    `factor` reads)."""
    rope_type = params.get("rope_type", "default")
    scaling = ROPE_SCALINGS.get(rope_type)
    if scaling is None:
        raise UserError(
            f"config.json rope_type={rope_type!r} is not supported for this architecture; "
            f"valid: {', '.join(sorted(ROPE_SCALINGS))}"
        )
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    inv_freq = 1.0 / (float(params["rope_theta"]) ** exponents)
    return scaling(inv_freq, _with_context(params, max_position_embeddings))


def rope_attention_factor(params: dict[str, Any], max_position_embeddings: int | None = None) -> float:
    """The factor HF multiplies RoPE's cosines and sines by (`attention_scaling`): 1.0 except for YaRN."""
    factor = ATTENTION_FACTORS.get(params.get("rope_type", "default"))
    return factor(_with_context(params, max_position_embeddings)) if factor else 1.0


def attention_softmax_scale(params: dict[str, Any], head_dim: int, max_position_embeddings: int) -> float | None:
    """Megatron's `softmax_scale` giving the HF model's attention logits: factor^2 / sqrt(head_dim), or None (the
    default 1 / sqrt(head_dim)) when the factor is 1. Scaling both rotated queries and keys by the factor multiplies
    each logit by its square; values are not rotated."""
    factor = rope_attention_factor(params, max_position_embeddings)
    return None if factor == 1.0 else factor**2 / math.sqrt(head_dim)
