"""Which parallel layouts a model admits: checked before any process or weight is touched."""

from __future__ import annotations

import math

from megarl.errors import UserError
from megarl.models.architecture import Architecture
from megarl.models.hf_config import num_kv_heads
from megarl.runtime.parallel import ParallelConfig


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _check_divides(size: int, key: str, dims: dict[str, int]) -> None:
    if any(value % size for value in dims.values()):
        listed = ", ".join(f"{name}={value}" for name, value in dims.items())
        valid = ", ".join(map(str, _divisors(math.gcd(*dims.values()))))
        raise UserError(f"{key}={size} does not divide {listed}; valid: {valid}")


def check_parallel_layout(arch: Architecture, hf_config, parallel: ParallelConfig, prefix: str = "") -> None:
    """Raise a UserError naming the axis (as `{prefix}tp` etc.) when the layout cannot split this model."""
    # Megatron splits whole attention heads, whole KV groups and the MLP width across TP ranks.
    tp_dims = {"num_attention_heads": hf_config.num_attention_heads}
    if not arch.mla:
        tp_dims["num_key_value_heads"] = num_kv_heads(hf_config)
    if arch.hybrid_linear_attention:  # the Gated DeltaNet layers split whole key heads and their value heads
        tp_dims["linear_num_key_heads"] = hf_config.linear_num_key_heads
        tp_dims["linear_num_value_heads"] = hf_config.linear_num_value_heads
        if parallel.cp > 1:
            raise UserError(
                f"{prefix}cp={parallel.cp} is not supported for {arch.name}: its Gated DeltaNet layers carry a "
                "recurrent state along the whole sequence, which megarl (like Megatron-Core 0.16.1) does not split "
                f"across context-parallel ranks; use {prefix}cp=1"
            )
    if arch.moe is None or not all(arch.moe.sparse_layers(hf_config)):
        tp_dims["intermediate_size"] = hf_config.intermediate_size
    _check_divides(parallel.tp, f"{prefix}tp", tp_dims)
    if arch.moe is not None:
        experts = {arch.moe.num_experts_key: arch.moe.num_experts(hf_config)}
        _check_divides(parallel.ep, f"{prefix}ep", experts)
        etp = parallel.etp if parallel.etp is not None else parallel.tp
        _check_divides(etp, f"{prefix}etp", {arch.moe.expert_ffn_key: int(getattr(hf_config, arch.moe.expert_ffn_key))})
        if etp > 1 and arch.features(hf_config).mlp_bias:
            unset = " (unset: the same as tp)" if parallel.etp is None else ""
            raise UserError(
                f"{prefix}etp={etp}{unset} cannot split the experts of {arch.name}: Megatron-Core supports expert "
                f"biases only without expert tensor parallelism; set {prefix}etp=1 ({prefix}tp={parallel.tp} still "
                "splits attention)"
            )
    elif parallel.ep > 1:
        raise UserError(f"{prefix}ep={parallel.ep} needs a mixture-of-experts model; {arch.name} is dense: use 1")
    if parallel.cp > 1 and parallel.cp_comm_type == "a2a":
        # Ulysses: each TP rank's heads are scattered over the CP ranks
        heads = {"num_attention_heads / tp": hf_config.num_attention_heads // parallel.tp}
        if not arch.mla:
            heads["num_key_value_heads / tp"] = max(num_kv_heads(hf_config) // parallel.tp, 1)
        _check_divides(parallel.cp, f"{prefix}cp (with cp_comm_type=a2a)", heads)
    parallel.stages.check(hf_config.num_hidden_layers, prefix)
