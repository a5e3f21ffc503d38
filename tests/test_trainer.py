"""`megarl train` end to end on CPU: real Ray, a Megatron actor at TP=2, hf rollout engines, weight sync every step.

Runs are subprocesses of the real command line. The task is trivially learnable (reward: the fraction of digits in
the response), so a few steps must raise the reward.
"""

from __future__ import annotations

import json
import signal

import pytest
from job_helpers import FIXTURES, megarl_train, metrics, write_config

from megarl.trainer.observability.metrics import read_metrics


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
    # the first sync's probe: 4 prompts x 8 greedy tokens scored alike by engine and actor (sync_probe.py)
    start = next(r for r in read_metrics(run) if r["step"] == 0 and "sync/probe_gap_max" in r)
    assert start["sync/probe_gap_max"] < 1e-6 and start["sync/probe_tokens"] == 32
    assert (run / "config.yaml").is_file() and list((run / "tensorboard").iterdir())
    latest = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    assert (latest / "actor" / "model" / "metadata.json").is_file()
    assert (latest / "actor" / "optimizer" / "metadata.json").is_file()
    state = json.loads((latest / "trainer_state.json").read_text())
    assert state["global_step"] == 8 and state["weight_version"] == 9  # one sync at the start, one per step


@pytest.mark.slow
def test_ppo_trains_a_critic(tmp_path):
    config = write_config(tmp_path, "[ppo]", 6, "algorithm: {advantage: {estimator: gae, gamma: 1.0, lam: 0.95}}")
    out = megarl_train(config, "logging.progress_keys=[critic/vf_loss,reward/mean]")
    steps = metrics(tmp_path / "run")
    assert len(steps) == 6
    assert all("critic/vf_loss" in s and "actor/pg_loss" in s for s in steps)
    # the console line (plain lines: not a terminal) shows the keys asked for, in their order
    lines = [line for line in out.stdout.splitlines() if line.startswith("step ")]
    assert len(lines) == 6 and all(" critic/vf_loss " in line and " | reward " in line for line in lines), lines
    assert sum(s["reward/mean"] for s in steps[-2:]) / 2 > steps[0]["reward/mean"] + 0.1


@pytest.mark.slow
def test_dapo_dynamic_sampling_fills_each_batch_with_informative_groups(tmp_path):
    """The synchronous loop with algorithm.dapo.dynamic_sampling (trainer/loops/dynamic_sampling.py): a step draws again
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
def test_every_stop_signal_saves_and_reruns_resume_with_the_same_numbers(grpo_run, tmp_path):
    """A real `megarl train` stopped twice, by the signals a user or scheduler sends, and rerun each time: SIGTERM
    (scancel, Kubernetes, a node drain) ends the step, saves and exits 75 ("requeue me"); Ctrl-C (SIGINT) does the
    same with 130. The same command again resumes, and the three pieces give the uninterrupted run's numbers. Each
    signal arrives right after the run's 2nd step is logged (MEGARL_FAULTS sends it to the process at that exact
    point, so the steps it stops at are known). Slurm's pre-timeout warning (SIGUSR1, the same handler as SIGTERM:
    test_every_stop_signal_stops_at_a_step_end_with_its_exit_code) is sent from outside, through Slurm, by
    tests/test_slurm.py, which resumes that run too."""
    config, run = write_config(tmp_path, "[grpo]", 8), tmp_path / "run"
    for name, code, stopped_at in (("sigterm", 75, 2), ("sigint", 130, 4)):
        out = megarl_train(config, env={"MEGARL_FAULTS": f"{name}:step.logged:2"}, check=False)
        assert out.returncode == code, f"{name}: {out.stderr[-3000:]}"
        assert f"megarl: {name.upper()}: stopping after this step" in out.stdout + out.stderr
        assert (run / "checkpoints" / "latest").read_text().strip() == f"step_{stopped_at}"
        assert [s["step"] for s in metrics(run)] == list(range(1, stopped_at + 1))
    megarl_train(config)  # the same command again resumes, to the end
    a, b = metrics(grpo_run), metrics(run)
    assert [s["step"] for s in b] == list(range(1, 9))
    for x, y in zip(a, b):
        assert x["reward/mean"] == pytest.approx(y["reward/mean"], abs=1e-6)
        assert x["actor/loss"] == pytest.approx(y["actor/loss"], abs=1e-5)
    state = json.loads((run / "checkpoints/step_8/trainer_state.json").read_text())
    assert state["data"]["prompts"]["position"] == 64 and state["weight_version"] == 9


def handover_records(run) -> dict[int, list[str]]:
    """Per step, the colocated handover's calls in order (samples.jsonl, name `handover`)."""
    from megarl.trainer.observability.metrics import read_samples

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
    # before step 1: both hold their models; the first sync hands the GPUs to the engines; its probe (the engines
    # generate, the actor scores: rollout/sync_probe.py) takes them back to the actor, the eval gives them to the
    # engines again, with the same weights
    first_sync = ["actor.offload(False, True, True)", "sync", "actor.offload(True, True, True)"]
    probe = ["rollout.release_memory(weights,kv_cache)", "actor.onload"]
    assert records[1] == [*first_sync, *probe, *PLAIN_STEP[2:], *PLAIN_STEP]
    assert all(records[step] == PLAIN_STEP for step in range(2, 9))
    split = tmp_path / "split"
    split.mkdir()
    megarl_train(write_config(split, "[grpo]", 8), "placement.mode=split", "placement.rollout_gpus=2")
    assert handover_records(split / "run") == {}  # split placement hands nothing over
    assert [step["rollout/engines_healthy"] for step in metrics(split / "run")] == [2.0] * 8  # the health probe
    for a, b in zip(metrics(grpo_run), metrics(split / "run"), strict=True):
        assert {k: v for k, v in a.items() if k.startswith(("reward/", "actor/"))} == {
            k: v for k, v in b.items() if k.startswith(("reward/", "actor/"))
        }
    phases = ("rollout", "reward", "handover", "logprobs", "update", "sync")
    for step in metrics(grpo_run):  # every step carries every phase's memory
        assert {f"memory/{phase}/rss_gb" for phase in phases} <= set(step)


def test_every_stop_signal_stops_at_a_step_end_with_its_exit_code():
    """SIGTERM (Kubernetes, scancel, a node drain) and SIGUSR1 mean "checkpoint and let the scheduler requeue" (75,
    EX_TEMPFAIL), SIGINT is Ctrl-C (130); a second signal aborts at once."""
    from megarl.trainer.lifecycle.run import STOP_SIGNALS, _stop_handler

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


def test_a_stop_signal_while_the_run_starts_stops_it_through_its_clean_up(monkeypatch, capsys):
    """Before the first step (Ray, engines, workers starting) there is no step to finish: SIGTERM or SIGUSR1 stops
    the run at once through its clean-up, with the requeue code, rather than killing the process on the spot."""
    import os

    from megarl.trainer.lifecycle import run

    cleaned = []

    def starting(config, ray_start=None):
        try:
            os.kill(os.getpid(), signal.SIGUSR1)  # arrives while the roles start
            raise AssertionError("the signal did not stop the start")
        finally:
            cleaned.append(True)

    before = signal.getsignal(signal.SIGUSR1)
    monkeypatch.setattr(run, "_train", starting)
    assert run.train(None) == 75
    assert cleaned == [True]
    assert "megarl: SIGUSR1 before the first step or after the last: stopped" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGUSR1) is before  # the process' own handler is back
