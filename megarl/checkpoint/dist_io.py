"""Save and load the weights of live Megatron-Core model chunks as a distributed (torch_dist) checkpoint.

Checkpoints hold global tensors, so what one layout saves another loads: Megatron-Core reshards on load.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from megarl.checkpoint.model_dir import ModelCheckpointInfo
from megarl.errors import UserError
from megarl.runtime.parallel import ParallelConfig


def model_sharded_state_dict(chunks: Sequence[torch.nn.Module]) -> dict:
    """The chunks' sharded state dict; virtual pipeline chunks nest under model0, model1, ... (as Megatron-LM)."""
    if len(chunks) == 1:
        return chunks[0].sharded_state_dict()
    return {f"model{i}": chunk.sharded_state_dict() for i, chunk in enumerate(chunks)}


def in_process_write_results() -> None:
    """Megatron's checkpoint writer hands its write results over a queue served by a `multiprocessing.Manager`
    process, started with the spawn method on a process's first save: a fresh interpreter that imports the caller's
    main module (a Ray worker's), 5-10 s on a loaded machine. That queue is for asynchronous saves, finished in
    another process; megarl saves synchronously, in the process that reads the results, so a plain queue does."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def save_model_weights(chunks: Sequence[torch.nn.Module], folder: str | Path) -> None:
    """Collective over all ranks: write the chunks' weights into an empty `folder`."""
    from megatron.core import dist_checkpointing

    in_process_write_results()
    Path(folder).mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save(model_sharded_state_dict(chunks), str(folder))


def load_model_weights(chunks: Sequence[torch.nn.Module], folder: str | Path) -> None:
    """Collective over all ranks: fill the chunks' parameters from a checkpoint written at any layout."""
    from megatron.core import dist_checkpointing

    loaded = dist_checkpointing.load(model_sharded_state_dict(chunks), str(folder))
    if len(chunks) == 1:
        chunks[0].load_state_dict(loaded)
    else:
        for i, chunk in enumerate(chunks):
            chunk.load_state_dict(loaded[f"model{i}"])


def check_loadable(info: ModelCheckpointInfo, parallel: ParallelConfig, prefix: str = "") -> None:
    """The padded vocabulary is fixed when the checkpoint is written; a layout must split it evenly."""
    if info.padded_vocab_size % parallel.tp:
        valid = [t for t in range(1, info.padded_vocab_size + 1) if info.padded_vocab_size % t == 0 and t <= 64]
        raise UserError(
            f"{prefix}tp={parallel.tp} does not divide the checkpoint's padded vocabulary "
            f"({info.padded_vocab_size}); valid: {', '.join(map(str, valid))}, or re-convert with --tp {parallel.tp}"
        )
