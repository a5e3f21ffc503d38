"""Run a role's model over one rank's share of a batch, micro-batch by micro-batch, through Megatron's schedules.

The batch is cut into micro-batches by a token budget (dynamic batch size: rows x longest row), each trimmed to its
own longest row, so padding costs little; with packing (megarl/data/packing.py) each micro-batch is one row of its
samples' real tokens up to the budget, and no padding is computed at all; where the model allows it
(`shares_prompts`: megarl's CPU attention, plain RoPE, no PP), rows that repeat the prompt of the row before
them (GRPO's n samples) lay it once (34% fewer tokens per update at the quickstart size, 28% less update time).
Pipeline stages exchange activations of varying shapes (`variable_seq_lengths`, set when the model is built with
PP > 1). The interleaved schedule needs the number of micro-batches to be a multiple of the pipeline size: filler
micro-batches (zero loss weights, outputs dropped) make it so.

A step function gets a model chunk and a micro-batch and returns the chunk's output plus a loss function that
Megatron calls on the last pipeline stage: `loss_fn(output) -> (loss, num_tokens, payload)`. Models are built with
`calculate_per_token_loss`, so Megatron neither divides the loss by the number of micro-batches nor averages
gradients over data-parallel ranks: a loss already weighted by its share of the global mini-batch sums to the
global objective. Payloads (per-token results, metric sums) come back in micro-batch order on the last stage.

With context parallelism (megarl/models/context_parallel.py) `gpt_output` runs this CP rank's share of every sample
of a micro-batch, and the heads gather their per-token results back (`global_tokens`): everything above sees the
micro-batch whole.

Shapes: B rows of this rank's batch, S its width; b, s those of a micro-batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megarl.data.batch import Batch
from megarl.data.micro_batches import fixed_shape_groups, token_budget_groups
from megarl.data.packing import SharedPrefix, pack_groups, pack_rows, shared_prompt_lengths, unpacked_index
from megarl.models.context_parallel import CP_TOKENS, context_split, forward_split, padded_tokens

LossFn = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, dict[str, Any]]]
StepFn = Callable[[torch.nn.Module, dict[str, torch.Tensor]], tuple[torch.Tensor, LossFn]]


@dataclass
class MicroBatch:
    rows: list[int]
    """Row indices of the rank's batch, in order; empty for a filler."""
    tensors: dict[str, torch.Tensor]
    """Every tensor of the batch for those rows; token tensors trimmed to the longest row (packed: one row)."""
    lengths: list[int] | None = None
    """Packed: the real tokens of each of `rows`, in the order they are laid in the row; None: not packed."""
    shared: list[int] | None = None
    """Packed with shared prompts: the tokens each of `rows` takes from its root (megarl/data/packing.py)."""


@dataclass(frozen=True)
class ScheduleShape:
    """What the pipeline schedule of a model asks of its micro-batches."""

    multiple_of: int = 1
    """The interleaved schedule runs micro-batches in groups of the pipeline size."""
    fixed_shape: bool = False
    """One micro-batch shape for the whole call: pipeline stages without `variable_seq_lengths`, and the allgather
    token dispatcher (MoE without CUDA), which gathers equal-sized token blocks from the expert-parallel ranks."""
    agree_across_ranks: bool = False
    """Expert parallelism: every MoE layer's token exchange is a collective across ranks that hold different
    data, so all ranks run the same number of micro-batches (and, with fixed shapes, the same shape)."""
    context_parallel: int = 1
    """CP size: with fixed shapes every micro-batch's split is padded to one token count (`CP_TOKENS`)."""
    token_multiple: int = 1
    """`packing_multiple` of the model (a CP split pads its samples to multiples of it too)."""


def schedule_shape(chunks: Sequence[torch.nn.Module]) -> ScheduleShape:
    from megatron.core import parallel_state

    pp = parallel_state.get_pipeline_model_parallel_world_size()
    config = _unwrap(chunks[0]).config
    expert_parallel = parallel_state.get_expert_model_parallel_world_size() > 1
    allgather = bool(config.num_moe_experts) and config.moe_token_dispatcher_type == "allgather"
    fixed = (pp > 1 and not config.variable_seq_lengths) or (expert_parallel and allgather)
    cp = parallel_state.get_context_parallel_world_size()
    return ScheduleShape(pp if len(chunks) > 1 else 1, fixed, expert_parallel, cp, packing_multiple(chunks))


