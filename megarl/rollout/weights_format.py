"""The format of the weights rollout engines serve (`rollout.weights_format`): bf16, or block-wise FP8 as in the
official DeepSeek-V3/R1 checkpoints (megarl.bridge.fp8), quantized by the sending ranks at every sync.

`auto` serves what the run started from: FP8 when model.path is an FP8 HF checkpoint, or a megarl checkpoint
converted from one (its megarl.json records the quantization_config); bf16 otherwise. The hf engine (CPU) serves
what it computes in, never FP8. One function decides, for the controller, the rollout workers and `megarl plan`.
"""

from __future__ import annotations

from pathlib import Path

from megarl.bridge.fp8 import DEEPSEEK_QUANTIZATION, BlockFP8
from megarl.rollout.config import RolloutConfig


def start_quantization(model_path: str | Path) -> dict | None:
    """The quantization_config of the checkpoint at `model_path` (None: unquantized, or not on this machine)."""
    from megarl.checkpoint.model_dir import ModelCheckpointInfo, is_megarl_checkpoint

    if is_megarl_checkpoint(model_path):
        return ModelCheckpointInfo.load(model_path).quantization
    fp8 = BlockFP8.of_folder(model_path)
    return fp8.config if fp8 is not None else None


def rollout_quantization(rollout: RolloutConfig, model_path: str | Path) -> dict | None:
    """The quantization_config the engines serve with (None: unquantized, the training dtype). The choices were
    validated with the config (RolloutConfig.check: fp8 needs the sglang backend)."""
    if rollout.weights_format == "bf16" or rollout.backend != "sglang":
        return None
    start = start_quantization(model_path)
    if rollout.weights_format == "fp8":
        return start or dict(DEEPSEEK_QUANTIZATION)  # a bf16 start: DeepSeek's own 128 x 128 blocks
    return start
