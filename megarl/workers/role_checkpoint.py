"""A trained role's checkpoint: weights, optimizer state and RNG, each a Megatron distributed checkpoint.

    FOLDER/                 a megarl checkpoint folder (megarl.json, hf_tensors.json, hf/, model/): the weights
                            load at any layout and `megarl convert --from mcore --to hf FOLDER OUT` exports them
      optimizer/            optimizer state keyed after the model's parameters: it reshards like the weights
      rng/                  each model-parallel rank's RNG states (restored only at the layout that saved them)

Resuming at another TP/PP/EP layout restores weights and optimizer exactly; RNG streams are then reseeded from the
run seed (megarl derives its own sampling seeds from (seed, step), so a resumed run's numbers do not depend on it).
"""

from __future__ import annotations

import random
import warnings
from pathlib import Path

import numpy as np
import torch

from megarl.checkpoint.dist_io import in_process_write_results, model_sharded_state_dict
from megarl.checkpoint.model_dir import ModelCheckpointInfo
from megarl.checkpoint.model_io import save_model
from megarl.workers.role_model import RoleModel

OPTIMIZER_DIR = "optimizer"
RNG_DIR = "rng"


def save_role(model: RoleModel, folder: str | Path) -> None:
    """Collective over the role's ranks; `folder` must not exist (save_model stages it and renames it into place).
    The optimizer and RNG state go inside before the rename, so a complete folder always holds all three."""
    from megatron.core import dist_checkpointing

    folder = Path(folder)
    _check_finite(model)
    save_model(model.loaded, folder, extra_writer=lambda tmp: _save_state(model, tmp, dist_checkpointing))


def _check_finite(model: RoleModel) -> None:
    """Never write a checkpoint with NaN or Inf weights (collective: every rank learns whether any rank has one)."""
    import torch.distributed as dist

    from megarl.runtime.device import collective_device

    bad = torch.zeros(1, device=collective_device())
    for chunk in model.loaded.chunks:
        for param in chunk.parameters():
            if not torch.isfinite(param).all():
                bad[0] = 1
                break
    dist.all_reduce(bad)
    if bad.item():
        raise FloatingPointError("non-finite weights: refusing to write a checkpoint; the previous one stands")


def _save_state(model: RoleModel, tmp: Path, dist_checkpointing) -> None:
    in_process_write_results()
    if model.optimizer is not None:
        sharded = model.optimizer.sharded_state_dict(model_sharded_state_dict(model.loaded.chunks))
        (tmp / OPTIMIZER_DIR).mkdir(exist_ok=True)
        dist_checkpointing.save(sharded, str(tmp / OPTIMIZER_DIR))
    (tmp / RNG_DIR).mkdir(exist_ok=True)
    dist_checkpointing.save({"rng_state": _rng_sharded_object()}, str(tmp / RNG_DIR))


def load_role(model: RoleModel, folder: str | Path, load_optimizer: bool = True, load_weights: bool = True) -> None:
    """Collective: weights (any layout), optimizer state (any layout) and RNG (same layout only). Skip the weights
    when the model was just built from this folder."""
    from megatron.core import dist_checkpointing

    from megarl.checkpoint.dist_io import load_model_weights
    from megarl.checkpoint.model_dir import MODEL_DIR

    folder = Path(folder)
    info = ModelCheckpointInfo.load(folder)
    if load_weights:
        load_model_weights(model.loaded.chunks, folder / MODEL_DIR)
    if load_optimizer and model.optimizer is not None:
        if not (folder / OPTIMIZER_DIR / "metadata.json").is_file():
            raise FileNotFoundError(f"{folder / OPTIMIZER_DIR} holds no optimizer state to resume from")
        sharded = model.optimizer.sharded_state_dict(model_sharded_state_dict(model.loaded.chunks), is_loading=True)
        model.optimizer.load_sharded_state_dict(dist_checkpointing.load(sharded, str(folder / OPTIMIZER_DIR)))
    now = _current_layout(model.loaded.chunks[0].config)
    if info.layout == now and (folder / RNG_DIR / "metadata.json").is_file():
        loaded = dist_checkpointing.load({"rng_state": _rng_sharded_object()}, str(folder / RNG_DIR))
        _set_rng_state(loaded["rng_state"])
    else:
        warnings.warn(
            f"{folder} was saved at layout {info.layout}, now {now}: RNG streams are reseeded, "
            "weights and optimizer state are restored exactly",
            stacklevel=2,
        )


def _current_layout(config) -> dict[str, int]:
    from megarl.checkpoint.model_io import current_layout

    return current_layout(config)


def _rng_state() -> dict:
    from megatron.core import tensor_parallel

    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def _set_rng_state(state: dict) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _rng_sharded_object():
    """One object per (pipeline, tensor) rank, replicated over data and context parallelism (as Megatron-LM saves
    RNG)."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    shape = (ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size())
    offset = (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank())
    return ShardedObject(
        "rng_state", _rng_state(), shape, offset, replica_id=ps.get_data_parallel_rank(with_context_parallel=True)
    )
