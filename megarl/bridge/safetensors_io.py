"""HF safetensors checkpoints: a lazy reader and a streaming sharded writer, both with bounded memory.

The reader validates every shard's header when it opens (a truncated or corrupted file fails there, naming the
file), then reads one tensor at a time with plain reads: no memory map, whose touched pages would count against the
process for as long as the file stays mapped. The writer knows every tensor's name, dtype and shape
in advance, writes each file's header first and streams the data after it, so it holds one tensor at a time.

Both take rows of tensors stacked over experts by the weight table's names, `name[i]` (megarl.bridge.mappings):
the reader reads row i alone, the writer joins a tensor's rows and writes it once all have arrived.

The reader can also list a checkpoint's fused experts one tensor per expert (`split_fused_experts`: Qwen3.5 as
published stores `mlp.experts.gate_up_proj` [experts, 2 x ffn, hidden], each expert's gate rows then its up rows,
and `mlp.experts.down_proj` [experts, hidden, ffn]): `mlp.experts.{e}.gate_proj.weight` and the others are
contiguous byte ranges of those tensors, read as tensors of their own.
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from megarl.bridge.fp8 import SCALE_SUFFIX, BlockFP8, dequantize
from megarl.bridge.mappings import stacked_row
from megarl.errors import UserError

INDEX_FILE = "model.safetensors.index.json"
_FUSED_EXPERTS = re.compile(r"(.*\.mlp\.experts\.)(gate_up_proj|down_proj)")
"""A tensor of all of a layer's experts (`HFCheckpoint` split_fused_experts): (its prefix, which projection)."""
SINGLE_FILE = "model.safetensors"

DTYPE_CODES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
DTYPES_BY_CODE = {code: dtype for dtype, code in DTYPE_CODES.items()}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        numel = 1
        for dim in self.shape:
            numel *= dim
        return numel * self.dtype.itemsize


def join_stacked_rows(specs: Iterable[TensorSpec]) -> list[TensorSpec]:
    """The specs with the rows of each stacked tensor (`name[0]`, `name[1]`...) replaced by the whole tensor, at the
    place of its first row."""
    joined: dict[str, TensorSpec] = {}
    rows: dict[str, int] = {}
    for spec in specs:
        row = stacked_row(spec.name)
        if row is None:
            joined[spec.name] = spec
        else:
            joined.setdefault(row[0], replace(spec, name=row[0]))
            rows[row[0]] = rows.get(row[0], 0) + 1
    return [replace(spec, shape=(rows[name], *spec.shape)) if name in rows else spec for name, spec in joined.items()]


