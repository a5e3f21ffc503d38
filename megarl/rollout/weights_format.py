"""The format of the weights rollout engines serve (`rollout.weights_format`): bf16, or block-wise FP8 as in the
official DeepSeek-V3/R1 checkpoints (megarl.bridge.fp8), quantized by the sending ranks at every sync.

`auto` serves what the run started from: FP8 when model.path is an FP8 HF checkpoint, or a megarl checkpoint
converted from one (its megarl.json records the quantization_config); bf16 otherwise. The hf engine (CPU) serves
what it computes in, never FP8. One function decides, for the controller, the rollout workers and `megarl plan`.
"""

from __future__ import annotations

import json
from pathlib import Path

from megarl.bridge.fp8 import DEEPSEEK_QUANTIZATION, BlockFP8
from megarl.errors import UserError
from megarl.rollout.config import RolloutConfig


def start_quantization(model_path: str | Path) -> dict | None:
    """The quantization_config of the checkpoint at `model_path` (None: unquantized, or not on this machine)."""
    from megarl.checkpoint.model_dir import INFO_FILE

    path = Path(model_path)
    if (path / INFO_FILE).is_file():
        raw = json.loads((path / INFO_FILE).read_text()).get("quantization")
        where = str(path / INFO_FILE)
    elif (path / "config.json").is_file():
        raw = json.loads((path / "config.json").read_text()).get("quantization_config")
        where = str(path / "config.json")
    else:
        return None
    fp8 = BlockFP8.from_config(raw, where)
    return fp8.config if fp8 is not None else None


def rollout_quantization(rollout: RolloutConfig, model_path: str | Path, key: str = "rollout") -> dict | None:
    """The quantization_config the engines serve with (None: unquantized, the training dtype)."""
    choice = rollout.weights_format
    if choice == "bf16":
        return None
    if rollout.backend != "sglang":
        if choice == "fp8":
            raise UserError(
                f"{key}.weights_format=fp8 needs {key}.backend=sglang (the hf engine computes in "
                f"{key}.hf.dtype); use auto or bf16"
            )
        return None
    start = start_quantization(model_path)
    if choice == "fp8":
        return start or dict(DEEPSEEK_QUANTIZATION)  # a bf16 start: DeepSeek's own 128 x 128 blocks
    if choice != "auto":
        raise UserError(f"{key}.weights_format={choice!r}: valid are auto, bf16, fp8")
    return start
