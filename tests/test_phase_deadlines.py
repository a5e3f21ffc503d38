"""Phase deadlines (run.phase_timeouts) and the engine health probe: the config's checks and defaults, and real
rollout workers (Ray, the hf engine on a tiny random model) that hang or die inside a phase.

Faults come from megarl.runtime.faults: `hang` makes a worker sleep for an hour at a named point, MEGARL_FAULTS_RANK
picks the one engine it happens on. The end-to-end runs (a hanging generate and a hanging update stopping
`megarl train`; the healthy fleet's metrics) are in test_reliability.py and test_trainer.py.
"""

from __future__ import annotations

import time

import pytest
import ray
from fake_sglang import FakeSGLang
from job_helpers import write_config

from megarl.cluster.config import ClusterConfig, GroupTimeouts
from megarl.cluster.deadline import PhaseTimeoutError, phase_deadline
from megarl.cluster.errors import WorkerError
from megarl.cluster.ray_runtime import start_ray, stop_ray
from megarl.cluster.resource_pool import ResourcePool
from megarl.cluster.worker_group import WorkerGroup
from megarl.config.loader import load_config
from megarl.errors import UserError
from megarl.job import JobConfig
from megarl.rollout.config import HFEngineConfig, RolloutConfig, SamplingParams, SGLangEngineConfig
from megarl.rollout.engine import GenerateRequest
from megarl.rollout.sglang_client import SGLangError
from megarl.rollout.sglang_engine import SGLangEngine
from megarl.rollout.sglang_weights import pickle_serializer
from megarl.trainer.lifecycle.deadline_defaults import default_timeouts, phase_timeouts
from megarl.trainer.loops.deadlines import PHASES
from megarl.trainer.rollout_side.engine_health import probe_engines
from megarl.trainer.rollout_side.rollout_buffer import RolloutBuffer
from megarl.workers.rollout_worker import RolloutWorker

SLACK_S = 10.0
"""What a deadline may overrun by on a loaded 2-core machine: killing the group and Ray noticing it."""


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    return write_config(tmp_path_factory.mktemp("deadlines"), "[grpo]", 2, tp=1)


def test_bad_phase_timeouts_are_refused_at_load_naming_the_key_and_the_phases(job):
    with pytest.raises(UserError) as unknown:
        load_config(JobConfig, job, ["run.phase_timeouts={generate: 30}"])
    assert "run.phase_timeouts names unknown phase(s) 'generate'; valid: " + ", ".join(PHASES) in str(unknown.value)
    for value in ("-5", "0"):
        with pytest.raises(UserError, match=rf"run.phase_timeouts.update={value}(.0)? must be a number of seconds > 0"):
            load_config(JobConfig, job, [f"run.phase_timeouts={{update: {value}}}"])


def test_the_defaults_grow_with_the_batch_and_a_set_value_replaces_its_own(job):
    config = load_config(JobConfig, job, ["run.phase_timeouts={rollout: 45, update: null}"])
    defaults = default_timeouts(config, eval_rows=8)
    # 8 prompts x 4 samples on one engine: one wave of 6 decode steps at 0.25 s each, on top of 600 s
    assert defaults["rollout"] == 601.5
    assert defaults["wait"] == defaults["rollout"] + defaults["reward"]
    big = load_config(
        JobConfig, job, ["rl.prompts_per_step=1024", "rollout.sampling.n=16", "rollout.sampling.max_new_tokens=1000"]
    )
    # 16384 completions on one engine: 128 waves of 128, 1000 decode steps each
    assert default_timeouts(big)["rollout"] == 600 + 0.25 * 1000 * 128
    resolved = phase_timeouts(config, eval_rows=8)
    assert resolved["rollout"] == 45.0 and resolved["update"] == defaults["update"]
    assert sorted(resolved) == sorted(PHASES)


def test_an_async_trainer_waits_for_the_producer_no_longer_than_the_wait_deadline():
    buffer = RolloutBuffer(max_staleness=0)  # nothing is ever put: a producer stuck outside any worker call
    start = time.monotonic()
    with pytest.raises(PhaseTimeoutError) as late, phase_deadline("wait", 0.5, "run.phase_timeouts.wait"):
        buffer.take(actor_version=0)
    assert time.monotonic() - start < 0.5 + 1.0
    assert str(late.value) == (
        "rollout producer in phase 'wait' failed. Phase 'wait' passed its deadline of 0.5 s "
        "(run.phase_timeouts.wait). The rollout producer delivered no batch in time."
    )


