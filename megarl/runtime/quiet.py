"""Silence warnings that are expected and say nothing actionable (e.g. no Apex/TE on a CPU machine).

Megatron-Core warns at import time, so this runs before it is imported: at CLI start and in every rank process.
"""

from __future__ import annotations

import warnings

_EXPECTED = (
    r"Transformer Engine and Apex are not installed",
    r"Apex is not installed",
    r"full scope is deprecated",  # Megatron's own default for cuda_graph_scope
    r"Please use DTensor instead",  # torch DCP on Megatron's ShardedTensor path
    r"`load_state_dict` is deprecated",  # Megatron's torch_dist loader calls the old DCP entry point
    r"`torch.distributed.all_gather_into_tensor` is deprecated",  # called inside Megatron-Core
    r"`torch.distributed.reduce_scatter_tensor` is deprecated",  # likewise
    # Training advice printed for every TP x EP config; training configs enforce sequence parallelism themselves.
    r"When using expert parallelism and tensor parallelism for training",
)


def silence_expected_warnings() -> None:
    for pattern in _EXPECTED:
        warnings.filterwarnings("ignore", message=pattern)
