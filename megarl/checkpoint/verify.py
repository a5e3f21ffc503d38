"""Checks of a checkpoint before a run builds anything from it: damage is named by file and tensor at pre-flight,
not met as a traceback inside the workers after the run folder is written.

- a HF folder: every safetensors header is well formed (megarl.bridge.safetensors_io.read_header), and the stored
  shapes agree with config.json for the tensors of the first layers, the embeddings and the head (a wrong config
  or a mixed-up checkpoint shows there; the workers' loader checks every tensor again);
  the shape comparison builds the model on the meta device, whose import alone takes seconds of a run's start-up,
  so a pass is remembered (a file named by a hash of everything it compared: config, every tensor's name, shape
  and file, the transformers version) in MEGARL_CACHE_DIR (default ~/.cache/megarl) and not repeated;
- a Megatron distributed checkpoint (`model/`, `optimizer/`): every file its `.metadata` refers to exists and holds
  the bytes it should (a lost or truncated `.distcp` shard).
"""

from __future__ import annotations

import copy
import hashlib
import os
from pathlib import Path

from megarl.errors import UserError
from megarl.runtime.cache import cache_dir

LAYERS_CHECKED = 4
"""Decoder layers whose tensors are compared with config.json (enough for dense and MoE layers of every model
megarl supports: DeepSeek-V3's first three are dense)."""


def check_hf_weights(folder: str | Path, hf_config) -> int:
    """Stored shapes against the shapes config.json gives (embeddings, head, norms and the first LAYERS_CHECKED
    layers); returns how many tensors were compared. A UserError names the file, the tensor and both shapes."""
    import torch
    from transformers import AutoModelForCausalLM

    from megarl.models.hf_config import read_hf_weights

    folder = Path(folder)
    # every header read and checked; a vision-language checkpoint's language model under the text model's names
    checkpoint = read_hf_weights(folder, raw=True)
    passed = _passed_before(checkpoint, hf_config)
    if passed.is_file():
        return int(passed.read_text())
    config = copy.deepcopy(hf_config)
    config.num_hidden_layers = min(config.num_hidden_layers, LAYERS_CHECKED)
    if isinstance(getattr(config, "layer_types", None), list):  # one entry per layer (sliding/full attention)
        config.layer_types = config.layer_types[: config.num_hidden_layers]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    expected = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    compared = 0
    for name in checkpoint.names:
        if name not in expected:
            continue
        stored = checkpoint.spec(name).shape
        if stored != expected[name]:
            raise UserError(
                f"{folder / checkpoint.file_of(name)}: tensor {name} has shape {list(stored)}, but "
                f"{folder / 'config.json'} gives {list(expected[name])}: the weights and the config do not belong "
                "together"
            )
        compared += 1
    _remember(passed, str(compared))
    return compared


def _passed_before(checkpoint, hf_config) -> Path:
    """The file that says check_hf_weights passed on exactly these inputs (it exists once it has)."""
    import transformers

    digest = hashlib.sha256(transformers.__version__.encode())
    digest.update(hf_config.to_json_string(use_diff=False).encode())
    for name in sorted(checkpoint.names):
        digest.update(f"\0{name}\0{checkpoint.file_of(name)}\0{list(checkpoint.spec(name).shape)}".encode())
    return cache_dir() / "verified-weights" / digest.hexdigest()


def _remember(path: Path, text: str) -> None:
    """Write `path` whole or not at all; a cache that cannot be written (read-only home) is skipped."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        partial.write_text(text)
        os.replace(partial, path)
    except OSError:
        pass


def check_dist_checkpoint(folder: str | Path) -> None:
    """Every file a torch distributed checkpoint's `.metadata` refers to exists and is long enough; a UserError
    names the first missing or short one."""
    from torch.distributed.checkpoint import FileSystemReader

    folder = Path(folder)
    try:
        metadata = FileSystemReader(str(folder)).read_metadata()
    except FileNotFoundError:
        raise UserError(f"{folder} has no .metadata: the checkpoint is incomplete") from None
    except Exception as err:  # a truncated or foreign pickle
        raise UserError(f"{folder}/.metadata cannot be read ({type(err).__name__}): is it corrupted?") from None
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for relative, size in sorted(needed.items()):
        path = folder / relative
        if not path.is_file():
            raise UserError(f"{path} is missing: the checkpoint in {folder} is incomplete ({len(needed)} files)")
        if path.stat().st_size < size:
            raise UserError(f"{path} holds {path.stat().st_size} bytes, its metadata {size}: it is truncated")


def check_megarl_checkpoint(folder: str | Path) -> None:
    """Every distributed checkpoint inside a megarl checkpoint folder (a role's `model/`, `optimizer/`, `rng/`, or
    every role of a run's `step_N/`) is complete (check_dist_checkpoint)."""
    for metadata in sorted(Path(folder).rglob(".metadata")):
        check_dist_checkpoint(metadata.parent)
