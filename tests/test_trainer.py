"""`megarl train` end to end on CPU: real Ray, a Megatron actor at TP=2, hf rollout engines, weight sync every step.

Runs are subprocesses of the real command line. The task is trivially learnable (reward: the fraction of digits in
the response), so a few steps must raise the reward.
"""

from __future__ import annotations

import json
import signal

import pytest
from job_helpers import FIXTURES, interrupt_after, megarl_train, metrics, write_config


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory):
    """An uninterrupted 8-step GRPO run: checked by itself, and the reference an interrupted run must reproduce."""
    folder = tmp_path_factory.mktemp("grpo")
    megarl_train(write_config(folder, "[grpo]", 8), "placement.handover=always")  # the GPU path's calls, on CPU
    return folder / "run"


@pytest.mark.slow
def test_grpo_raises_the_reward_and_writes_the_run_folder(grpo_run):
    run = grpo_run
    steps = metrics(run)
    assert len(steps) == 8
    first, last = steps[0]["reward/mean"], sum(s["reward/mean"] for s in steps[-2:]) / 2
    assert last > first + 0.2, [s["reward/mean"] for s in steps]
    assert all(s["mismatch/abs_logprob_diff_max"] < 1e-4 for s in steps)  # engine and actor agree after every sync
    assert (run / "config.yaml").is_file() and list((run / "tensorboard").iterdir())
    latest = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    assert (latest / "actor" / "model" / "metadata.json").is_file()
    assert (latest / "actor" / "optimizer" / "metadata.json").is_file()
    state = json.loads((latest / "trainer_state.json").read_text())
    assert state["global_step"] == 8 and state["weight_version"] == 9  # one sync at the start, one per step


@pytest.mark.slow
def test_ppo_trains_a_critic(tmp_path):
    config = write_config(tmp_path, "[ppo]", 6, "algorithm: {advantage: {estimator: gae, gamma: 1.0, lam: 0.95}}")
    megarl_train(config)
    steps = metrics(tmp_path / "run")
    assert len(steps) == 6
    assert all("critic/vf_loss" in s and "actor/pg_loss" in s for s in steps)
    assert sum(s["reward/mean"] for s in steps[-2:]) / 2 > steps[0]["reward/mean"] + 0.1


@pytest.mark.slow
def test_dapo_dynamic_sampling_fills_each_batch_with_informative_groups(tmp_path):
    """The synchronous loop with algorithm.dapo.dynamic_sampling (trainer/dynamic_sampling.py): a step draws again
    until rl.prompts_per_step groups whose rewards differ are kept (at most max_sampling_rounds draws), and only
    those are trained on."""
    extra = "algorithm: {dapo: {dynamic_sampling: true, max_sampling_rounds: 3}}"
    reward = f"reward.fn={FIXTURES / 'digit_reward.py'}:starts_with_digit"  # binary: groups often all-0
    megarl_train(write_config(tmp_path, "[grpo]", 3, extra), "rl.prompts_per_step=4", reward)
    steps = metrics(tmp_path / "run")
    assert len(steps) == 3
    assert any(step["dapo/draws"] > 1 for step in steps), steps  # some groups were dropped and drawn again
    for step in steps:
        assert step["dapo/kept_groups"] == 4.0 or step["dapo/draws"] == 3.0, step


@pytest.mark.slow
def test_ctrl_c_saves_and_a_rerun_resumes_with_the_same_numbers(grpo_run, tmp_path):
    config = write_config(tmp_path, "[grpo]", 8)
    assert interrupt_after(config, tmp_path / "run", step=2) == 130  # finishes its step, saves, stops
    assert (tmp_path / "run/checkpoints/latest").is_file()
    megarl_train(config)  # the same command again resumes
    a, b = metrics(grpo_run), metrics(tmp_path / "run")
    assert [s["step"] for s in b] == list(range(1, 9))
    for x, y in zip(a, b):
        assert x["reward/mean"] == pytest.approx(y["reward/mean"], abs=1e-6)
        assert x["actor/loss"] == pytest.approx(y["actor/loss"], abs=1e-5)
    state = json.loads((tmp_path / "run/checkpoints/step_8/trainer_state.json").read_text())
    assert state["data"]["prompts"]["position"] == 64 and state["weight_version"] == 9


