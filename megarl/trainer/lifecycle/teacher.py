"""On-policy distillation's teacher before the run starts: trained first when the job says how (teacher.train),
then checked like every role's model (architecture, layout) and against the student's tokenizer.

A teacher the run trains is a job of its own (teacher.train.config, with teacher.train.overrides), run in
run.dir/teacher as `megarl train` would run it: it resumes there after an interruption, and a folder that holds
its finished run is used as it is. Its last checkpoint's actor becomes teacher.model.path.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from megarl.errors import UserError

if TYPE_CHECKING:
    from megarl.job import JobConfig

TEACHER_RUN = "teacher"
"""The teacher's run folder inside the distilling run's (teacher.train)."""


def teacher_run_dir(config: JobConfig) -> Path:
    return Path(config.run.dir) / TEACHER_RUN


def ensure_teacher(config: JobConfig, train: Callable[[JobConfig], int]) -> int:
    """Train the teacher when teacher.model.path is empty (teacher.train.config) with `train` (`megarl train`'s),
    then point teacher.model.path at its last checkpoint's actor; returns the teacher run's exit code (0: the
    teacher is ready)."""
    from megarl.config import load_config
    from megarl.trainer.lifecycle.run_checkpoint import RunCheckpoints, TrainerState

    teacher = config.teacher
    if not config.needs_teacher or teacher.model.path:
        return 0
    run_dir = teacher_run_dir(config)
    job = load_config(type(config), teacher.train.config, [*teacher.train.overrides, f"run.dir={run_dir}"])
    checkpoints = RunCheckpoints(run_dir, job.checkpoint.keep)
    latest = checkpoints.latest()
    if latest is None or TrainerState.load(latest).stage_index < len(job.run.stages):
        print(
            f"megarl: stage teacher: training the teacher with {teacher.train.config} in {run_dir} "
            f"(stages {', '.join(job.run.stages)}); then the distillation",
            flush=True,
        )
        code = train(job)
        if code != 0:
            return code
        latest = checkpoints.latest()
        if latest is None or TrainerState.load(latest).stage_index < len(job.run.stages):
            raise UserError(
                f"teacher.train.config={teacher.train.config!r} finished without a final checkpoint in {run_dir}; "
                "keep checkpoint.save_at_end=true in that job"
            )
    else:
        print(f"megarl: stage teacher: done already ({latest / 'actor'})", flush=True)
    teacher.model.path = str(latest / "actor")
    return 0


def check_same_tokenizer(path: str, student) -> None:
    """Distillation compares the two models' log-probs of the same token ids: the teacher's tokenizer must map
    every token to the id the student's does."""
    from transformers import AutoTokenizer

    from megarl.checkpoint.model_dir import hf_config_dir

    try:
        teacher = AutoTokenizer.from_pretrained(hf_config_dir(path), local_files_only=True)
    except (OSError, ValueError) as err:
        raise UserError(f"teacher.model.path={path!r} has no usable tokenizer ({err})") from err
    mine, theirs = student.get_vocab(), teacher.get_vocab()
    differ = sorted(token for token in mine.keys() | theirs.keys() if mine.get(token) != theirs.get(token))
    if differ:
        shown = ", ".join(repr(token) for token in differ[:5])
        raise UserError(
            f"teacher.model.path={path!r}: its tokenizer differs from the student's (model.path) on {len(differ)} of "
            f"{len(mine | theirs)} tokens (e.g. {shown}); distillation compares both models' log-probs of the same "
            "token ids, so the teacher needs the student's tokenizer"
        )
