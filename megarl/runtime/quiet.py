"""Silence warnings that are expected and say nothing actionable (e.g. no Apex/TE on a CPU machine).

Megatron-Core warns at import time, so this runs before it is imported: at CLI start and in every rank process.
"""

from __future__ import annotations

import logging
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


_EXPECTED_LOG_LINES = {
    # Ray 2.5x on every local start while RAY_AUTH_MODE is unset: its default (token authentication) is on, which is
    # what megarl wants; setting the mode explicitly before `ray.init` is not read by an already imported Ray.
    "ray._private.authentication.authentication_token_setup": "Token authentication is enabled",
}


class _DropMessage(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefix)


def silence_expected_warnings() -> None:
    for pattern in _EXPECTED:
        warnings.filterwarnings("ignore", message=pattern)
    for logger, prefix in _EXPECTED_LOG_LINES.items():
        if not any(isinstance(f, _DropMessage) for f in logging.getLogger(logger).filters):
            logging.getLogger(logger).addFilter(_DropMessage(prefix))
