"""On-policy distillation: the advantage by hand (the mix with the reward, masked tokens), the config's errors, and
one real run whose teacher the run trains itself (teacher.train) and which is identical to the student's start, so
the logged reverse KL is exactly 0 at the first step and moves once the student does (the teacher stays frozen).

The full CPU quickstart (configs/distill_quickstart.yaml, a few minutes) is not run here: its numbers are in
tools/bench/README.md.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from job_helpers import REPO, megarl_train, metrics, write_config

from megarl.algorithms.config import AlgorithmConfig
from megarl.algorithms.distillation import distillation_advantages, distillation_metrics
from megarl.config import load_config
from megarl.data.batch import Batch
from megarl.errors import UserError
from megarl.job import JobConfig

# 2 samples, 4 positions: a prompt token, then the response; sample 1's position 2 is an agent episode's
# observation (tool output): outside the response mask.
MASK = torch.tensor([[0, 1, 1, 1], [0, 1, 0, 1]])
STUDENT = torch.tensor([[-9.0, -0.5, -1.0, -2.0], [-9.0, -0.2, -3.0, -1.5]])
TEACHER = torch.tensor([[-1.0, -0.7, -0.4, -2.0], [-1.0, -1.2, -0.1, -0.5]])
# student - teacher on response tokens: [., .2, -.6, 0], [., 1.0, (masked), -1.0]


def test_the_advantage_mixes_the_reward_and_the_negated_reverse_kl_on_response_tokens_only():
    reward_advantages = torch.tensor([[0.0, 0.5, 0.5, 0.5], [0.0, -0.5, -0.5, -0.5]])
    advantages, reverse_kl = distillation_advantages(
        reward_advantages, STUDENT, TEACHER, MASK, coef=2.0, reward_coef=0.5
    )
    torch.testing.assert_close(reverse_kl, torch.tensor([[0.0, 0.2, -0.6, 0.0], [0.0, 1.0, 0.0, -1.0]]))
    # 0.5 * A - 2 * KL: .25 - .4, .25 + 1.2, .25 + 0 / -.25 - 2, (observation: 0), -.25 + 2
    expected = torch.tensor([[0.0, -0.15, 1.45, 0.25], [0.0, -2.25, 0.0, 1.75]])
    torch.testing.assert_close(advantages, expected)
    # pure distillation (reward weight 0): the negated reverse KL, whatever the reward says
    pure, _ = distillation_advantages(reward_advantages, STUDENT, TEACHER, MASK, coef=1.0, reward_coef=0.0)
    torch.testing.assert_close(pure, torch.tensor([[0.0, -0.2, 0.6, 0.0], [0.0, -1.0, 0.0, 1.0]]))
    got = distillation_metrics(reverse_kl, TEACHER, MASK)
    # 5 response tokens: KL (.2 - .6 + 0 + 1 - 1) / 5; per sample -.4 and 0; teacher (-.7 -.4 -2 -1.2 -.5) / 5
    assert got == pytest.approx(
        {"distill/reverse_kl": -0.08, "distill/reverse_kl_per_sample": -0.2, "distill/teacher_logprob": -0.96}
    )


def test_the_rl_step_mixes_the_teacher_into_the_estimators_advantage():
    """The RL loops' advantage step: GRPO on the rewards, then the teacher's term; distillation off: GRPO alone."""
    from megarl.trainer.loops.rl_steps import add_advantages

    batch = Batch(
        {
            "token_rewards": torch.tensor([[0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]]),
            "response_mask": MASK,
            "group_ids": torch.tensor([0, 0]),
            "old_logprobs": STUDENT,
            "teacher_logprobs": TEACHER,
        }
    )
    off, off_metrics = add_advantages(batch, AlgorithmConfig())
    grpo = 0.5 / math.sqrt(0.5)  # scores 1, 0: mean .5, unbiased std sqrt(.5)
    torch.testing.assert_close(off["advantages"], torch.tensor([[0, grpo, grpo, grpo], [0, -grpo, 0, -grpo]]))
    assert not any(name.startswith("distill/") for name in off_metrics)
    mixed, mixed_metrics = add_advantages(batch, AlgorithmConfig(distill_coef=2.0, distill_reward_coef=0.5))
    expected = torch.tensor(
        [[0, 0.5 * grpo - 0.4, 0.5 * grpo + 1.2, 0.5 * grpo], [0, -0.5 * grpo - 2.0, 0, -0.5 * grpo + 2.0]]
    )
    torch.testing.assert_close(mixed["advantages"], expected)
    assert mixed_metrics["distill/reverse_kl"] == pytest.approx(-0.08)


# ---- config errors ----------------------------------------------------------------------------------------------


def _load(tmp_path, *overrides: str) -> JobConfig:
    return load_config(JobConfig, write_config(tmp_path, "[grpo]", 1), list(overrides))


def test_distillation_without_a_teacher_names_both_ways_to_give_one(tmp_path):
    with pytest.raises(
        UserError, match=r"algorithm.distill_coef=1.0 .* set teacher.model.path .* teacher.train.config"
    ):
        _load(tmp_path, "algorithm.distill_coef=1.0")


def test_a_teacher_backend_megarl_does_not_have_is_named(tmp_path):
    with pytest.raises(UserError, match=r"teacher.backend.*'vllm'.*megatron.*sglang"):
        _load(tmp_path, "algorithm.distill_coef=1.0", "teacher.backend=vllm", f"teacher.model.path={tmp_path}")


def test_negative_weights_and_a_bad_teacher_job_are_named(tmp_path):
    with pytest.raises(UserError, match=r"algorithm.distill_reward_coef=-1.0 must be in \[0.0, inf\)"):
        _load(tmp_path, "algorithm.distill_reward_coef=-1.0")
    missing = tmp_path / "nowhere.yaml"
    with pytest.raises(UserError, match=rf"teacher.train.config='{missing}': .*nowhere.yaml"):
        _load(tmp_path, "algorithm.distill_coef=1.0", f"teacher.train.config={missing}")


def test_a_teacher_section_without_distillation_warns(tmp_path):
    with pytest.warns(UserWarning, match="the teacher section has no effect: algorithm.distill_coef=0"):
        _load(tmp_path, f"teacher.model.path={tmp_path}")


# ---- the teacher a run trains first (teacher.train) ----------------------------------------------------------


def test_a_teacher_job_runs_once_and_its_last_actor_becomes_the_teacher(tmp_path):
    """ensure_teacher with a stand-in for `megarl train` that leaves what a finished run leaves (a real teacher run is
    the distillation quickstart's first stage, too long for this suite): the run checkpoints and trainer state."""
    from megarl.trainer.lifecycle.run_checkpoint import RunCheckpoints, TrainerState
    from megarl.trainer.lifecycle.teacher import ensure_teacher

    (tmp_path / "teacher_job").mkdir()
    teacher_job = write_config(tmp_path / "teacher_job", "[grpo]", 3)
    overrides = [
        "algorithm.distill_coef=1.0",
        f"teacher.train.config={teacher_job}",
        "teacher.train.overrides=[rl.num_steps=2]",
    ]
    jobs: list[JobConfig] = []

    def train(job: JobConfig) -> int:
        jobs.append(job)
        checkpoints = RunCheckpoints(job.run.dir)
        checkpoints.commit(checkpoints.begin(2), TrainerState(stage_index=len(job.run.stages), global_step=2))
        return 0

    config = _load(tmp_path, *overrides)
    assert ensure_teacher(config, train) == 0
    (job,) = jobs
    assert job.rl.num_steps == 2 and job.run.dir == str(tmp_path / "run" / "teacher")
    assert config.teacher.model.path == str(tmp_path / "run" / "teacher" / "checkpoints" / "step_2" / "actor")
    again = _load(tmp_path, *overrides)  # a rerun of the same command: the finished teacher run is used as it is
    assert ensure_teacher(again, train) == 0 and len(jobs) == 1
    assert again.teacher.model.path == config.teacher.model.path
    interrupted = _load(tmp_path, *overrides, f"run.dir={tmp_path / 'other'}")
    assert ensure_teacher(interrupted, lambda job: 130) == 130 and interrupted.teacher.model.path == ""


# ---- one real run -----------------------------------------------------------------------------------------------

NUM_STEPS = 2


@pytest.fixture(scope="module")
def distill_run(tmp_path_factory):
    """A 2-step GRPO run mixing the reward and distillation (weights 1 and 1) whose teacher is the student's own
    starting model, on a GPU of its own (placement.teacher_gpus=1: its own Ray pool; on the training GPUs it is
    set up and called exactly as the ref model is, which the other end-to-end tests run)."""
    from megarl.job import ModelInit
    from megarl.trainer.lifecycle.model_init import build_model_folder

    folder = tmp_path_factory.mktemp("distill")
    model = build_model_folder(ModelInit(config=str(REPO / "configs/models/tiny-qwen3.json")), folder / "model")
    distill = f"""
algorithm: {{distill_coef: 1.0}}
teacher: {{model: {{path: {model}, dtype: float32}}}}
"""

    config = write_config(folder, "[grpo]", NUM_STEPS, distill, tp=1)
    out = megarl_train(config, "rl.eval_at_start=false", "data.eval_files=[]", "placement.teacher_gpus=1")
    assert "actor 1, teacher 1 on GPUs of its own;" in out.stdout  # the start-up line
    return folder, metrics(folder / "run")


def test_a_teacher_identical_to_the_student_gives_reverse_kl_zero_until_the_student_moves(distill_run):
    """Both score the same tokens with the same weights: 0 up to float32 rounding (the actor's pass also computes the
    entropy, through other kernels). The reward's advantage alone trains step 1; step 2's samples come from the
    moved student while the teacher stayed frozen."""
    _, records = distill_run
    assert [r["step"] for r in records] == [1, 2]
    first, second = records
    assert first["distill/reverse_kl"] == pytest.approx(0.0, abs=1e-6)
    assert first["distill/reverse_kl_per_sample"] == pytest.approx(0.0, abs=1e-5)
    assert abs(second["distill/reverse_kl"]) > 1000 * max(abs(first["distill/reverse_kl"]), 1e-9)


def test_a_teacher_that_does_not_exist_or_with_another_tokenizer_is_refused(distill_run, tmp_path):
    from transformers import AutoTokenizer

    from megarl.trainer.lifecycle.preflight import check_teacher
    from megarl.trainer.lifecycle.teacher import check_same_tokenizer

    folder, _ = distill_run
    model = folder / "model"
    config = load_config(JobConfig, folder / "job.yaml", [f"teacher.model.path={tmp_path / 'none'}"])
    with pytest.raises(UserError, match=rf"teacher.model.path='{tmp_path / 'none'}' does not exist"):
        check_teacher(config)
    config.teacher.model.path = str(model)
    config.teacher.model.parallel = dataclasses.replace(config.teacher.model.parallel, tp=3)
    with pytest.raises(UserError, match=r"teacher.model.parallel.tp=3"):
        check_teacher(config)
    other = AutoTokenizer.from_pretrained(model)
    other.add_tokens(["<tool>"])
    with pytest.raises(UserError, match=r"its tokenizer differs from the student's \(model.path\) on 1 of 102 tokens"):
        check_same_tokenizer(str(model), other)