def read_header(path: Path) -> tuple[dict[str, dict], int]:
    """A safetensors file's header (name -> dtype, shape, offsets), checked against the file's size, and the
    position where its data section starts."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len > size - 8:
                raise ValueError(f"header claims {header_len} bytes but the file has {size}")
            header = json.loads(f.read(header_len))
    except FileNotFoundError as err:
        raise UserError(f"{path} does not exist (it is listed in the checkpoint's index)") from err
    except (OSError, ValueError, struct.error) as err:
        raise UserError(f"{path} is not a valid safetensors file ({err}): is it truncated or corrupted?") from err
    header.pop("__metadata__", None)
    for name, entry in header.items():
        _check_entry(path, name, entry)
    data_end = max((entry["data_offsets"][1] for entry in header.values()), default=0)
    if 8 + header_len + data_end != size:
        raise UserError(
            f"{path} is not a valid safetensors file: its header describes {8 + header_len + data_end} bytes but the "
            f"file has {size}: is it truncated or corrupted?"
        )
    return header, 8 + header_len


def _check_entry(path: Path, name: str, entry: object) -> None:
    """A header entry has a dtype, a shape of sizes and data offsets that span exactly that many bytes."""
    problem = None
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
        missing = sorted({"dtype", "shape", "data_offsets"} - set(entry if isinstance(entry, dict) else ()))
        problem = f"has no {', '.join(missing)}"
    else:
        shape, offsets = entry["shape"], entry["data_offsets"]
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            problem = f"has shape {shape!r}: expected a list of sizes"
        elif not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            problem = f"has data_offsets {offsets!r}: expected [start, end]"
        elif not 0 <= offsets[0] <= offsets[1]:
            problem = f"has data_offsets {offsets!r}: the end is before the start"
        elif entry["dtype"] in DTYPES_BY_CODE:
            expected = TensorSpec(name, DTYPES_BY_CODE[entry["dtype"]], tuple(shape)).nbytes
            if offsets[1] - offsets[0] != expected:
                problem = f"spans {offsets[1] - offsets[0]} bytes but {entry['dtype']} {shape} needs {expected}"
    if problem is not None:
        raise UserError(f"{path} is not a valid safetensors file: tensor {name} {problem}: is it corrupted?")


class HFCheckpoint:
    """The weights of a HF model folder (`model.safetensors` or a sharded set with its index), read lazily.

    A block-wise FP8 checkpoint (config.json's quantization_config, megarl.bridge.fp8) reads as its dequantized
    weights in `dequantize_to`: its `*_scale_inv` tensors are consumed, not listed. raw=True reads what is stored.
    rename: the name each stored tensor is listed and read under (a vision-language checkpoint's language model
    under the text model's names: megarl.models.hf_config.read_hf_weights).
    """

    def __init__(
        self,
        folder: str | Path,
        dequantize_to: torch.dtype = torch.bfloat16,
        raw: bool = False,
        rename: Callable[[str], str] | None = None,
        split_fused_experts: bool = False,
    ):
        self.folder = Path(folder)
        rename = rename or (lambda name: name)
        weight_map = {rename(name): file_name for name, file_name in self._weight_map().items()}
        self._specs: dict[str, TensorSpec] = {}
        self._file_of: dict[str, str] = {}
        self._offset_of: dict[str, int] = {}  # absolute position of each tensor's bytes in its file
        for file_name in dict.fromkeys(weight_map.values()):
            header, data_start = read_header(self.folder / file_name)
            for stored_name, entry in header.items():
                name = rename(stored_name)
                if entry["dtype"] not in DTYPES_BY_CODE:
                    raise UserError(f"{self.folder / file_name}: tensor {name} has unsupported dtype {entry['dtype']}")
                self._specs[name] = TensorSpec(name, DTYPES_BY_CODE[entry["dtype"]], tuple(entry["shape"]))
                self._file_of[name] = file_name
                self._offset_of[name] = data_start + entry["data_offsets"][0]
        missing = [name for name, file_name in weight_map.items() if self._file_of.get(name) != file_name]
        if missing:
            raise UserError(f"{self.folder / INDEX_FILE} lists tensors missing from their files: {missing[:5]}")
        self.names: list[str] = list(weight_map) if self._has_index else list(self._specs)
        if split_fused_experts:
            self._split_fused_experts()
        self.bytes_read = 0
        """Bytes read from the files so far (what sliced reads save shows here)."""
        self._stored = dict(self._specs)
        self._scale_of: dict[str, str] = {}
        self.quantization = None if raw else BlockFP8.of_folder(self.folder)
        if self.quantization is not None:
            self._read_as_dequantized(dequantize_to)

    def _split_fused_experts(self) -> None:
        """List each fused expert tensor as one tensor per expert and projection, in its place (module docstring):
        each a contiguous range of the fused tensor's bytes, so every read below works on it unchanged."""
        names = []
        for name in self.names:
            match = _FUSED_EXPERTS.fullmatch(name)
            spec = self._specs[name]
            if match is None or len(spec.shape) != 3:
                names.append(name)
                continue
            prefix, kind = match.groups()
            experts, rows, columns = spec.shape
            parts = (("gate_proj", 0), ("up_proj", rows // 2)) if kind == "gate_up_proj" else (("down_proj", 0),)
            part_rows = rows // 2 if kind == "gate_up_proj" else rows
            if kind == "gate_up_proj" and rows % 2:
                raise UserError(f"{self.folder}: {name} has shape {spec.shape}: expected [experts, 2 x ffn, hidden]")
            row_bytes = columns * spec.dtype.itemsize
            for expert in range(experts):
                for projection, first_row in parts:
                    view = f"{prefix}{expert}.{projection}.weight"
                    self._specs[view] = TensorSpec(view, spec.dtype, (part_rows, columns))
                    self._file_of[view] = self._file_of[name]
                    self._offset_of[view] = self._offset_of[name] + (expert * rows + first_row) * row_bytes
                    names.append(view)
            del self._specs[name]
        self.names = names

    def _read_as_dequantized(self, dtype: torch.dtype) -> None:
        """List each quantized weight as its dequantized self and hide the scales; bad pairs are named now."""
        scales = [name for name in self.names if name.endswith(SCALE_SUFFIX)]
        for scale in scales:
            weight = scale.removesuffix(SCALE_SUFFIX)
            if weight not in self._specs:
                raise UserError(f"{self.folder}: {scale} has no weight {weight} to scale")
            stored, expected = self._specs[weight], self.quantization.scale_shape(self._specs[weight].shape)
            if stored.dtype != torch.float8_e4m3fn or self._specs[scale].shape != expected:
                raise UserError(
                    f"{self.folder}: {weight} ({stored.dtype}, {stored.shape}) with {scale} of shape "
                    f"{self._specs[scale].shape}: expected a float8_e4m3fn weight and a scale of shape {expected} "
                    f"(weight_block_size {list(self.quantization.block)})"
                )
            self._scale_of[weight] = scale
            self._specs[weight] = TensorSpec(weight, dtype, stored.shape)
        unscaled = [n for n in self.names if self._specs[n].dtype == torch.float8_e4m3fn and n not in self._scale_of]
        if unscaled:
            raise UserError(f"{self.folder}: FP8 tensors without a {SCALE_SUFFIX} tensor: {unscaled[:5]}")
        self.names = [name for name in self.names if not name.endswith(SCALE_SUFFIX)]

    @property
    def quantized_names(self) -> list[str]:
        """The weights stored in FP8 (listed dequantized), in checkpoint order."""
        return [name for name in self.names if name in self._scale_of]

    def _weight_map(self) -> dict[str, str]:
        index = self.folder / INDEX_FILE
        self._has_index = index.is_file()
        if self._has_index:
            try:
                return json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError) as err:
                raise UserError(f"{index} is not a valid safetensors index ({err})") from err
        single = self.folder / SINGLE_FILE
        if not single.is_file():
            raise UserError(
                f"{self.folder} holds no safetensors weights: expected {SINGLE_FILE} or {INDEX_FILE} "
                "(PyTorch .bin checkpoints are not read; re-save the model with save_pretrained)"
            )
        return dict.fromkeys(read_header(single)[0], SINGLE_FILE)

    def spec(self, name: str) -> TensorSpec:
        row = stacked_row(name)
        if row is None:
            return self._specs[name]
        whole = self._specs[row[0]]
        return TensorSpec(name, whole.dtype, whole.shape[1:])

    def file_of(self, name: str) -> str:
        """The file (in the folder) that stores `name`."""
        return self._file_of[name]

    def __contains__(self, name: str) -> bool:
        row = stacked_row(name)
        if row is None:
            return name in self._specs
        whole = self._specs.get(row[0])
        return whole is not None and len(whole.shape) > 0 and row[1] < whole.shape[0]

    def specs(self) -> list[TensorSpec]:
        return [self._specs[name] for name in self.names]

    def get(self, name: str) -> torch.Tensor:
        """One tensor, read from its file into fresh memory (dequantized if it is stored in FP8)."""
        row = stacked_row(name)
        if row is not None:
            return self.get_slice(row[0], 0, row[1], row[1] + 1)[0]
        scale = self._scale_of.get(name)
        if scale is not None:
            return dequantize(self._read(name), self._read(scale), self.quantization.block, self._specs[name].dtype)
        return self._read(name)

    def get_slice(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """`get(name).narrow(dim, start, stop - start)`, reading only those bytes from the file (rows: one
        contiguous range; columns of a matrix: a strided read of each row's part). FP8 weights read whole."""
        if name in self._scale_of or dim > 1 or stacked_row(name) is not None:
            return self.get(name).narrow(dim, start, stop - start).clone()
        spec = self._stored[name]
        if dim == 0:
            row_bytes = spec.nbytes // max(spec.shape[0], 1)
            return self._read(name, start * row_bytes, (stop - start) * row_bytes).view(stop - start, *spec.shape[1:])
        rows, item = spec.shape[0], spec.dtype.itemsize
        columns = int(spec.nbytes // max(rows, 1) // item)
        path = self.folder / self._file_of[name]
        table = np.memmap(path, dtype=np.uint8, mode="r", offset=self._offset_of[name], shape=(rows, columns * item))
        part = torch.from_numpy(np.ascontiguousarray(table[:, start * item : stop * item]))
        self.bytes_read += part.numel()
        return part.view(spec.dtype).view(rows, stop - start, *spec.shape[2:])

    def _read(self, name: str, skip: int = 0, length: int | None = None) -> torch.Tensor:
        """The stored bytes of `name` (or `length` bytes from `skip` on), as the stored dtype and shape (or flat)."""
        if name not in self._file_of:
            raise UserError(f"{self.folder} has no tensor named {name!r}")
        spec = self._stored[name]
        size = spec.nbytes if length is None else length
        data = torch.empty(size, dtype=torch.uint8)
        with (self.folder / self._file_of[name]).open("rb") as f:
            f.seek(self._offset_of[name] + skip)
            if f.readinto(memoryview(data.numpy())) != size:
                raise UserError(f"{self.folder / self._file_of[name]} ended inside tensor {name}: is it truncated?")
        self.bytes_read += size
        return data.view(spec.dtype) if length is not None else data.view(spec.dtype).reshape(spec.shape)


def shard_file_names(num_shards: int) -> list[str]:
    if num_shards == 1:
        return [SINGLE_FILE]
    return [f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors" for i in range(num_shards)]


def plan_shards(specs: Sequence[TensorSpec], max_shard_bytes: int) -> list[list[TensorSpec]]:
    """Split tensors, in order, into files of at most `max_shard_bytes` (a larger tensor gets a file of its own)."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        if shards[-1] and size + spec.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards


def _header_bytes(shard: Sequence[TensorSpec]) -> bytes:
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for spec in shard:
        header[spec.name] = {
            "dtype": DTYPE_CODES[spec.dtype],
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


class ShardedSafetensorsWriter:
    """Writes `specs` as a HF checkpoint in `folder`; tensors must arrive through `write` in the order of `specs`.

    A stacked tensor may arrive as its rows (`name[i]`, in any order, mixed with the rows of other stacked tensors):
    it is written when its last row arrives, and comes in the order of `specs` then. Memory: the rows waiting.
    """

    def __init__(self, folder: str | Path, specs: Sequence[TensorSpec], max_shard_bytes: int):
        self.folder = Path(folder)
        self._rows: dict[str, dict[int, torch.Tensor]] = {}
        self._row_counts = {spec.name: spec.shape[0] for spec in specs if spec.shape}
        self.shards = plan_shards(specs, max_shard_bytes)
        self.file_names = shard_file_names(len(self.shards))
        self._queue = [(i, spec) for i, shard in enumerate(self.shards) for spec in shard]
        self._next = 0
        self._file = None
        self._file_index = -1

    def write(self, name: str, tensor: torch.Tensor) -> None:
        row = stacked_row(name)
        if row is not None:
            rows = self._rows.setdefault(row[0], {})
            rows[row[1]] = tensor
            if len(rows) < self._row_counts.get(row[0], 0):
                return
            name, tensor = row[0], torch.stack([rows[i] for i in sorted(self._rows.pop(row[0]))])
        if self._next >= len(self._queue):
            raise RuntimeError(f"unexpected tensor {name}: every planned tensor was already written")
        shard_index, spec = self._queue[self._next]
        if name != spec.name or tensor.dtype != spec.dtype or tuple(tensor.shape) != spec.shape:
            raise RuntimeError(
                f"expected {spec.name} {spec.dtype} {spec.shape} next, got {name} {tensor.dtype} {tuple(tensor.shape)}"
            )
        if shard_index != self._file_index:
            self._open(shard_index)
        flat = tensor.detach().contiguous().reshape(-1)
        if flat.numel():
            self._file.write(memoryview(flat.view(torch.uint8).numpy()))
        self._next += 1

    def write_all(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in tensors:
            self.write(name, tensor)

    def _open(self, shard_index: int) -> None:
        self._close_file()
        self._file = (self.folder / self.file_names[shard_index]).open("wb")
        self._file.write(_header_bytes(self.shards[shard_index]))
        self._file_index = shard_index

    def _close_file(self) -> None:
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None

    def close(self) -> None:
        """Finish the last file and write the index (for more than one file); every planned tensor must be in."""
        if self._next != len(self._queue):
            raise RuntimeError(f"{len(self._queue) - self._next} planned tensors were never written")
        self._close_file()
        if len(self.shards) > 1:
            weight_map = {spec.name: self.file_names[i] for i, shard in enumerate(self.shards) for spec in shard}
            total = sum(spec.nbytes for shard in self.shards for spec in shard)
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (self.folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
