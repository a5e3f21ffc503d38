"""Greedy decoding with the Megatron model itself: the reference a rollout engine's greedy output must equal.

No KV cache: every step runs the whole sequence through the pipeline (slow, exact). Full logits are gathered on
the last stage's ranks; the chosen token is broadcast to every rank of the role so all stages stay in step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megarl.models.pipeline import forward_logits
from megarl.runtime.device import collective_device, local_device
from megarl.workers.role_model import RoleModel


@torch.no_grad()
def greedy_decode(
    model: RoleModel, prompts: list[list[int]], max_new_tokens: int, stop_ids: frozenset[int] = frozenset()
) -> list[list[int]]:
    """Collective over the role's ranks: the greedy continuation of each prompt (every rank gets the result)."""
    from megatron.core import parallel_state as ps

    chunks = [getattr(chunk, "module", chunk) for chunk in model.chunks]
    src = _last_stage_first_rank(ps)
    device = local_device()
    completions = []
    for prompt in prompts:
        ids = list(prompt)
        out: list[int] = []
        for _ in range(max_new_tokens):
            logits = forward_logits(chunks, torch.tensor([ids], device=device), model.vocab.size)
            token = torch.zeros(1, dtype=torch.long, device=collective_device())
            if logits is not None:
                token[0] = logits[0, -1].argmax()
            dist.broadcast(token, src=src)
            out.append(int(token))
            ids.append(int(token))
            if int(token) in stop_ids:
                break
        completions.append(out)
    return completions


def _last_stage_first_rank(ps) -> int:
    """Global rank of TP rank 0 on the last pipeline stage of data-parallel replica 0 (every replica decodes the
    same prompts, so any one of them can speak for all)."""
    flags = torch.zeros(dist.get_world_size(), dtype=torch.long, device=collective_device())
    first_of_stage = ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
    flags[dist.get_rank()] = int(ps.is_pipeline_last_stage() and first_of_stage)
    dist.all_reduce(flags)
    return int(flags.nonzero()[0])
