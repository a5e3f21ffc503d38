"""megarl: RLHF / RLVR training for large language models on Megatron-Core."""

from megarl.runtime import lazy_compile as _lazy_compile

__version__ = "0.1.0"

_lazy_compile.install()  # before anything imports Megatron: its torch.compile decorators apply on first call
