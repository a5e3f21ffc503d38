"""megarl: RLHF / RLVR training for large language models on Megatron-Core."""

from megarl.runtime import lazy_compile as _lazy_compile
from megarl.runtime import transformers_index as _transformers_index

__version__ = "0.1.0"

_lazy_compile.install()  # before anything imports Megatron: its torch.compile decorators apply on first call
_transformers_index.install()  # before anything imports transformers: its import index comes from megarl's cache
