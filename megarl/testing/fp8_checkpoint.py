"""Tiny FP8 checkpoints in the format of the official DeepSeek-V3/R1 releases, for tests and the quickstart of the
671B path: float8_e4m3fn weights with float32 `weight_scale_inv` blocks and config.json's quantization_config."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from megarl.bridge.fp8 import DEEPSEEK_QUANTIZATION
from megarl.bridge.safetensors_io import SINGLE_FILE, HFCheckpoint
from megarl.testing.tiny_checkpoint import make_hf_checkpoint


def make_fp8_checkpoint(
    bf16_folder: str | Path,
    out_dir: str | Path,
    quantized: list[str],
    block: tuple[int, int] = (128, 128),
    seed: int = 0,
) -> Path:
    """An FP8 copy of a HF folder: each weight in `quantized` is replaced by random FP8 values and a random positive
    scale per block (not a quantization of the original: the reader is checked against `w.float() * scale`, not
    against the bf16 model). Everything else is copied unchanged."""
    src, out = Path(bf16_folder), Path(out_dir)
    shutil.copytree(src, out)
    for path in out.glob("*.safetensors*"):
        path.unlink()
    original = HFCheckpoint(src)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name in original.names:
        tensor = original.get(name)
        if name in quantized:
            rows, cols = tensor.shape
            values = torch.randn(rows, cols, generator=generator) * 100
            tensors[name] = values.clamp(-448, 448).to(torch.float8_e4m3fn)
            grid = (-(-rows // block[0]), -(-cols // block[1]))
            tensors[name + "_scale_inv"] = torch.rand(grid, generator=generator) * 1e-3 + 1e-4
        else:
            tensors[name] = tensor
    from safetensors.torch import save_file

    save_file(tensors, out / SINGLE_FILE, metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = dict(DEEPSEEK_QUANTIZATION, weight_block_size=list(block))
    config["torch_dtype"] = config["dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def make_tiny_fp8_deepseek(out_dir: str | Path, block: tuple[int, int] = (128, 128)) -> Path:
    """A DeepSeek-V3-shaped FP8 checkpoint (configs/models/tiny-deepseek-v3.json) with the tensors the real one
    quantizes in FP8 (megarl.bridge.fp8.QUANTIZED_LINEAR)."""
    from megarl.bridge.fp8 import QUANTIZED_LINEAR

    out_dir = Path(out_dir)
    bf16 = make_hf_checkpoint("tiny-deepseek-v3", out_dir.parent / f".{out_dir.name}-bf16", dtype=torch.bfloat16)
    quantized = [name for name in HFCheckpoint(bf16).names if QUANTIZED_LINEAR.search(name)]
    folder = make_fp8_checkpoint(bf16, out_dir, quantized, block)
    shutil.rmtree(bf16)
    return folder
