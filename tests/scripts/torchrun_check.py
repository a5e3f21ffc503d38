"""Run under torchrun: every rank joins from the environment torchrun sets, and an all-reduce adds up the ranks."""

import torch
import torch.distributed as dist

from megarl.runtime.distributed import init_distributed

if __name__ == "__main__":
    info = init_distributed()
    total = torch.tensor([float(info.rank)])
    dist.all_reduce(total)
    print(
        f"rank={info.rank} world={info.world_size} local_rank={info.local_rank} backend={info.backend} "
        f"sum={total.item():g}",
        flush=True,
    )
    dist.destroy_process_group()