def test_an_sglang_engine_is_probed_with_health_generate_within_its_time():
    """The fake SGLang server of the engine tests (tests/fake_sglang.py) stands in for a real one (no GPU here)."""
    server = FakeSGLang()
    try:
        engine = SGLangEngine("/ckpt/tiny", SGLangEngineConfig(), url=server.url, serializer=pickle_serializer)
        engine.health_probe(5.0)
        assert server.paths()[-1] == "/health_generate"
        server.delay["/health_generate"] = 2.0
        with pytest.raises(SGLangError, match=r"GET .*/health_generate timed out after 0.5 s"):
            engine.health_probe(0.5)
    finally:
        server.close()


FAULTS = {"MEGARL_FAULTS": "hang:rollout.health:2,hang:rollout.generate:2", "MEGARL_FAULTS_RANK": "1"}
"""Engine 1 hangs in its 2nd health probe and in its 2nd generate call; engine 0 never."""
GRACE_S = 2.0


@pytest.fixture(scope="module")
def engines(hf_checkpoint):
    start_ray(ClusterConfig(logical_gpus=2, num_cpus=4, object_store_memory_mb=256, log_to_driver=False))
    pool = ResourcePool("rollout", num_nodes=1, gpus_per_node=2)
    timeouts = GroupTimeouts(failure_grace_s=GRACE_S)
    group = WorkerGroup(RolloutWorker, pool, "rollout", world_size=2, env=FAULTS, timeouts=timeouts)
    group.call("setup", str(hf_checkpoint("tiny-qwen3")), RolloutConfig(hf=HFEngineConfig(num_threads=1)))
    yield group
    group.shutdown()
    pool.remove()
    stop_ray()


def test_the_probe_reports_a_healthy_fleet_then_names_a_dead_and_a_hung_engine(engines):
    metrics = probe_engines(engines)
    assert metrics["rollout/engines_healthy"] == 2.0
    assert metrics["rollout/engine_health_s"] < 5.0  # one token of a tiny model
    ray.kill(engines.workers[0], no_restart=True)  # engine 0 dies; engine 1 hangs in this probe
    start = time.monotonic()
    with pytest.raises(WorkerError) as failed, phase_deadline("health", 60, "run.phase_timeouts.health"):
        probe_engines(engines)
    assert time.monotonic() - start < GRACE_S + SLACK_S  # the hung one gets the grace after the first failure
    assert str(failed.value).startswith(
        "rollout call 'health_probe' in phase 'health' failed: rank 0 died, rank 1 no answer. First failure: rank 0."
    )
    assert not engines.healthy


def test_a_generate_past_the_rollout_deadline_names_the_phase_and_the_silent_engine(engines, hf_checkpoint):
    engines.restart()  # fresh processes: their fault counts start again
    engines.call("setup", str(hf_checkpoint("tiny-qwen3")), RolloutConfig(hf=HFEngineConfig(num_threads=1)))
    requests, sampling = [GenerateRequest([1, 20, 30], seed=0)], SamplingParams(n=2, max_new_tokens=4)
    with phase_deadline("rollout", 30, "run.phase_timeouts.rollout"):
        first = engines.call("generate", [requests, requests], [sampling, sampling], dispatch="per_rank")
    assert [len(share[0]) for share in first] == [2, 2]
    start = time.monotonic()
    with pytest.raises(PhaseTimeoutError) as hung, phase_deadline("rollout", 4, "run.phase_timeouts.rollout"):
        engines.call("generate", [requests, requests], [sampling, sampling], dispatch="per_rank")
    assert time.monotonic() - start < 4 + SLACK_S
    assert str(hung.value).startswith(
        "rollout call 'generate' in phase 'rollout' failed: rank 1 no answer. "
        "Phase 'rollout' passed its deadline of 4 s (run.phase_timeouts.rollout)."
    )
    assert hung.value.ranks == [1] and not engines.healthy