def packing_multiple(chunks: Sequence[torch.nn.Module]) -> int:
    """Tokens of a packed row must be a multiple of this: sequence parallelism splits them over the TP ranks."""
    config = _unwrap(chunks[0]).config
    return config.tensor_model_parallel_size if config.sequence_parallel else 1


def shares_prompts(chunks: Sequence[torch.nn.Module]) -> bool:
    """Whether packed rows of this model can share prompts: megarl's SDPA core attention (Transformer Engine's THD
    kernels cannot read another sample's keys; with context parallelism too), plain RoPE
    (megarl/models/packed_rope.py), no pipeline parallelism (every pipeline stage must lay a micro-batch alike)."""
    from megatron.core import parallel_state

    from megarl.models.sdpa_attention import SDPACoreAttention

    model = _unwrap(chunks[0])
    config = model.config
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        return False
    if config.multi_latent_attention or getattr(model, "position_embedding_type", None) != "rope":
        return False
    cores = [m.core_attention for m in model.modules() if hasattr(m, "core_attention")]
    return bool(cores) and all(isinstance(core, SDPACoreAttention) for core in cores)


def packing_pays(batch: Batch, min_padding: float, share_prompts: bool = False) -> bool:
    """Whether padded rows of `batch` would spend at least `min_padding` of their tokens on what packing does not
    lay (padding; with `share_prompts`, repeated prompts too). Under expert parallelism always: ranks that hold
    different rows must all decide alike."""
    from megatron.core import parallel_state

    if min_padding <= 0 or parallel_state.get_expert_model_parallel_world_size() > 1 or not len(batch):
        return True
    lengths = batch.lengths
    laid = lengths.sum().item()
    if share_prompts and "response_mask" in batch.tensors:
        laid -= sum(shared_prompt_lengths(batch["input_ids"], lengths.tolist(), batch["response_mask"]))
    return 1 - laid / (len(lengths) * lengths.max().item()) >= min_padding


def _unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    return getattr(chunk, "module", chunk)


_ZEROED_IN_FILLERS = ("loss_weights", "response_mask", "pair_weights", "routing_mask")


