"""A rollout fleet that survives its engines (rollout.max_engine_restarts; megarl/trainer/rollout_side/
engine_fleet.py), on real runs: `megarl train` subprocesses, local Ray, two hf engines with GPUs of their own
(placement.mode=split, logical GPUs on this CPU machine).

Faults come from megarl.runtime.faults: `hang` makes an engine sleep for an hour inside its generate call, `sigkill`
kills its worker process there; MEGARL_FAULTS_ONCE makes each fire once across the run's processes (the engine
started again does not meet it again), MEGARL_FAULTS_RANK picks the engine.
"""

from __future__ import annotations

import sys

import pytest
from job_helpers import REPO, megarl_train, metrics, write_config

from megarl.errors import UserError

sys.path.insert(0, str(REPO / "tools" / "faults"))  # the fleet's fault campaign: its checks

STEPS = 4
PROMPTS, N = 8, 4
FLEET = [
    "placement.mode=split",
    "placement.rollout_gpus=2",  # two engines
    f"rl.prompts_per_step={PROMPTS}",
    "rl.eval_at_start=false",
    "rollout.sync_probe.prompts=0",  # no generate call but the steps' (and the last eval's)
    "checkpoint.save_at_end=false",
]
HUNG_S = 15
"""The rollout phase's deadline: how long the run waits for a hung engine."""


@pytest.fixture(scope="module")
def survived(tmp_path_factory):
    """A 4-step run whose engines fail twice. In step 2 one engine is SIGKILLed in its generate call (the one that
    gets there first: its 2nd call); the other generates its prompts too (its 3rd call). In step 3 that one hangs
    in its generate call (its 4th) and is killed at the rollout deadline; the first one, started again, generates
    its prompts."""
    work = tmp_path_factory.mktemp("fleet")
    config = write_config(work, "[grpo]", STEPS, tp=1)
    faults = {
        "MEGARL_FAULTS": "sigkill:rollout.generate:2,hang:rollout.generate:4",
        "MEGARL_FAULTS_ONCE": str(work / "once"),
    }
    deadline = f"run.phase_timeouts={{rollout: {HUNG_S}}}"
    out = megarl_train(config, f"run.dir={work / 'run'}", *FLEET, deadline, env=faults)
    return out, metrics(work / "run"), work / "run"


@pytest.mark.slow
def test_the_run_gives_the_numbers_of_a_run_without_failures(survived, tmp_path):
    """The fleet fault campaign's checks (tools/faults/engine_faults.py, run here on this file's faulted run): every
    step once, whole batches of one weight version, and every metric but the recovery counters equal to those of the
    same job run without faults. The failed engines' prompts, generated again by the other engine with their own
    seeds, gave the same samples."""
    from engine_faults import ALONE, Point, check_run, without_recovery
    from kill_resume import read_steps

    out, _, run_dir = survived
    config = write_config(tmp_path, "[grpo]", STEPS, tp=1)
    megarl_train(config, f"run.dir={tmp_path / 'run'}", *FLEET, f"run.phase_timeouts={{rollout: {HUNG_S}}}")
    reference = {step: without_recovery(m) for step, m in read_steps(tmp_path / "run").items()}
    point = Point("generate: SIGKILL, then a hang", "", ALONE)
    assert check_run(run_dir, reference, out.stdout + out.stderr, point) == []


@pytest.mark.slow
def test_the_run_finishes_with_every_engine_restarted_alone(survived):
    out, steps, _ = survived
    assert len(steps) == STEPS
    assert [s["rollout/engine_restarts"] for s in steps] == [0.0, 1.0, 2.0, 2.0]
    assert "restarting every role" not in out.stderr  # no whole-run restart
    log = out.stdout + out.stderr
    assert "at step 2 (generate: died): restarting it alone (1 of rollout.max_engine_restarts=3)" in log
    assert f"at step 3 (generate: no answer: Phase 'rollout' passed its deadline of {HUNG_S} s" in log


@pytest.mark.slow
def test_the_failed_engines_prompts_were_generated_by_the_others(survived):
    _, steps, _ = survived
    # the failed engine held half of the step's 8 prompts
    assert [s["rollout/requeued_prompts"] for s in steps] == [0.0, PROMPTS / 2, PROMPTS / 2, 0.0]
    assert [s["rollout/engines_healthy"] for s in steps] == [2.0] * STEPS


