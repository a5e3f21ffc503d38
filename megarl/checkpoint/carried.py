"""What a model checkpoint carries unchanged from the folder its model was loaded from: the HF side files (config,
tokenizer, generation config) and the tensors the Megatron model does not hold (multi-token prediction layers, a
vision-language checkpoint's vision tower: Architecture.carried_part).

They are captured when the model is loaded and never read from that folder again: a run that resumed from
`checkpoints/step_21/actor` keeps saving long after rotation has deleted `step_21`. Side files are small and kept in
memory. Carried tensor files can be large (DeepSeek-V3's MTP layer is about 11 GB), so they are kept as open file
handles: an open file outlives its unlinking (POSIX; NFS and Lustre clients keep it too), and each save copies it
from the handle.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from megarl.bridge.safetensors_io import HFCheckpoint
from megarl.checkpoint.model_dir import EXTRA_DIR, HF_DIR, read_side_files, write_hf_tensors

_COPY_CHUNK_BYTES = 64 * 2**20


@dataclass
class CarriedFiles:
    side_files: dict[str, bytes] = field(default_factory=dict)
    """Top-level non-weight files of the HF folder (config.json, tokenizer files, ...), by name."""
    tensor_files: dict[str, BinaryIO] = field(default_factory=dict)
    """Open handles on the carried tensor files of a megarl checkpoint (safetensors shards, index), by relative name."""
    hf_tensors: tuple[Path, list[str]] | None = None
    """Carried tensors of a HF source folder (the user's model, which no run deletes): (folder, tensor names)."""

    @classmethod
    def from_checkpoint(cls, folder: Path) -> CarriedFiles:
        """A megarl checkpoint's side files (in memory) and carried tensor files (open handles)."""
        handles: dict[str, BinaryIO] = {}
        extra_dir = folder / EXTRA_DIR
        if extra_dir.is_dir():
            for path in sorted(p for p in extra_dir.rglob("*") if p.is_file()):
                handles[str(path.relative_to(extra_dir))] = open(path, "rb")  # noqa: SIM115 (kept open on purpose)
        return cls(read_side_files(folder / HF_DIR), handles)

    @classmethod
    def from_hf_folder(cls, folder: Path, carried_names: list[str]) -> CarriedFiles:
        """A HF model folder's side files (in memory) and the names of its tensors to carry."""
        return cls(read_side_files(folder), hf_tensors=(folder, carried_names) if carried_names else None)

    def write(self, folder: Path) -> None:
        """Write the side files into `folder/hf/` and the carried tensors (if any) into `folder/hf_extra/`."""
        self.write_side_files(folder / HF_DIR)
        self.write_tensor_files(folder / EXTRA_DIR)
        if self.hf_tensors is not None:
            source, names = self.hf_tensors
            write_hf_tensors(folder / EXTRA_DIR, HFCheckpoint(source), names)

    def write_side_files(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        for name, data in self.side_files.items():
            (folder / name).write_bytes(data)

    def write_tensor_files(self, folder: Path) -> None:
        """Copy every carried tensor file into `folder` (nothing when there are none)."""
        for name, handle in self.tensor_files.items():
            target = folder / name
            target.parent.mkdir(parents=True, exist_ok=True)
            handle.seek(0)
            with open(target, "wb") as out:
                shutil.copyfileobj(handle, out, _COPY_CHUNK_BYTES)


def carried_note(arch, hf_config, names: list[str]) -> str:
    """One line for the user: how many tensors are carried, and what they are (`arch`: the Architecture)."""
    parts: dict[str, list[str]] = {}
    for name in names:
        parts.setdefault(arch.carried_part(name, hf_config), []).append(name)
    described = "; ".join(f"{part}: {_common_prefix(group)}.*" for part, group in parts.items())
    return (
        f"carried {len(names)} tensors the Megatron model does not use through unchanged ({described}): converting "
        "back restores them"
    )


def _common_prefix(names: list[str]) -> str:
    split = [name.split(".") for name in names]
    common = []
    for pieces in zip(*split):
        if len(set(pieces)) > 1:
            break
        common.append(pieces[0])
    return ".".join(common[: min(len(s) for s in split) - 1]) or "*"
