"""One seed for every random number generator a run touches."""

from __future__ import annotations

import random

import numpy as np
import torch


def set_seed(seed: int) -> None:
    """Seed Python, NumPy and torch; once Megatron's parallel state exists, also its model-parallel RNG tracker.

    Megatron offsets the tracker's seed by the tensor-parallel rank, so dropout differs across TP shards where it
    must and agrees across data-parallel replicas.
    """
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed)
