"""Tiny HF checkpoints made from a config (no hub): real `save_pretrained` folders with a local tokenizer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

CONFIGS_DIR = Path(__file__).resolve().parents[2] / "configs" / "models"


def tiny_config(name: str) -> dict[str, Any]:
    """A model config from configs/models/, e.g. 'tiny-llama'."""
    path = CONFIGS_DIR / f"{name}.json"
    if not path.is_file():
        names = sorted(p.stem for p in CONFIGS_DIR.glob("*.json"))
        raise FileNotFoundError(f"no model config {path}; available: {', '.join(names)}")
    return json.loads(path.read_text())


def make_hf_checkpoint(
    config: str | dict[str, Any],
    out_dir: str | Path,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    max_shard_size: str | int | None = None,
    with_tokenizer: bool = True,
) -> Path:
    """Build a random model from `config` (a name under configs/models/ or a config dict) and save it.

    One-dimensional weights and buffers (norms, biases, DeepSeek's expert-selection bias) and biases stacked over
    experts (gpt-oss) are randomized too: HF initializes them to ones and zeros, which would let a mapping that swaps
    two norms pass every numeric check. A vision-language config (hf_config.VISION_LANGUAGE) builds the whole
    vision-language model, as its published checkpoints are saved.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    from megarl.data.char_tokenizer import build_char_tokenizer
    from megarl.models.hf_config import MODEL_TYPE_ALIASES, config_from_dict, language_model_part

    raw = dict(tiny_config(config) if isinstance(config, str) else config)
    torch.manual_seed(seed)
    if language_model_part(raw) is not None:
        whole = AutoConfig.for_model(raw["model_type"], **{k: v for k, v in raw.items() if k != "model_type"})
        model = AutoModelForImageTextToText.from_config(whole)
    else:
        model = AutoModelForCausalLM.from_config(config_from_dict(raw))
    saved = model.state_dict()
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if tensor.dim() == 1 or name.endswith("_bias"):
                tensor.add_(torch.randn_like(tensor) * 0.2)
        for name, tensor in model.named_buffers():
            if tensor.dim() == 1 and tensor.is_floating_point() and name in saved:
                # small: a large expert-selection bias would starve whole expert groups of tokens
                tensor.add_(torch.randn_like(tensor) * 0.02)
    model = model.to(dtype)
    out_dir = Path(out_dir)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size is not None else {}
    model.save_pretrained(out_dir, **kwargs)
    if raw["model_type"] in MODEL_TYPE_ALIASES:
        # saved by the family's class: give config.json back its own model_type (and remote-code pointers), as the
        # published checkpoint has them
        written = json.loads((out_dir / "config.json").read_text())
        written.update(model_type=raw["model_type"], **({"auto_map": raw["auto_map"]} if "auto_map" in raw else {}))
        (out_dir / "config.json").write_text(json.dumps(written, indent=2, sort_keys=True) + "\n")
    if with_tokenizer:
        build_char_tokenizer().save_pretrained(out_dir)
    return out_dir
