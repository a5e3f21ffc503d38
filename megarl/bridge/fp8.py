"""Block-wise FP8 weights, the format of the official DeepSeek-V3/R1 checkpoints, both ways.

A quantized weight `W` ([rows, cols], float8_e4m3fn) comes with `W_scale_inv` (float32, [ceil(rows/b0),
ceil(cols/b1)] for `weight_block_size: [b0, b1]`); the real weight is `W.float() * scale` block by block, the last
blocks of a dimension that is not a multiple of the block being partial. Reading dequantizes one tensor at a time
(to bf16 unless asked otherwise): training stays in bf16. Rollout may take FP8 again (`rollout.weights_format: fp8`):
the sender quantizes each weight the checkpoint had quantized into the same names, shapes and dtypes, the
convention of DeepSeek's and SGLang's own quantizers (scale = amax / 448 per block, so every block uses e4m3's range).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from megarl.errors import UserError

SCALE_SUFFIX = "_scale_inv"
"""`model.layers.0.mlp.down_proj.weight` -> `model.layers.0.mlp.down_proj.weight_scale_inv`."""
QUANTIZED_LINEAR = re.compile(r"\.(self_attn|mlp)\.(.+\.)?\w*_proj\w*\.weight$")
"""The weights FP8 checkpoints (DeepSeek-V3/R1, Qwen3-FP8) quantize: the linear projections of attention and MLP
blocks, routed and shared experts included; not embeddings, output head, norms, the router's gate or its bias."""
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
DEEPSEEK_QUANTIZATION = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [128, 128],
}
"""quantization_config of deepseek-ai/DeepSeek-V3's config.json, as published."""
SUPPORTED = "quant_method 'fp8' with weight_block_size (block-wise e4m3, DeepSeek-V3/R1's format)"


@dataclass(frozen=True)
class BlockFP8:
    """A checkpoint's `quantization_config` of the one kind megarl reads and writes."""

    block: tuple[int, int] = (128, 128)
    config: dict = field(default_factory=dict, compare=False)
    """The quantization_config as the checkpoint gives it: an engine serving FP8 weights starts with it."""

    @classmethod
    def from_config(cls, raw: dict | None, where: str) -> BlockFP8 | None:
        """None for an unquantized model; UserError naming `where` for a method megarl cannot read."""
        if not raw:
            return None
        method = raw.get("quant_method")
        block = raw.get("weight_block_size")
        if method != "fp8" or not block:
            kind = f"quant_method {method!r}" + ("" if block or method != "fp8" else " without weight_block_size")
            raise UserError(
                f"{where}: quantization_config has {kind}; megarl reads only {SUPPORTED}. Other methods (awq, gptq, "
                "bitsandbytes, compressed-tensors, per-tensor fp8, mxfp4, ...) must be dequantized to bf16 first"
            )
        fmt = raw.get("fmt", "e4m3")
        if fmt != "e4m3" or len(block) != 2:
            raise UserError(f"{where}: quantization_config fmt={fmt!r}, weight_block_size={block}: expected e4m3, 2-D")
        return cls((int(block[0]), int(block[1])), dict(raw))

    @classmethod
    def of_folder(cls, folder: str | Path) -> BlockFP8 | None:
        """The quantization of a HF model folder, from its config.json (None when it has none)."""
        path = Path(folder) / "config.json"
        if not path.is_file():
            return None
        return cls.from_config(json.loads(path.read_text()).get("quantization_config"), str(path))

    def quantizes(self, name: str) -> bool:
        """Whether a weight of this name is stored in FP8 (modules_to_not_convert excepted)."""
        skipped = self.config.get("modules_to_not_convert") or ()
        return bool(QUANTIZED_LINEAR.search(name)) and not any(f"{module}." in name for module in skipped)

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, int]:
        rows, cols = shape
        return math.ceil(rows / self.block[0]), math.ceil(cols / self.block[1])


def _expand(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    """The per-block scale repeated over every element of its block (partial last blocks cut to `shape`)."""
    rows, cols = shape
    return scale.repeat_interleave(block[0], dim=0)[:rows].repeat_interleave(block[1], dim=1)[:, :cols]


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], dtype: torch.dtype):
    """`weight.float() * scale` block-wise, rounded once to `dtype`."""
    shape = tuple(weight.shape)
    expected = BlockFP8(block).scale_shape(shape)
    if tuple(scale_inv.shape) != expected:
        raise UserError(f"a scale of shape {tuple(scale_inv.shape)} for a weight of {shape}: expected {expected}")
    return (weight.float() * _expand(scale_inv.float(), shape, block)).to(dtype)


def quantize(weight: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 weight_scale_inv): each block scaled so that its largest magnitude is 448."""
    rows, cols = weight.shape
    b0, b1 = block
    padded = torch.nn.functional.pad(weight.float(), (0, -cols % b1, 0, -rows % b0))
    blocks = padded.unflatten(0, (-1, b0)).unflatten(2, (-1, b1))  # [row blocks, b0, col blocks, b1]
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))  # all-zero blocks: any scale, keep 1
    quantized = (weight.float() / _expand(scale, (rows, cols), block)).clamp(-FP8_MAX, FP8_MAX)
    return quantized.to(torch.float8_e4m3fn), scale


def strip_quantization(config_json: bytes) -> bytes:
    """config.json without its quantization_config: the description of the dequantized weights megarl holds."""
    raw = json.loads(config_json)
    if "quantization_config" not in raw:
        return config_json
    raw.pop("quantization_config")
    return (json.dumps(raw, indent=2) + "\n").encode()


def quantize_bucket(bucket: list[tuple[str, torch.Tensor]], fp8: BlockFP8) -> list[tuple[str, torch.Tensor]]:
    """A bucket of HF-named weights as the FP8 checkpoint holds them: each weight it quantizes becomes the FP8
    weight followed by its scale (so fused loads, e.g. DeepSeek's q_a_proj + kv_a_proj_with_mqa, stay together)."""
    out = []
    for name, tensor in bucket:
        if fp8.quantizes(name) and tensor.dim() == 2:
            weight, scale = quantize(tensor, fp8.block)
            out += [(name, weight), (name + SCALE_SUFFIX, scale)]
        else:
            out.append((name, tensor))
    return out
