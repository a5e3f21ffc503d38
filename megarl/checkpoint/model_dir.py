"""The megarl model checkpoint folder: a Megatron distributed checkpoint plus what it takes to go back to HF.

    DST/
      megarl.json        what the checkpoint holds: architecture, vocabulary padding, dtype, layout written at
      hf_tensors.json    the source HF checkpoint's tensors (name, dtype, shape), in order: export reproduces them
      hf/                config.json, generation_config.json, tokenizer and other non-weight files of the HF model
      hf_extra/          (optional) HF tensors the Megatron model does not hold, carried through unchanged
                         (DeepSeek-V3's multi-token-prediction layers), as safetensors
      model/             Megatron-Core torch_dist checkpoint (metadata.json is written last: present = complete)

The Megatron checkpoint stores global tensors, so it loads at any TP/PP/VPP layout whose TP divides the padded
vocabulary; `layout` records only what it was written for.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from megarl.bridge.fp8 import strip_quantization
from megarl.bridge.mappings import VocabInfo
from megarl.bridge.safetensors_io import HFCheckpoint, ShardedSafetensorsWriter, TensorSpec
from megarl.errors import UserError
from megarl.models.hf_config import dtype_name, parse_dtype

FORMAT = "megarl-mcore"
FORMAT_VERSION = 1
INFO_FILE = "megarl.json"


def is_megarl_checkpoint(path: str | Path) -> bool:
    return (Path(path) / INFO_FILE).is_file()


def hf_config_dir(path: str | Path) -> Path:
    """The folder holding config.json: the HF folder itself, or a megarl checkpoint's hf/."""
    return Path(path) / HF_DIR if is_megarl_checkpoint(path) else Path(path)


MANIFEST_FILE = "hf_tensors.json"
HF_DIR = "hf"
EXTRA_DIR = "hf_extra"
MODEL_DIR = "model"

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


@dataclass
class ModelCheckpointInfo:
    architecture: str
    vocab_size: int
    padded_vocab_size: int
    params_dtype: str
    layout: dict[str, int] = field(default_factory=dict)
    source: str = ""
    quantization: dict | None = None
    """quantization_config of the FP8 HF checkpoint the weights came from (held dequantized here)."""
    format: str = FORMAT
    format_version: int = FORMAT_VERSION

    @property
    def vocab(self) -> VocabInfo:
        return VocabInfo(self.vocab_size, self.padded_vocab_size)

    @property
    def dtype(self):
        return parse_dtype(self.params_dtype, key=f"{INFO_FILE} params_dtype")

    def save(self, folder: Path) -> None:
        (folder / INFO_FILE).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, folder: str | Path) -> ModelCheckpointInfo:
        folder = Path(folder)
        path = folder / INFO_FILE
        if not folder.is_dir():
            raise UserError(f"{folder} is not a folder: expected a megarl Megatron checkpoint folder")
        if not path.is_file():
            raise UserError(
                f"{path} does not exist: {folder} is not a megarl Megatron checkpoint "
                f"(one written by `megarl convert --from hf --to mcore` or by training)"
            )
        try:
            raw = json.loads(path.read_text())
            info = cls(**raw)
        except (OSError, ValueError, TypeError) as err:
            raise UserError(f"{path} is not a valid megarl checkpoint description ({err})") from err
        if info.format != FORMAT or info.format_version > FORMAT_VERSION:
            raise UserError(f"{path}: format {info.format} v{info.format_version} is not readable by this megarl")
        if not (folder / MODEL_DIR / "metadata.json").is_file():
            raise UserError(f"{folder / MODEL_DIR} holds no complete Megatron checkpoint (metadata.json missing)")
        if not (folder / HF_DIR / "config.json").is_file():
            raise UserError(f"{folder / HF_DIR}/config.json is missing: the checkpoint cannot be mapped back to HF")
        return info


def save_manifest(folder: Path, specs: list[TensorSpec]) -> None:
    rows = [[spec.name, dtype_name(spec.dtype), list(spec.shape)] for spec in specs]
    (folder / MANIFEST_FILE).write_text(json.dumps(rows) + "\n")


def load_manifest(folder: Path) -> list[TensorSpec] | None:
    path = Path(folder) / MANIFEST_FILE
    if not path.is_file():
        return None
    try:
        return [
            TensorSpec(name, parse_dtype(dtype), tuple(shape)) for name, dtype, shape in json.loads(path.read_text())
        ]
    except (OSError, ValueError, TypeError) as err:
        raise UserError(f"{path} is not a valid tensor manifest ({err})") from err


def is_weight_file(name: str) -> bool:
    return name.endswith(_WEIGHT_SUFFIXES) or name in _WEIGHT_INDEXES


def hf_side_files(src: Path) -> list[Path]:
    """The top-level non-weight files of a HF model folder (config, tokenizer, generation config, docs)."""
    return [path for path in sorted(Path(src).iterdir()) if path.is_file() and not is_weight_file(path.name)]


def read_side_files(src: Path) -> dict[str, bytes]:
    """`hf_side_files(src)` by name; config.json without a quantization_config (the weights megarl writes are never
    quantized: FP8 checkpoints are read dequantized)."""
    files = {path.name: path.read_bytes() for path in hf_side_files(src)}
    if "config.json" in files:
        files["config.json"] = strip_quantization(files["config.json"])
    return files


def copy_hf_side_files(src: Path, dst: Path) -> list[str]:
    """Write `read_side_files(src)` into `dst`."""
    dst.mkdir(parents=True, exist_ok=True)
    files = read_side_files(src)
    for name, data in files.items():
        (dst / name).write_bytes(data)
    return list(files)


def write_hf_tensors(
    folder: Path, checkpoint: HFCheckpoint, names: list[str], max_shard_bytes: int = 5 * 10**9
) -> None:
    """Copy some tensors of a HF checkpoint, unchanged, into a safetensors folder (one tensor in memory at a time)."""
    folder.mkdir(parents=True, exist_ok=True)
    writer = ShardedSafetensorsWriter(folder, [checkpoint.spec(name) for name in names], max_shard_bytes)
    for name in names:
        writer.write(name, checkpoint.get(name))
    writer.close()
