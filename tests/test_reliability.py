"""What megarl promises when things go wrong, on real runs (`megarl train` subprocesses, local Ray, CPU):
a killed driver loses at most the work since the last checkpoint and never the checkpoint; a dead worker makes the
run restart from its last checkpoint (or stop with a clear message); a hung one is stopped at its phase's deadline
and named; non-finite gradients skip the update.

Faults are injected with megarl.runtime.faults (MEGARL_FAULTS); the kill harness is tools/faults/kill_resume.py.
"""

from __future__ import annotations

import sys
import time

import pytest
from job_helpers import REPO, megarl_train, metrics, write_config

sys.path.insert(0, str(REPO / "tools" / "faults"))
from kill_resume import Kill, Scenario, check_checkpoints, compare, read_steps, run_scenario

SMALL = ["rl.prompts_per_step=4", "checkpoint.every=2", "checkpoint.keep=3"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """A 6-step GRPO run at TP=1 that nothing interrupts: the numbers every resumed run must reproduce."""
    work = tmp_path_factory.mktemp("kill")
    config = write_config(work, "[grpo]", 6, tp=1)
    megarl_train(config, f"run.dir={work / 'uninterrupted'}", *SMALL)
    return config, work, read_steps(work / "uninterrupted")


ROTATING = ["rl.prompts_per_step=4", "checkpoint.every=2", "checkpoint.keep=1"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "scenario, overrides",
    [
        (Scenario((Kill("checkpoint.roles_written", 2),)), SMALL),
        (Scenario((Kill("checkpoint.rotating", 1),)), ROTATING),
    ],
    ids=["roles_written", "rotating"],
)
def test_a_driver_killed_mid_checkpoint_resumes_with_the_same_numbers(uninterrupted, scenario, overrides):
    config, work, reference = uninterrupted
    codes, problems, _ = run_scenario(config, work, scenario, reference, overrides)
    assert codes == [-9]  # SIGKILL: nothing was flushed or cleaned up
    assert not problems, problems


@pytest.mark.slow
def test_a_resume_chain_outlives_the_rotation_of_its_resume_checkpoint(uninterrupted):
    """Killed after its 2nd checkpoint, resumed, killed again mid-update two steps later (by then rotation with
    keep=1 has deleted the checkpoint the first resume loaded from), resumed again: finishes with the same numbers.
    Before the fix, the second resumed run's next save crashed copying the deleted folder's HF side files."""
    config, work, reference = uninterrupted
    chain = Scenario((Kill("checkpoint.latest_updated", 2), Kill("phase.update", 2)))
    overrides = ["rl.prompts_per_step=4", "checkpoint.every=1", "checkpoint.keep=1"]
    codes, problems, rotated = run_scenario(config, work, chain, reference, overrides)
    assert codes == [-9, -9] and rotated
    assert not problems, problems
    assert sorted(p.name for p in (work / chain.slug() / "checkpoints").iterdir()) == ["latest", "step_6"]


@pytest.mark.slow
def test_one_worker_process_killed_mid_sync_restarts_the_run_with_the_same_numbers(uninterrupted):
    config, work, reference = uninterrupted
    codes, problems, _ = run_scenario(
        config, work, Scenario((Kill("actor.sync", 3, target="worker"),)), reference, SMALL
    )
    assert codes == [0]  # the driver restarted its roles from the last checkpoint by itself
    assert not problems, problems


@pytest.mark.slow
def test_a_rollout_worker_that_dies_mid_step_restarts_the_run_from_its_checkpoint(uninterrupted, tmp_path):
    config, _, reference = uninterrupted
    run_dir = tmp_path / "run"
    faults = {"MEGARL_FAULTS": "exit:rollout.generate:4", "MEGARL_FAULTS_ONCE": str(tmp_path / "once")}
    out = megarl_train(config, f"run.dir={run_dir}", *SMALL, env=faults)
    assert "restarting every role" in out.stderr
    assert not check_checkpoints(run_dir) and not compare(reference, read_steps(run_dir))


@pytest.mark.slow
def test_without_restarts_a_dead_training_worker_stops_the_run_with_a_clear_message(uninterrupted, tmp_path):
    config, _, _ = uninterrupted
    faults = {"MEGARL_FAULTS": "exit:actor.update:3"}
    out = megarl_train(config, f"run.dir={tmp_path / 'run'}", *SMALL, "run.max_restarts=0", env=faults, check=False)
    assert out.returncode == 1
    message = out.stderr
    assert "megarl: run failed" in message and "actor" in message and "died" in message
    assert "rerun the same command to resume from checkpoint step_2" in message
    assert "Traceback (most recent call last)" not in message.split("megarl: run failed")[0][-2000:]


@pytest.mark.slow
def test_non_finite_gradients_skip_the_update_and_stop_after_too_many(uninterrupted, tmp_path):
    config, _, _ = uninterrupted
    faults = {"MEGARL_FAULTS": "nan:actor.grads:2"}
    out = megarl_train(config, f"run.dir={tmp_path / 'a'}", *SMALL, env=faults)
    steps = metrics(tmp_path / "a")
    assert [s["actor/skipped"] for s in steps] == [0, 1, 0, 0, 0, 0]
    assert "step 2: non-finite loss or gradients in actor" in out.stdout + out.stderr
    strict = megarl_train(
        config, f"run.dir={tmp_path / 'b'}", *SMALL, "actor.optim.max_consecutive_skips=1", env=faults, check=False
    )
    assert strict.returncode == 1
    message = strict.stderr
    assert "1 optimizer steps in a row had a non-finite gradient norm" in message
    assert "first non-finite gradient: module." in message and "(optim.max_consecutive_skips=1)" in message
    assert "restarting every role" not in message  # the same data would fail again: no restart
    assert not check_checkpoints(tmp_path / "b")


@pytest.mark.slow
def test_every_step_finds_the_engine_healthy(uninterrupted):
    _, work, _ = uninterrupted
    assert [step["rollout/engines_healthy"] for step in metrics(work / "uninterrupted")] == [1.0] * 6


@pytest.mark.slow
def test_a_hung_engine_then_a_hung_update_stop_at_their_deadlines_naming_phase_role_and_rank(uninterrupted, tmp_path):
    """The engine hangs in step 2's generate (its 3rd: the first eval is its 1st): past the rollout deadline the run
    restarts; in the restarted run the actor hangs in step 2's update: past that deadline the run stops. Each hang
    would last an hour."""
    config, _, _ = uninterrupted
    hangs = "hang:rollout.generate:3,hang:actor.update:2"
    faults = {"MEGARL_FAULTS": hangs, "MEGARL_FAULTS_ONCE": str(tmp_path / "once")}
    # the engine in a worker of its own; a hung engine restarts the run, not itself (test_engine_restart.py)
    split = ["placement.mode=split", "placement.rollout_gpus=1", "rollout.max_engine_restarts=0"]
    deadlines = "run.phase_timeouts={rollout: 20, update: 20}"
    start = time.monotonic()
    out = megarl_train(config, f"run.dir={tmp_path / 'run'}", *SMALL, *split, deadlines, env=faults, check=False)
    seconds = time.monotonic() - start
    assert out.returncode == 1
    assert (
        "a worker failed (rollout call 'generate' in phase 'rollout' failed: rank 0 no answer. Phase 'rollout' passed "
        "its deadline of 20 s (run.phase_timeouts.rollout)."
    ) in out.stderr
    assert (
        "actor call 'update_policy' in phase 'update' failed: rank 0 no answer. Phase 'update' passed its deadline of "
        "20 s (run.phase_timeouts.update)."
    ) in out.stderr
    assert "The run stopped after 1 restart(s) (run.max_restarts=1)" in out.stderr
    assert seconds < 600  # two start-ups, three steps and two deadlines; not two hours
