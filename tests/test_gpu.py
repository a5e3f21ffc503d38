"""GPU tier: the same bridge checks on CUDA (NCCL, Transformer Engine layer spec where TE is installed).

Skipped on machines without a GPU; run on the GPU machine when one is lent.
"""

from __future__ import annotations

import pytest
import torch
from helpers import hf_logits, one_result, sample_ids

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def gpu_logits(path: str, input_ids: torch.Tensor):
    from megarl.checkpoint.model_io import load_model
    from megarl.models.specs import transformer_engine_available
    from megarl.runtime import cpu_compat
    from megarl.runtime.distributed import init_model_parallel
    from megarl.runtime.parallel import ParallelConfig
    from megarl.runtime.pipeline import forward_logits

    assert not cpu_compat.is_active()
    parallel = ParallelConfig()
    init_model_parallel(parallel)
    model = load_model(path, parallel, torch.float32)
    logits = forward_logits(model.chunks, input_ids.cuda(), model.vocab.size)
    return logits.cpu(), transformer_engine_available()


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mixtral", "tiny-deepseek-v3"])
def test_logits_match_hf_on_gpu(hf_checkpoint, name):
    from megarl.runtime.rank_pool import RankPool

    folder = hf_checkpoint(name)
    ids = sample_ids(1000)
    with RankPool(1) as pool:
        logits, _ = one_result(pool.run(gpu_logits, str(folder), ids))
    # TF32 matmuls and fused kernels on the GPU: a looser bound than the CPU's 1e-4.
    assert (logits - hf_logits(folder, ids)).abs().max().item() < 2e-2
