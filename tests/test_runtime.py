"""Runtime: the CPU compatibility layer for Megatron-Core, the gloo rank pool, atomic output folders."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megarl.checkpoint.staging import staged_folder
from megarl.errors import UserError
from megarl.runtime.ports import find_free_port
from megarl.runtime.rank_pool import RankFailure, RankPool

# ---- CPU compatibility layer (checked inside a rank process, where it is active) ------------------------------


def compat_facts() -> dict:
    import torch

    from megarl.runtime import cpu_compat

    cpu_compat.activate()  # init_model_parallel does this for Megatron processes
    facts = {"active": cpu_compat.is_active(), "current_device": torch.cuda.current_device()}
    t = torch.ones(2)
    facts["factory"] = str(torch.zeros(2, device="cuda").device)
    facts["int_device"] = str(torch.empty(1, device=0).device)
    facts["to_cuda"] = str(t.to("cuda:0").device)
    facts["to_device_obj"] = str(t.to(torch.device("cuda", 0)).device)
    facts["cuda_is_identity"] = t.cuda() is t
    with torch.device(torch.cuda.current_device()):
        facts["device_context"] = str(torch.zeros(1).device)
    facts["dtype_to_untouched"] = t.to(torch.float16).dtype == torch.float16
    torch.cuda.synchronize()

    class MakesCudaTensorsInBackward(torch.autograd.Function):  # as Megatron's all-gather and recompute do
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            return grad * torch.ones(2, device=torch.cuda.current_device())

    x = torch.ones(2, requires_grad=True)
    MakesCudaTensorsInBackward.apply(x).sum().backward()
    facts["backward"] = x.grad.tolist()

    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.moe import moe_utils

    facts["te_general_gemm"] = moe_utils.te_general_gemm
    facts["mla_have_te"] = multi_latent_attention.HAVE_TE
    return facts


def compat_rng() -> dict:
    """Megatron's RNG tracker forks the CPU generator as it forks the CUDA one on a GPU."""
    import torch
    from megatron.core import tensor_parallel

    from megarl.runtime.distributed import init_model_parallel
    from megarl.runtime.parallel import ParallelConfig

    init_model_parallel(ParallelConfig(), seed=123)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    state = torch.get_rng_state()
    plain = torch.rand(4)
    torch.set_rng_state(state)
    with tracker.fork():
        forked = torch.rand(4)
    after_fork = torch.rand(4)
    tensor_parallel.model_parallel_cuda_manual_seed(123)
    with tracker.fork():
        forked_again = torch.rand(4)
    return {
        "default_stream_untouched": torch.equal(plain, after_fork),
        "fork_differs": not torch.equal(forked, plain),
        "fork_reproducible": torch.equal(forked, forked_again),
    }


def test_cpu_compat_redirects_cuda_uses(ranks1):
    (facts,) = ranks1.run(compat_facts)
    assert facts == {
        "active": True,
        "current_device": 0,
        "factory": "cpu",
        "int_device": "cpu",
        "to_cuda": "cpu",
        "to_device_obj": "cpu",
        "cuda_is_identity": True,
        "device_context": "cpu",
        "dtype_to_untouched": True,
        "backward": [1.0, 1.0],
        "te_general_gemm": None,
        "mla_have_te": False,
    }


def test_cpu_compat_rng_tracker(ranks1):
    (facts,) = ranks1.run(compat_rng)
    assert all(facts.values()), facts