@pytest.mark.slow
def test_every_batch_is_whole_and_from_the_current_weights(survived):
    _, steps, _ = survived
    assert [s["rollout/samples"] for s in steps] == [PROMPTS * N] * STEPS
    # step s generates with version s + 1 (the first sync is version 1); its own sync then makes version s + 2
    assert [s["rollout/weight_version_min"] for s in steps] == [float(s + 1) for s in range(STEPS)]
    assert [s["rollout/weight_version_max"] for s in steps] == [float(s + 1) for s in range(STEPS)]
    assert [s["sync/weight_version"] for s in steps] == [float(s + 2) for s in range(STEPS)]


@pytest.mark.slow
def test_failures_past_the_limit_stop_the_run_naming_each(tmp_path):
    config = write_config(tmp_path, "[grpo]", 2, tp=1)
    faults = {"MEGARL_FAULTS": "exit:rollout.generate:1", "MEGARL_FAULTS_RANK": "1"}  # every engine 1 dies at once
    out = megarl_train(config, *FLEET, "rollout.max_engine_restarts=1", env=faults, check=False)
    assert out.returncode == 1
    assert (
        "rollout engines failed 2 times, more than rollout.max_engine_restarts=1 restarts: engine 1 at step 1 "
        "(generate: died); engine 1 at step 2 (generate: died). The last checkpoint stands"
    ) in out.stderr
    assert "restarting every role" not in out.stderr
    assert len(metrics(tmp_path / "run")) == 1  # step 1 finished: engine 0 generated engine 1's prompts


def test_the_key_is_checked_when_the_config_loads(tmp_path):
    from megarl.config.loader import load_config
    from megarl.job import JobConfig

    config = write_config(tmp_path, "[grpo]", 1, tp=1)
    with pytest.raises(UserError, match=r"rollout.max_engine_restarts=-1 is negative; it is an amount: give 0 or more"):
        load_config(JobConfig, config, ["rollout.max_engine_restarts=-1"])


def test_a_fenced_engine_refuses_to_generate_until_a_full_weight_update(hf_checkpoint):
    """The rollout worker in this process (no Ray: the fence is the worker's own state), on a tiny hf model."""
    from megarl.rollout.config import HFEngineConfig, RolloutConfig, SamplingParams
    from megarl.rollout.engine import GenerateRequest
    from megarl.workers.rollout_worker import EngineFenced, RolloutWorker

    model = hf_checkpoint("tiny-qwen3")
    worker = RolloutWorker(engine_thread=False)
    reason = "it was started again after a failure"
    assert (
        worker.setup(str(model), RolloutConfig(hf=HFEngineConfig(num_threads=1)), fenced=reason)["process_groups"] == []
    )  # the hf engine runs inside the worker's process
    requests, sampling = [GenerateRequest([1, 20, 30], seed=0)], SamplingParams(n=1, max_new_tokens=2)
    refused = f"rollout engine 0 refuses to generate: {reason}; it serves again after a full weight sync"
    for call in (lambda: worker.generate(requests, sampling), lambda: worker.health_probe(5.0)):
        with pytest.raises(EngineFenced, match=refused):
            call()
    with pytest.raises(EngineFenced, match=f"refuses a delta weight update to version 3: {reason}; it needs a full"):
        worker.begin_weight_update(3, full=False)
    weights = worker.engine.model.state_dict()
    worker.begin_weight_update(3)
    worker.apply_bucket(list(weights.items()))
    worker.finish_weight_update(3)
    [[completion]] = worker.generate(requests, sampling)
    assert completion.weight_version == 3
    worker.abandon_weight_update("actor rank 0 died")
    with pytest.raises(EngineFenced, match=r"refuses to generate: a weight update was abandoned \(actor rank 0 died\)"):
        worker.generate(requests, sampling)


def test_one_fault_point_takes_several_faults_at_different_counts(monkeypatch):
    from megarl.runtime import faults

    monkeypatch.setenv(faults.ENV, "raise:test.point:2,raise:test.point:4")
    monkeypatch.setattr(faults, "_hits", type(faults._hits)())
    fired = []
    for _ in range(5):
        try:
            faults.hit("test.point")
            fired.append(False)
        except RuntimeError as err:
            fired.append(str(err))
    passes = [f"fault injected at test.point (pass {n})" for n in (2, 4)]
    assert fired == [False, passes[0], False, passes[1], False]
