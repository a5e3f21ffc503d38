"""Reading Hugging Face model configs: loading with clear errors, and fields whose spelling varies by version."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from megarl.errors import UserError

if TYPE_CHECKING:
    from megarl.bridge.safetensors_io import HFCheckpoint

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", **{name: name for name in DTYPES}}


def parse_dtype(name: str, key: str = "dtype") -> torch.dtype:
    """'bf16' | 'bfloat16' | 'fp16' | 'float16' | 'fp32' | 'float32' -> torch dtype."""
    canonical = DTYPE_ALIASES.get(str(name).removeprefix("torch."))
    if canonical is None:
        raise UserError(f"{key}={name!r} is not a supported dtype; valid: bf16, fp16, fp32")
    return DTYPES[canonical]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def read_config_json(model_dir: str | Path) -> dict[str, Any]:
    """The raw config.json of a HF model folder, with a clear error when it is missing or unreadable."""
    path = Path(model_dir) / "config.json"
    if not Path(model_dir).is_dir():
        raise UserError(f"{model_dir} is not a folder: expected a Hugging Face model folder with config.json")
    if not path.is_file():
        raise UserError(f"{path} does not exist: expected a Hugging Face model folder with config.json")
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise UserError(f"{path} is not readable JSON ({err})") from err


MODEL_TYPE_ALIASES = {"kimi_k2": "deepseek_v3"}
"""config.json model_types read as another family's config class: Kimi K2 is DeepSeek-V3's architecture under its own
name (its checkpoint ships DeepSeek-V3's remote code, which megarl never runs; transformers' own class reads it)."""


@dataclass(frozen=True)
class LanguageModelPart:
    """Where a vision-language checkpoint keeps the language model megarl trains (its vision tower is carried through
    unchanged: Architecture.carried_hf_tensors)."""

    config_key: str
    """config.json key of the language model's own config (its `model_type` names the text model)."""
    stored_prefix: str
    """Prefix of the language model's tensors in the checkpoint where the text model has `model.`; `lm_head.weight`
    is the same in both."""
    fused_experts: bool = False
    """The published checkpoints store each layer's routed experts fused (FUSED_EXPERTS): `megarl convert` writes
    them back so (megarl/bridge/fused_experts.py)."""

    def text_name(self, stored: str) -> str:
        """The text model's name of a checkpoint tensor (others, e.g. the vision tower's, unchanged)."""
        return "model." + stored.removeprefix(self.stored_prefix) if stored.startswith(self.stored_prefix) else stored

    def stored_name(self, text: str) -> str:
        """The checkpoint's name of a text-model tensor."""
        return self.stored_prefix + text.removeprefix("model.") if text.startswith("model.") else text


VISION_LANGUAGE = {"qwen3_5_moe": LanguageModelPart("text_config", "model.language_model.", fused_experts=True)}
"""config.json model_types of vision-language checkpoints whose language model megarl trains, read as that text
model: its config from `config_key`, its tensors under the text model's names (Qwen3.5's published checkpoints)."""


FUSED_EXPERTS = frozenset({"qwen3_5_moe", "qwen3_5_moe_text"})
"""config.json model_types whose checkpoints may store each layer's routed experts fused (Qwen3.5 as published:
`mlp.experts.gate_up_proj` [experts, 2 x ffn, hidden], `mlp.experts.down_proj` [experts, hidden, ffn]); transformers'
`save_pretrained` writes them one tensor per expert. Both are read, as one tensor per expert (HFCheckpoint
split_fused_experts)."""

_INHERITED = ("dtype", "torch_dtype", "tie_word_embeddings")


def language_model_part(raw: dict[str, Any]) -> LanguageModelPart | None:
    """The language model's place in a vision-language config.json dict; None for a text model's."""
    return VISION_LANGUAGE.get(raw.get("model_type"))


def read_hf_weights(model_dir: str | Path, **kwargs) -> HFCheckpoint:
    """`HFCheckpoint(model_dir, **kwargs)` under the names the weight tables use: a vision-language checkpoint's
    language model tensors under the text model's names (VISION_LANGUAGE), fused experts one tensor per expert
    (FUSED_EXPERTS), the rest as stored."""
    from megarl.bridge.safetensors_io import HFCheckpoint

    raw = read_config_json(model_dir) if (Path(model_dir) / "config.json").is_file() else {}
    part = language_model_part(raw)
    split = raw.get("model_type") in FUSED_EXPERTS
    return HFCheckpoint(
        model_dir, rename=part.text_name if part is not None else None, split_fused_experts=split, **kwargs
    )


def config_from_dict(raw: dict[str, Any]):
    """The transformers config of a config.json dict (defaults and key renames applied), aliases resolved; a
    vision-language checkpoint's as its language model's config."""
    from transformers import AutoConfig

    part = language_model_part(raw)
    if part is not None:
        text = dict(raw.get(part.config_key) or {})
        if "model_type" not in text:
            raise UserError(f"config.json model_type={raw['model_type']!r} has no {part.config_key}.model_type")
        # what the whole checkpoint records once, at the top (the weights' dtype), unless the text config says it
        inherited = {k: raw[k] for k in _INHERITED if raw.get(k) is not None and text.get(k) is None}
        raw = {**text, **inherited}
    model_type = raw.get("model_type")
    if model_type in MODEL_TYPE_ALIASES:
        raw = {k: v for k, v in raw.items() if k != "auto_map"}  # the remote code's classes: never imported
        model_type = MODEL_TYPE_ALIASES[model_type]
    return AutoConfig.for_model(model_type, **{k: v for k, v in raw.items() if k != "model_type"})


def load_hf_config(model_dir: str | Path):
    """`transformers.AutoConfig` for a local folder (never the hub); aliased model_types as their family's, a
    vision-language checkpoint's as its language model's (VISION_LANGUAGE)."""
    from transformers import AutoConfig

    try:
        raw = read_config_json(model_dir) if (Path(model_dir) / "config.json").is_file() else {}
        if raw.get("model_type") in MODEL_TYPE_ALIASES or language_model_part(raw) is not None:
            return config_from_dict(raw)
        return AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    except (OSError, ValueError, KeyError) as err:
        raise UserError(f"{model_dir}/config.json could not be loaded by transformers: {err}") from err


def config_dtype(hf_config) -> torch.dtype:
    """The dtype the checkpoint's weights are stored in (`dtype`, formerly `torch_dtype`); float32 if unset."""
    value = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None) or "float32"
    if isinstance(value, torch.dtype):
        return value
    return parse_dtype(value, key="config.json dtype")


def head_dim(hf_config) -> int:
    explicit = getattr(hf_config, "head_dim", None)
    return int(explicit) if explicit else hf_config.hidden_size // hf_config.num_attention_heads


def num_kv_heads(hf_config) -> int:
    return int(getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads)


def rope_parameters(hf_config) -> dict[str, Any]:
    """RoPE settings as one dict with `rope_type` and `rope_theta`, whatever the transformers version.

    transformers 5 keeps them in `rope_parameters`; 4.x had `rope_theta` plus an optional `rope_scaling` dict
    whose type key was once spelled `type`.
    """
    params = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params
