"""Build a fresh model folder from a config.json when there is none to download (the CPU quickstart).

The result is an ordinary HF folder (safetensors weights, config.json, generation_config.json, tokenizer files), so
every role and the rollout engine load it like any checkpoint. The vocabulary size comes from the tokenizer.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from megarl.errors import UserError

if TYPE_CHECKING:
    from megarl.job import ModelInit


def ensure_model(path: str, init: ModelInit | None) -> bool:
    """Create `path` from `init` when it does not exist yet; returns whether it built one."""
    if Path(path).exists() or init is None:
        if not Path(path).exists():
            raise UserError(f"model.path={path!r} does not exist; give a HF model folder, or model.init to build one")
        return False
    build_model_folder(init, Path(path))
    return True


def build_model_folder(init: ModelInit, out_dir: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    from megarl.data.char_tokenizer import build_char_tokenizer
    from megarl.models.hf_config import config_from_dict

    config_path = Path(init.config)
    try:
        raw = json.loads(config_path.read_text())
    except (OSError, ValueError) as err:
        raise UserError(f"model.init.config={init.config!r} is not a readable config.json ({err})") from err
    tokenizer = build_char_tokenizer()
    raw["vocab_size"] = len(tokenizer)
    for role in ("pad", "bos", "eos"):
        raw[f"{role}_token_id"] = getattr(tokenizer, f"{role}_token_id")
    model_type = raw.pop("model_type", None)
    if model_type is None:
        raise UserError(f"{config_path} has no model_type")
    hf_config = config_from_dict({"model_type": model_type, **raw})  # aliases (kimi_k2) as their family's class
    torch.manual_seed(init.seed)
    model = AutoModelForCausalLM.from_config(hf_config)
    staging = out_dir.parent / f".{out_dir.name}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id
    ).save_pretrained(staging)
    os.rename(staging, out_dir)
    return out_dir