def split_micro_batches(
    batch: Batch,
    max_tokens: int,
    shape: ScheduleShape = ScheduleShape(),
    rows_per_unit: int = 1,
    packing: bool = False,
    token_multiple: int = 1,
    share_prompts: bool = False,
) -> list[MicroBatch]:
    """Token-budget micro-batches (see megarl.data.micro_batches), padded with fillers to the schedule's needs.

    rows_per_unit: consecutive rows that must stay together (2 for a reward model's chosen/rejected pairs).
    packing: one packed row per micro-batch (megarl/data/packing.py), `token_multiple` tokens a multiple.
    share_prompts: packed rows lay a prompt the rows before them already laid only once (where the model can:
    `shares_prompts`; RL batches with free shapes)."""
    lengths = batch.lengths.tolist()  # one host sync per call, before any compute
    if packing:
        share = share_prompts and not shape.fixed_shape and rows_per_unit == 1 and "response_mask" in batch.tensors
        return _packed_micro_batches(batch, lengths, max_tokens, shape, token_multiple, rows_per_unit, share)
    unit = rows_per_unit
    unit_lengths = [max(lengths[start : start + unit]) for start in range(0, len(lengths), unit)]
    budget = max(max_tokens // unit, 1)
    if shape.fixed_shape:
        width = max(unit_lengths)
        if shape.agree_across_ranks:
            width = _agree_max(width)
        groups = fixed_shape_groups(len(unit_lengths), width, budget)
        batch = _pad_columns(batch, width)
    else:
        groups = token_budget_groups(unit_lengths, budget)
    micro_batches = []
    for units in groups:
        rows = _rows_of(units, unit, len(lengths))
        part = batch.select(rows) if shape.fixed_shape else batch.select(rows).trim()
        micro_batches.append(MicroBatch(rows, dict(part.tensors)))
    if shape.fixed_shape:  # short groups get zero-weight rows up to the common row count
        # The largest group, not the budget's row count: a rank with fewer rows than the budget allows would
        # otherwise compute mostly padding (8x on the expert-parallel benchmark of tools/bench/train_step.py).
        units_per_micro_batch = max(len(units) for units in groups)
        if shape.agree_across_ranks:
            units_per_micro_batch = _agree_max(units_per_micro_batch)
        micro_batches = [_pad_rows(mb, units_per_micro_batch * unit) for mb in micro_batches]
    return _with_fillers(micro_batches, shape)


def _packed_micro_batches(
    batch: Batch,
    lengths: list[int],
    max_tokens: int,
    shape: ScheduleShape,
    multiple: int,
    unit: int = 1,
    share_prompts: bool = False,
) -> list[MicroBatch]:
    # Units of `unit` consecutive rows (a reward model's pairs) are packed whole.
    unit_lengths = [sum(lengths[start : start + unit]) for start in range(0, len(lengths), unit)]
    groups = [_rows_of(units, unit, len(lengths)) for units in pack_groups(unit_lengths, max_tokens)]
    width = None
    if shape.fixed_shape:  # every micro-batch one [1, width] row: the longest packed row, agreed where needed
        width = max(sum(lengths[i] for i in rows) for rows in groups)
        width = -(-width // multiple) * multiple
        if shape.agree_across_ranks:
            width = _agree_max(width)
    micro_batches = []
    for rows in groups:
        part = batch.select(rows).tensors
        row_lengths = [lengths[i] for i in rows]
        shared = None
        if share_prompts:
            shared = shared_prompt_lengths(part["input_ids"], row_lengths, part["response_mask"])
            shared = shared if any(shared) else None
        tensors = pack_rows(dict(part), row_lengths, width, multiple, shared)
        micro_batches.append(MicroBatch(rows, tensors, row_lengths, shared))
    return _with_fillers(micro_batches, shape)


def _rows_of(units: list[int], unit: int, num_rows: int) -> list[int]:
    """The batch rows of `units` (each `unit` consecutive rows; the last may be short)."""
    return [u * unit + k for u in units for k in range(unit) if u * unit + k < num_rows]


def _with_fillers(micro_batches: list[MicroBatch], shape: ScheduleShape) -> list[MicroBatch]:
    """Filler micro-batches up to the count the schedule needs (agreed across ranks, a multiple of its groups);
    with fixed shapes and context parallelism, one padded token count for every split."""
    if shape.fixed_shape and shape.context_parallel > 1:
        tokens = max(padded_tokens(mb.tensors, shape.context_parallel, shape.token_multiple) for mb in micro_batches)
        tokens = _agree_max(tokens) if shape.agree_across_ranks else tokens
        for micro_batch in micro_batches:
            micro_batch.tensors[CP_TOKENS] = torch.tensor(tokens)
    count = len(micro_batches)
    if shape.agree_across_ranks:
        count = _agree_max(count)
    count = -(-count // shape.multiple_of) * shape.multiple_of
    return micro_batches + [_filler(micro_batches[-1]) for _ in range(count - len(micro_batches))]


def _agree_max(value: int) -> int:
    """The largest `value` over every rank of the role (a collective)."""
    import torch.distributed as dist

    from megarl.runtime.device import collective_device

    tensor = torch.tensor([value], dtype=torch.long, device=collective_device())
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor.item())


def _pad_columns(batch: Batch, width: int) -> Batch:
    """Token tensors cut or zero-padded to exactly `width` columns."""
    batch = batch.trim()
    full = batch["input_ids"].shape[1]
    if full == width:
        return batch
    pad = torch.nn.functional.pad
    return Batch(
        {
            name: pad(t, (0, 0) * (t.dim() - 2) + (0, width - full)) if t.dim() >= 2 and t.shape[1] == full else t
            for name, t in batch.tensors.items()
        },
        dict(batch.meta),
    )


def _filler(template: MicroBatch) -> MicroBatch:
    """A micro-batch with the shape of `template` that contributes nothing: zero weights, outputs dropped."""
    tensors = {name: torch.zeros_like(t) if name in _ZEROED_IN_FILLERS else t for name, t in template.tensors.items()}
    return MicroBatch([], tensors, template.lengths, template.shared)


def _pad_rows(micro_batch: MicroBatch, num_rows: int) -> MicroBatch:
    missing = num_rows - len(micro_batch.rows)
    if missing <= 0:
        return micro_batch
    tensors = {}
    for name, t in micro_batch.tensors.items():
        pad = t[:1].expand(missing, *t.shape[1:])
        pad = torch.zeros_like(pad) if name in _ZEROED_IN_FILLERS else pad
        tensors[name] = torch.cat([t, pad])
    return MicroBatch(micro_batch.rows, tensors)


def run_schedule(
    chunks: Sequence[torch.nn.Module], micro_batches: Sequence[MicroBatch], step: StepFn, forward_only: bool
) -> list[dict[str, Any]]:
    """Forward (and backward unless `forward_only`) over all micro-batches; the last stage's payloads in order
    (other stages get [])."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator, model):
        return step(model, next(data_iterator).tensors)

    iterators: Any = [iter(micro_batches) for _ in chunks] if len(chunks) > 1 else iter(micro_batches)
    widths = [mb.tensors["input_ids"].shape for mb in micro_batches]
    if CP_TOKENS in micro_batches[0].tensors:  # the schedule divides it by the CP size: this rank's tokens
        widths = [(1, int(mb.tensors[CP_TOKENS])) for mb in micro_batches]
    for chunk in chunks:
        chunk.train(not forward_only)
    payloads = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iterators,
        model=list(chunks),
        num_microbatches=len(micro_batches),
        seq_length=max(w[1] for w in widths),
        micro_batch_size=max(w[0] for w in widths),
        forward_only=forward_only,
    )
    return list(payloads or [])


def gpt_output(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """A GPT model's forward on right-padded token ids: causal attention alone keeps padding out of every real
    position, so no attention mask is needed. Packed micro-batches (`cu_seqlens`) go through Megatron's THD path.
    Last stage: logits [b, s, V/tp] or values [b, s, 1]."""
    input_ids = tensors["input_ids"]
    split = context_split(tensors, packing_multiple([model]))
    if split is not None:
        return forward_split(model, tensors, split)
    if "cu_seqlens" in tensors:
        from megatron.core.packed_seq_params import PackedSeqParams

        cu_seqlens = tensors["cu_seqlens"].to(input_ids.device, torch.int32)
        sizes = tensors["cu_seqlens"].diff()
        shared = tensors.get("segment_shared")
        longest = int((sizes + shared).max() if shared is not None else sizes.max())  # RoPE's longest position
        params = PackedSeqParams("thd", cu_seqlens, cu_seqlens, max_seqlen_q=longest, max_seqlen_kv=longest)
        if shared is not None:
            # Megatron hands the core attention the params and RoPE only cu_seqlens: both carry the sharing
            params.shared_prefix = cu_seqlens.shared_prefix = SharedPrefix(
                shared.to(input_ids.device), tensors["segment_root"].to(input_ids.device)
            )
        return model(input_ids, tensors["position_ids"], attention_mask=None, packed_seq_params=params)
    position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    return model(input_ids, position_ids, attention_mask=None)


def global_tokens(values: torch.Tensor, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per-token values [b, s, ...] of the model's output for micro-batch `tensors`, in the micro-batch's layout: as
    they are without context parallelism; with it, this rank's tokens gathered over the CP ranks."""
    split = context_split(tensors)
    return values if split is None else split.gather_tokens(values)


def scatter_rows(
    micro_batches: Sequence[MicroBatch], payloads: Sequence[dict[str, Any]], name: str, num_rows: int, width: int
) -> torch.Tensor:
    """Reassemble a per-token payload [b, s] of every micro-batch into [num_rows, width] (zeros past each row)."""
    first = payloads[0][name]
    out = first.new_zeros((num_rows, width, *first.shape[2:]))
    for micro_batch, payload in zip(micro_batches, payloads):
        if micro_batch.rows and micro_batch.lengths is not None:
            rows, columns, source = unpacked_index(micro_batch.rows, micro_batch.lengths, micro_batch.shared)
            out[rows, columns] = payload[name][0, source]  # one op, not one per row
        elif micro_batch.rows:
            values = payload[name][: len(micro_batch.rows)]  # padding rows (fixed shapes) are dropped
            out[micro_batch.rows, : values.shape[1]] = values
    return out


def is_output_rank() -> bool:
    """Ranks whose results the controller collects: TP and CP rank 0 on the last pipeline stage (one per DP
    replica; every CP rank holds the gathered results)."""
    from megatron.core import parallel_state as ps

    return (
        ps.get_tensor_model_parallel_rank() == 0
        and ps.get_context_parallel_rank() == 0
        and ps.is_pipeline_last_stage(ignore_virtual=True)
    )
