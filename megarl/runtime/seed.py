"""One seed for every random number generator a run touches."""

from __future__ import annotations

import random
import sys

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
    parallel_state = sys.modules.get("megatron.core.parallel_state")  # no Megatron import for plain callers
    if parallel_state is not None and parallel_state.model_parallel_is_initialized():
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed)
