"""Building blocks of the architectures' weight tables (Megatron parameter <-> HF tensors)."""

from __future__ import annotations

from megarl.bridge.mappings import Direct, GateUp, InterleavedGateUp, Mapping, Transposed

MCORE_LAYER = "decoder.layers.{layer}."
HF_LAYER = "model.layers.{layer}."


def swiglu_mappings(
    mcore_prefix: str,
    hf_prefix: str,
    hf_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
    bias: bool = False,
    param_suffix: str = "",
) -> list[Mapping]:
    """A SwiGLU MLP (dense layer, shared expert or one expert): gate+up -> linear_fc1, down -> linear_fc2.

    param_suffix: appended to Megatron's parameter names ("{expert}" for grouped-GEMM experts: weight0, weight1...).
    """
    gate, up, down = (f"{hf_prefix}{name}" for name in hf_names)
    fc1, fc2 = f"{mcore_prefix}linear_fc1", f"{mcore_prefix}linear_fc2"
    table: list[Mapping] = [
        GateUp(f"{fc1}.weight{param_suffix}", (f"{gate}.weight", f"{up}.weight")),
        Direct(f"{fc2}.weight{param_suffix}", (f"{down}.weight",), tp_dim=1),
    ]
    if bias:
        table += [
            GateUp(f"{fc1}.bias{param_suffix}", (f"{gate}.bias", f"{up}.bias")),
            Direct(f"{fc2}.bias{param_suffix}", (f"{down}.bias",)),  # row-parallel bias: added once, replicated
        ]
    return table


def stacked_expert_mappings(mcore_prefix: str, hf_experts: str, param_suffix: str = "") -> list[Mapping]:
    """One expert's SwiGLU with biases <-> its slice of tensors stacked over experts (gpt-oss): `gate_up_proj`
    [experts, hidden, 2 x ffn] (gate, up interleaved), `down_proj` [experts, ffn, hidden], and their biases."""
    fc1, fc2 = f"{mcore_prefix}linear_fc1", f"{mcore_prefix}linear_fc2"
    row = "[{expert}]"
    return [
        InterleavedGateUp(f"{fc1}.weight{param_suffix}", (f"{hf_experts}gate_up_proj{row}",), transposed=True),
        InterleavedGateUp(f"{fc1}.bias{param_suffix}", (f"{hf_experts}gate_up_proj_bias{row}",)),
        Transposed(f"{fc2}.weight{param_suffix}", (f"{hf_experts}down_proj{row}",), tp_dim=1),
        Direct(f"{fc2}.bias{param_suffix}", (f"{hf_experts}down_proj_bias{row}",)),
    ]
