"""The architecture registry: one entry per HF model family, looked up by config.json `model_type`."""

from __future__ import annotations

from megarl.errors import UserError
from megarl.models.architecture import Architecture

_SLIDING = "sliding-window attention is not implemented by Megatron-Core's local attention"

ARCHITECTURES: dict[str, Architecture] = {
    arch.name: arch
    for arch in [
        Architecture("llama", hf_model_types=("llama",)),
        Architecture(
            "qwen2", hf_model_types=("qwen2",), qkv_bias_always=True, unsupported={"use_sliding_window": _SLIDING}
        ),
        Architecture("qwen3", hf_model_types=("qwen3",), qk_norm=True, unsupported={"use_sliding_window": _SLIDING}),
    ]
}


def supported_model_types() -> list[str]:
    return sorted(t for arch in ARCHITECTURES.values() for t in arch.hf_model_types)


def get_architecture(model_type: str | None) -> Architecture:
    """The entry for a config.json `model_type`, or a UserError listing the supported ones."""
    for arch in ARCHITECTURES.values():
        if model_type in arch.hf_model_types:
            return arch
    raise UserError(
        f"config.json model_type={model_type!r} is not supported; supported: {', '.join(supported_model_types())}"
    )
