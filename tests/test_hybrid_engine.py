"""The hybrid engine (rollout.hf.hybrid): each actor worker hosts one hf engine, synced by an in-process copy.

What a user checks: a job that can run hybrid does so on a CPU machine without being asked (a process fewer per
engine, the `in_process` weight sync), trains exactly as with engine workers of their own, and `on` where it cannot
run is refused before anything starts, naming the key.
"""

from __future__ import annotations

import pytest
from job_helpers import megarl_train, metrics, write_config

from megarl.config import load_config
from megarl.errors import UserError
from megarl.job import JobConfig
from megarl.trainer.observability.metrics import read_samples


def job(tmp_path, *overrides: str, tp: int = 2) -> JobConfig:
    return load_config(JobConfig, write_config(tmp_path, "[grpo]", 2, tp=tp), overrides)


@pytest.mark.parametrize("tp", [1, 2])
def test_a_colocated_job_runs_hybrid_and_syncs_in_process(tmp_path, tp):
    config = job(tmp_path, tp=tp)  # one engine per actor worker: one or two workers
    assert config.hybrid_engine() and config.weight_sync_transport() == "in_process"
    off = job(tmp_path, "rollout.hf.hybrid=off", tp=tp)
    assert not off.hybrid_engine() and off.weight_sync_transport() == "ipc"  # colocated, an engine worker


@pytest.mark.parametrize(
    "overrides, named",
    [
        (("placement.mode=split", "placement.rollout_gpus=2"), "placement.mode='split'"),
        (("rollout.weight_sync=object_store",), "rollout.weight_sync='object_store'"),
    ],
)
def test_hybrid_on_where_it_cannot_run_is_refused_naming_the_key(tmp_path, overrides, named):
    assert not job(tmp_path, *overrides).hybrid_engine()  # auto: an engine worker of its own
    with pytest.raises(UserError, match="rollout.hf.hybrid=on") as error:
        job(tmp_path, *overrides, "rollout.hf.hybrid=on").hybrid_engine()
    assert named in str(error.value)


@pytest.mark.slow
def test_the_hybrid_engine_trains_exactly_as_an_engine_worker(tmp_path):
    """At TP=2: two actor workers, each hosting one engine; every bucket reaches both through the relay's broadcast
    (megarl/workers/weight_sync.py `_relay_in_process`). A one-worker job (TP=1) takes the plain in-process copy:
    tools/bench/vs_trl.py runs it."""
    runs = {}
    for mode in ("auto", "off"):
        folder = tmp_path / mode
        folder.mkdir()
        megarl_train(write_config(folder, "[grpo]", 3), f"rollout.hf.hybrid={mode}")
        runs[mode] = metrics(folder / "run")
    assert all(step["sync/in_process_engines"] == 1 for step in runs["auto"])
    assert all(step["sync/in_process_engines"] == 0 for step in runs["off"])
    # the engine workers' weights are in shared memory: the actor's ranks write them in place (both engines)
    assert all(step["sync/shared_memory_engines"] == 2 for step in runs["off"])
    # a CPU machine hands nothing over (placement.handover=auto) and samples memory at the update only
    assert not [r for r in read_samples(tmp_path / "auto" / "run") if r["name"] == "handover"]
    assert all({k for k in step if k.startswith("memory/")} == {"memory/update/rss_gb"} for step in runs["auto"])
    for hybrid, worker in zip(runs["auto"], runs["off"], strict=True):
        same = [k for k in worker if k.startswith(("reward/", "actor/", "mismatch/", "response/"))]
        assert same and {k: hybrid[k] for k in same} == {k: worker[k] for k in same}
        assert hybrid["sync/bytes"] == worker["sync/bytes"] > 0  # every weight, once
        assert hybrid["mismatch/abs_logprob_diff_max"] < 1e-4  # the engine holds the actor's weights