def test_cpu_compat_stays_off_when_cuda_is_present():
    """Can't run on a GPU here: pretend CUDA exists and check that nothing is patched."""
    code = (
        "import torch; torch.cuda.is_available = lambda: True\n"
        "original = torch.cuda.current_device\n"
        "from megarl.runtime import cpu_compat\n"
        "assert cpu_compat.activate() is False and not cpu_compat.is_active()\n"
        "assert torch.cuda.current_device is original\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr


# ---- process groups and seeds -----------------------------------------------------------------------------------


def test_init_distributed_from_the_torchrun_environment():
    script = Path(__file__).parent / "scripts" / "torchrun_check.py"
    port = str(find_free_port())
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", port, str(script)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    # The two ranks share stdout: a line of one may land in the middle of the other's, so read records, not lines.
    lines = sorted(re.findall(r"rank=\d+ world=\d+ local_rank=\d+ backend=\w+ sum=\d+", out.stdout))
    assert lines == [
        "rank=0 world=2 local_rank=0 backend=gloo sum=1",
        "rank=1 world=2 local_rank=1 backend=gloo sum=1",
    ]


def test_set_seed_makes_every_generator_repeat():
    import random

    import numpy as np
    import torch

    from megarl.runtime.seed import set_seed

    def draw():
        return random.random(), float(np.random.rand()), torch.rand(2).tolist()

    set_seed(7)
    first = draw()
    set_seed(7)
    assert draw() == first
    set_seed(8)
    assert draw() != first


# ---- rank pool ------------------------------------------------------------------------------------------------


def rank_and_sum():
    import torch
    import torch.distributed as dist

    value = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(value)
    return dist.get_rank(), dist.get_world_size(), value.item()


def fail_on_rank_one():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("rank one says no")
    return "fine"


def hang_on_rank_zero():
    import torch.distributed as dist

    if dist.get_rank() == 0:
        dist.barrier()  # rank 1 never joins
    return "done"


@pytest.fixture(scope="module")
def ranks2():
    with RankPool(2, timeout_s=120) as pool:
        yield pool


def test_rank_pool_runs_spmd_functions(ranks2):
    assert ranks2.run(rank_and_sum) == [(0, 2, 3.0), (1, 2, 3.0)]


def test_rank_pool_reports_the_failing_rank(ranks2):
    with pytest.raises(RankFailure, match=r"failed on ranks \[1\]") as err:
        ranks2.run(fail_on_rank_one)
    assert "ValueError: rank one says no" in str(err.value)
    assert ranks2.run(rank_and_sum)[0] == (0, 2, 3.0)  # the pool is still usable


def test_rank_pool_recovers_from_a_hang(ranks2):
    start = time.monotonic()
    with pytest.raises(RankFailure, match="no answer within 3 s"):
        ranks2.run(hang_on_rank_zero, timeout_s=3)
    assert time.monotonic() - start < 60
    assert ranks2.run(rank_and_sum) == [(0, 2, 3.0), (1, 2, 3.0)]  # restarted


_kept_groups: list = []


def leak_groups_and_report_pid():
    """Groups kept alive past the call (as a module or cache holding one would): their gloo threads stay."""
    import os

    import torch.distributed as dist

    _kept_groups.extend(dist.new_group([0, 1], backend="gloo") for _ in range(4))
    return os.getpid()


def test_rank_pool_restarts_ranks_that_pile_up_threads(ranks2, monkeypatch):
    from megarl.runtime import rank_pool

    first = ranks2.run(leak_groups_and_report_pid)
    assert ranks2.run(leak_groups_and_report_pid) == first  # few threads: the same processes serve every call
    monkeypatch.setattr(rank_pool, "MAX_RANK_THREADS", 0)
    assert ranks2.run(leak_groups_and_report_pid) == first  # this call's threads close the pool after it
    monkeypatch.setattr(rank_pool, "MAX_RANK_THREADS", 10_000)
    fresh = ranks2.run(leak_groups_and_report_pid)
    assert set(fresh).isdisjoint(first)  # fresh processes, without the piled-up threads
    assert ranks2.run(rank_and_sum) == [(0, 2, 3.0), (1, 2, 3.0)]


# ---- atomic output folders ------------------------------------------------------------------------------------


def test_staged_folder_appears_only_when_complete(tmp_path):
    dst = tmp_path / "out"
    with staged_folder(dst) as tmp:
        (tmp / "a.txt").write_text("a")
        assert not dst.exists()
    assert (dst / "a.txt").read_text() == "a"
    assert os.listdir(tmp_path) == ["out"]


def test_staged_folder_leaves_nothing_on_error(tmp_path):
    dst = tmp_path / "out"
    with pytest.raises(RuntimeError), staged_folder(dst) as tmp:
        (tmp / "a.txt").write_text("a")
        raise RuntimeError("crash")
    assert os.listdir(tmp_path) == []


def test_staged_folder_replaces_only_with_overwrite(tmp_path):
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "old.txt").write_text("old")
    with pytest.raises(UserError, match="already exists; pass --overwrite"), staged_folder(dst):
        pass
    with pytest.raises(RuntimeError), staged_folder(dst, overwrite=True):
        raise RuntimeError("crash")
    assert (dst / "old.txt").read_text() == "old"  # a failed overwrite keeps the previous version
    with staged_folder(dst, overwrite=True) as tmp:
        (tmp / "new.txt").write_text("new")
    assert os.listdir(dst) == ["new.txt"]
