"""Forward passes through Megatron-Core's pipeline schedules (1F1B, interleaved, or none), without gradients."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


@torch.no_grad()
def forward_only(
    chunks: Sequence[torch.nn.Module],
    micro_batches: Sequence[dict[str, torch.Tensor]],
    forward: Callable[[torch.nn.Module, dict[str, torch.Tensor]], torch.Tensor],
) -> list[torch.Tensor]:
    """Run `forward(chunk, micro_batch)` for every micro-batch through the pipeline.

    Micro-batches must share one shape ([batch, seq] in "input_ids"), since pipeline messages have a fixed size
    per call. Returns the last stage's outputs, one per micro-batch; other stages get [].
    """
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megarl.models.context_parallel import padded_tokens

    batch_size, seq_length = micro_batches[0]["input_ids"].shape
    cp = parallel_state.get_context_parallel_world_size()
    if cp > 1:  # the schedule's message: this rank's share of the padded tokens (megarl/models/context_parallel.py)
        batch_size, seq_length = 1, padded_tokens(micro_batches[0], cp)

    def step(data_iterator, model):
        return forward(model, next(data_iterator)), None  # no loss function: the schedule collects outputs

    for chunk in chunks:
        chunk.eval()
    return get_forward_backward_func()(
        forward_step_func=step,
        data_iterator=[iter(micro_batches) for _ in chunks] if len(chunks) > 1 else iter(micro_batches),
        model=list(chunks),
        num_microbatches=len(micro_batches),
        seq_length=seq_length,
        micro_batch_size=batch_size,
        forward_only=True,
    )


def gpt_forward(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """A GPT model's forward on token ids with causal attention; vocab-parallel logits on the last stage (with
    context parallelism: every token's, gathered over the CP ranks)."""
    from megarl.models.context_parallel import context_split, forward_split

    split = context_split(batch)
    if split is not None:
        output = forward_split(model, batch, split)
        return split.gather_tokens(output) if getattr(model, "post_process", False) else output
    input_ids = batch["input_ids"]
    position_ids = batch.get("position_ids")
    if position_ids is None:
        position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    return model(input_ids, position_ids, attention_mask=None)


def forward_logits(chunks: Sequence[torch.nn.Module], input_ids: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
    """Full-vocabulary logits [batch, seq, vocab_size] on the last pipeline stage (None elsewhere).

    Gathers the vocab-parallel logits of all TP ranks and strips the vocabulary padding: for checks and
    evaluation. Training computes log-probs vocab-parallel instead, never holding full logits on one rank.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    micro_batches = [{"input_ids": row} for row in input_ids.split(1)]
    # The interleaved schedule needs at least as many micro-batches as pipeline stages: pad with repeats.
    num_real = len(micro_batches)
    if len(chunks) > 1:
        pp = parallel_state.get_pipeline_model_parallel_world_size()
        micro_batches += [micro_batches[-1]] * max(0, pp - num_real)
    outputs = forward_only(chunks, micro_batches, gpt_forward)
    if not outputs:
        return None
    logits = torch.cat(outputs[:num_real])
    return gather_from_tensor_model_parallel_region(logits)[..., :vocab_size]