def handover_records(run) -> dict[int, list[str]]:
    """Per step, the colocated handover's calls in order (samples.jsonl, name `handover`)."""
    from megarl.trainer.metrics import read_samples

    return {r["step"]: r["text"].split(" -> ") for r in read_samples(run) if r["name"] == "handover"}


PLAIN_STEP = [  # a step with no checkpoint: generate, hand the GPUs back, log-probs and update, then to the engines
    "rollout.release_memory(weights,kv_cache)",
    "actor.onload",
    "actor.offload(False, True, True)",  # grads and optimizer first: the actor's weights stay for the sync
    "rollout.resume_memory(weights)",
    "sync",  # both weights resident, the KV cache not yet
    "actor.offload(True, True, True)",
    "rollout.resume_memory(kv_cache)",
]


@pytest.mark.slow
def test_the_colocated_handover_runs_in_order_and_changes_no_number(grpo_run, tmp_path):
    records = handover_records(grpo_run)
    assert sorted(records) == list(range(1, 9))
    # before step 1: both hold their models; the first sync hands the GPUs to the engines
    assert records[1] == ["actor.offload(False, True, True)", "sync", "actor.offload(True, True, True)", *PLAIN_STEP]
    assert all(records[step] == PLAIN_STEP for step in range(2, 9))
    split = tmp_path / "split"
    split.mkdir()
    megarl_train(write_config(split, "[grpo]", 8), "placement.mode=split", "placement.rollout_gpus=2")
    assert handover_records(split / "run") == {}  # split placement hands nothing over
    for a, b in zip(metrics(grpo_run), metrics(split / "run"), strict=True):
        assert {k: v for k, v in a.items() if k.startswith(("reward/", "actor/"))} == {
            k: v for k, v in b.items() if k.startswith(("reward/", "actor/"))
        }
    phases = ("rollout", "reward", "handover", "logprobs", "update", "sync")
    for step in metrics(grpo_run):  # every step carries every phase's memory
        assert {f"memory/{phase}/rss_gb" for phase in phases} <= set(step)


@pytest.mark.slow
def test_sigusr1_saves_a_checkpoint_and_asks_for_a_requeue(tmp_path):
    """Slurm's warning before the time limit (`#SBATCH --signal=B:USR1@300`, forwarded to the trainer): the step
    ends, a checkpoint of every logged step is saved, and the exit code 75 tells the job script to requeue (resuming
    from such a checkpoint is the Ctrl-C test's road)."""
    config = write_config(tmp_path, "[grpo]", 8)
    assert interrupt_after(config, tmp_path / "run", step=2, signum=signal.SIGUSR1) == 75
    checkpoints = tmp_path / "run" / "checkpoints"
    state = json.loads((checkpoints / (checkpoints / "latest").read_text().strip() / "trainer_state.json").read_text())
    assert state["global_step"] == len(metrics(tmp_path / "run")) < 8


def test_every_stop_signal_stops_at_a_step_end_with_its_exit_code():
    """SIGTERM (Kubernetes, scancel, a node drain) and SIGUSR1 mean "checkpoint and let the scheduler requeue" (75,
    EX_TEMPFAIL), SIGINT is Ctrl-C (130); a second signal aborts at once."""
    from megarl.trainer.run import STOP_SIGNALS, _stop_handler

    assert STOP_SIGNALS == {signal.SIGINT: 130, signal.SIGTERM: 75, signal.SIGUSR1: 75}

    class FakeSteps:
        stop_requested = False
        progress = type("P", (), {"message": staticmethod(lambda text: messages.append(text))})

    messages, received = [], []
    steps = FakeSteps()
    handle = _stop_handler(steps, received)
    handle(signal.SIGTERM, None)
    assert steps.stop_requested and received == [signal.SIGTERM]
    assert messages == [
        "megarl: SIGTERM: stopping after this step (a checkpoint will be saved); SIGTERM again to abort"
    ]
    with pytest.raises(KeyboardInterrupt):
        handle(signal.SIGTERM, None)
