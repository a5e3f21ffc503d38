"""Which parallel layouts a model admits: checked before any process or weight is touched."""

from __future__ import annotations

import math

from megarl.errors import UserError
from megarl.models.hf_config import num_kv_heads
from megarl.runtime.parallel import ParallelConfig


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_parallel_layout(hf_config, parallel: ParallelConfig, prefix: str = "") -> None:
    """Raise a UserError naming the axis (as `{prefix}tp` etc.) when the layout cannot split this model."""
    heads, kv_heads = hf_config.num_attention_heads, num_kv_heads(hf_config)
    ffn, layers = hf_config.intermediate_size, hf_config.num_hidden_layers
    # Megatron splits whole attention heads, whole KV groups and the MLP width across TP ranks.
    if heads % parallel.tp or kv_heads % parallel.tp or ffn % parallel.tp:
        valid = _divisors(math.gcd(heads, kv_heads, ffn))
        raise UserError(
            f"{prefix}tp={parallel.tp} does not divide num_attention_heads={heads}, num_key_value_heads={kv_heads} "
            f"and intermediate_size={ffn}; valid: {', '.join(map(str, valid))}"
        )
    stages = parallel.pp * parallel.vpp
    if layers % stages:
        valid_pp = [p for p in _divisors(layers) if layers % (p * parallel.vpp) == 0]
        raise UserError(
            f"{prefix}pp={parallel.pp} x {prefix}vpp={parallel.vpp} does not divide num_hidden_layers={layers} "
            f"into equal stages; valid {prefix}pp with vpp={parallel.vpp}: {', '.join(map(str, valid_pp)) or 'none'}"
        )
