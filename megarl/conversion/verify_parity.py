"""`megarl convert --verify`: the Megatron checkpoint just written, loaded at the layout it was written for, gives the
logits of the HF model it came from.

Both models compute in fp32 on this machine's CPU: the HF model with transformers, the Megatron one on one process
per rank of the layout in a gloo world (megarl/runtime/rank_pool.py; `ParallelConfig.min_world_size` ranks), on
NUM_SEQUENCES fixed sequences of SEQUENCE_LENGTH token ids. They hold identical values (bf16, fp16 and dequantized
FP8 weights are exact in fp32), so what is left is the order of float operations, about 1e-6 on the tiny test models;
a wrong mapping (a transposed or mis-split tensor, a rotary or norm convention, a missing bias) moves the logits by
orders of magnitude more. Above MAX_LOGIT_DIFF the command fails; the report gives the largest |logit difference| and
the top-1 agreement either way.

Cost: both models in fp32 host memory at once (4 bytes per parameter each) and a forward of each: minutes and tens of
GB for a 7B model, which is why it is a flag.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from megarl.errors import RunFailure
from megarl.runtime.parallel import ParallelConfig

MAX_LOGIT_DIFF = 1e-3
"""Largest |logit difference| accepted (fp32 on both sides)."""
NUM_SEQUENCES = 2
SEQUENCE_LENGTH = 32


@dataclass(frozen=True)
class ParityReport:
    max_logit_diff: float
    top1_agreement: float
    """Fraction of positions where both models rank the same token first."""
    tokens: int
    ranks: int

    def describe(self, parallel: ParallelConfig) -> str:
        layout = " ".join(f"{axis}={size}" for axis, size in parallel.layout_dict().items())
        return (
            f"largest |logit difference| {self.max_logit_diff:.3g} (tolerance {MAX_LOGIT_DIFF:g}), top-1 agreement "
            f"{100 * self.top1_agreement:.1f}% over {self.tokens} tokens, Megatron at {layout} on {self.ranks} ranks"
        )


def fixed_token_ids(vocab_size: int) -> torch.Tensor:
    """The sequences both models read: the same on every run."""
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab_size, (NUM_SEQUENCES, SEQUENCE_LENGTH), generator=generator)


def verify_conversion(hf_dir: str | Path, mcore_dir: str | Path, parallel: ParallelConfig) -> ParityReport:
    """Compare the logits; RunFailure (naming both folders and the numbers) above MAX_LOGIT_DIFF."""
    from megarl.models.hf_config import load_hf_config
    from megarl.runtime.rank_pool import RankPool

    ids = fixed_token_ids(load_hf_config(hf_dir).vocab_size)
    expected = _hf_logits(Path(hf_dir), ids)
    ranks = parallel.min_world_size
    with RankPool(ranks, timeout_s=3600) as pool:  # a 7B model in fp32 on CPU takes minutes
        answers = [a for a in pool.run(megatron_logits, str(mcore_dir), parallel, ids) if a is not None]
    logits = answers[0]
    report = ParityReport(
        max_logit_diff=(logits - expected).abs().max().item(),
        top1_agreement=(logits.argmax(-1) == expected.argmax(-1)).float().mean().item(),
        tokens=ids.numel(),
        ranks=ranks,
    )
    if not report.max_logit_diff <= MAX_LOGIT_DIFF:  # NaN fails too
        raise RunFailure(
            f"--verify: the Megatron checkpoint {mcore_dir} does not reproduce the HF model {hf_dir}: "
            f"{report.describe(parallel)}. Do not train from it; please report the model type and layout."
        )
    return report


def _hf_logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from megarl.models.hf_config import load_hf_config

    hf_logging.disable_progress_bar()  # a bar for loading a model the report line does not mention
    model = AutoModelForCausalLM.from_pretrained(folder, config=load_hf_config(folder), dtype=torch.float32)
    with torch.no_grad():
        return model(ids).logits


def megatron_logits(path: str, parallel: ParallelConfig, ids: torch.Tensor) -> torch.Tensor | None:
    """Rank side: load `path` (HF or megarl checkpoint) at `parallel` in fp32; full logits from the first TP rank of
    the last stage's first data-parallel replica, None on every other rank."""
    from megatron.core import parallel_state as ps

    from megarl.checkpoint.model_io import load_model
    from megarl.models.pipeline import forward_logits
    from megarl.runtime.distributed import init_model_parallel

    init_model_parallel(parallel)
    model = load_model(path, parallel, torch.float32)
    with torch.no_grad():
        logits = forward_logits(model.chunks, ids, model.vocab.size)
    reporting = ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
    return logits if logits is not None and reporting else None
