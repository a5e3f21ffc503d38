"""`megarl train`: one run from a job config — check, prepare, start the roles, run the stages, shut down.

A run folder holds the resolved config, metrics.jsonl, TensorBoard events, plots and checkpoints. With
run.resume=auto a run folder that has a checkpoint continues from it: the stage, step, data position and weight
version come from `trainer_state.json`, every trained role from its checkpoint (at whatever layout it was saved).
"""

from __future__ import annotations

import copy
import logging
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from megarl.errors import RunFailure, UserError
from megarl.trainer.lifecycle.run_checkpoint import RunCheckpoints, TrainerState
from megarl.trainer.loops.steps import StopRun

if TYPE_CHECKING:
    from megarl.cluster.ray_runtime import BackgroundStart
    from megarl.job import JobConfig

log = logging.getLogger("megarl")


def train(config: JobConfig, ray_start: BackgroundStart | None = None) -> int:
    """Run every stage of `config`; returns the exit code (0 done, 130 interrupted, 75 stopped by SIGTERM or
    SIGUSR1 to be requeued: see STOP_SIGNALS). A worker that dies or fails
    mid-run makes every role restart from the last checkpoint, up to run.max_restarts times. `ray_start`: the
    local Ray instance, already booting (megarl/trainer/lifecycle/ray_start.py); the caller closes it."""
    try:
        with _stop_signals_outside_steps():
            return _train(config, ray_start)
    except SignalOutsideSteps as stop:
        name = signal.Signals(stop.signum).name
        print(
            f"megarl: {name} before the first step or after the last: stopped; the latest checkpoint (if any) stands",
            file=sys.stderr,
        )
        return STOP_SIGNALS[stop.signum]


class SignalOutsideSteps(BaseException):
    """SIGTERM or SIGUSR1 while the run starts (or shuts down): there is no step to finish, so it stops at once,
    through every clean-up (Ray, engines, workers), like Ctrl-C does."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


@contextmanager
def _stop_signals_outside_steps() -> Iterator[None]:
    """Outside the step loop (which installs its own handler: finish the step, save, stop), SIGTERM and SIGUSR1
    stop the run at once through its clean-up and exit 75: by default they would kill the process on the spot,
    leaving a local Ray instance and engine processes behind and giving the scheduler no requeue code."""

    def stop(signum, frame):
        raise SignalOutsideSteps(signum)

    requeue = [signum for signum in STOP_SIGNALS if signum != signal.SIGINT]
    previous = {signum: signal.signal(signum, stop) for signum in requeue}
    try:
        yield
    finally:
        for signum, before in previous.items():
            signal.signal(signum, before)


def _train(config: JobConfig, ray_start: BackgroundStart | None) -> int:
    from megarl.checkpoint.hub import localize_model_paths
    from megarl.cluster.errors import WorkerError
    from megarl.config import config_hash, save_resolved
    from megarl.trainer.lifecycle.model_init import ensure_model
    from megarl.trainer.lifecycle.preflight import check_teacher, preflight
    from megarl.trainer.lifecycle.teacher import ensure_teacher

    started = time.monotonic()
    localize_model_paths(config)  # Hub ids: fetched into (or found in) the Hugging Face cache
    preflight(config)
    run_dir = Path(config.run.dir)
    checkpoints = RunCheckpoints(run_dir, config.checkpoint.keep)
    _check_resume(config, checkpoints)
    ensure_model(config.model.path, config.model.init)
    tokenizer, data = _read_data(config)  # every row checked before the run folder or any process exists
    if code := ensure_teacher(config, train):  # distillation: a teacher the job trains first (teacher.train)
        return code
    check_teacher(config, tokenizer=tokenizer)
    run_dir.mkdir(parents=True, exist_ok=True)
    save_resolved(config, run_dir / "config.yaml")
    # A restart with no checkpoint yet starts the data from the beginning again, not where the failed attempt was.
    first_positions = {name: sampler.state_dict() for name, sampler in data.samplers().items()}
    for attempt in range(config.run.max_restarts + 1):
        latest = checkpoints.latest()
        fresh = TrainerState(config_hash=config_hash(config), data=copy.deepcopy(first_positions))
        state = TrainerState.load(latest) if latest else fresh
        if latest and state.config_hash != config_hash(config):
            log.warning("the config differs from the one that wrote %s; continuing with the new one", latest)
        try:
            with ExitStack() as stack:
                booting, ray_start = ray_start, None  # a restart starts Ray again
                run = _start(config, run_dir, checkpoints, state, latest, stack, tokenizer, data, booting)
                code = _run_stages(run, data)
            _summarize(config, checkpoints, code, time.monotonic() - started)  # plots drawn, workers stopped
            return code
        except WorkerError as err:
            newest = checkpoints.latest()
            where = f"checkpoint {newest.name}" if newest else "the start (no checkpoint was written yet)"
            if err.raised("NonFiniteGradients"):  # the same data would fail the same way after a restart
                raise RunFailure(
                    f"{err}\nNo checkpoint holds non-finite weights: rerun to resume from {where}, e.g. with a lower "
                    "learning rate or stronger gradient clipping."
                ) from err
            if attempt == config.run.max_restarts:
                raise RunFailure(
                    f"{err}\nThe run stopped after {attempt} restart(s) (run.max_restarts={config.run.max_restarts}); "
                    f"checkpoints are intact: rerun the same command to resume from {where}."
                ) from err
            log.warning("a worker failed (%s); restarting every role from %s", str(err).splitlines()[0], where)
    raise AssertionError("unreachable")


def dry_run(config: JobConfig, notes: list[str] | None = None) -> int:
    """`megarl train --dry-run`: every check `train` makes before it starts anything (config, model files, data rows,
    checkpoints to resume, the plan's memory verdict), then the resolved config, the placement and the SGLang launch
    commands. Starts neither Ray nor a model and writes nothing; 0 when the job would start, 1 when the plan says it
    does not fit (other problems raise UserError: exit 2)."""
    from megarl.config.dump import to_yaml
    from megarl.plan import run_plan
    from megarl.trainer.lifecycle.preflight import preflight, would_start

    preflight(config, check_memory=False, off_machine=True)
    latest = _check_resume(config, RunCheckpoints(Path(config.run.dir), config.checkpoint.keep))
    resume = f"resume from {latest}" if latest is not None else "start fresh"
    if notes:  # data files only on the cluster (megarl.plan.load_for_planning)
        data_note = "; ".join(notes) + "; train reads every row there"
    elif Path(config.model.path).exists():
        _read_data(config)  # every row of every file, with the model's tokenizer
        data_note = "every data row checked"
    elif config.model.init is None:
        data_note = (
            f"model.path={config.model.path} is not on this machine: checked against plan.model_config; train reads "
            "the weights, the tokenizer and every data row on the cluster"
        )
    else:
        data_note = f"data rows are checked once model.init has built {config.model.path} (it holds the tokenizer)"
    report = run_plan(config, "")
    print("resolved config\n" + "\n".join(f"  {line}" for line in to_yaml(config).splitlines()))
    print(report.render().split("\n", 1)[1])  # the plan without its title line
    print(f"\ndry run: {data_note}; the run would {resume} in {config.run.dir}; nothing was started")
    return 0 if would_start(config, report) else 1


def _check_resume(config: JobConfig, checkpoints: RunCheckpoints) -> Path | None:
    """The checkpoint a run would resume from (None: it starts fresh), refusing what it cannot resume."""
    latest = checkpoints.latest()
    if latest is not None and config.run.resume == "never":
        raise UserError(
            f"{config.run.dir} already has checkpoints; use another run.dir, or run.resume=auto to continue"
        )
    if latest is not None:
        TrainerState.load(latest)  # a damaged trainer state is reported before anything is written
    return latest


def _read_data(config: JobConfig):
    from transformers import AutoTokenizer

    from megarl.bridge.safetensors_io import HFCheckpoint
    from megarl.checkpoint.model_dir import hf_config_dir, is_megarl_checkpoint
    from megarl.trainer.lifecycle.stage_data import build_stage_data

    if not is_megarl_checkpoint(config.model.path):
        HFCheckpoint(config.model.path)  # every safetensors header: a truncated or corrupted file is named now
    try:
        tokenizer = AutoTokenizer.from_pretrained(hf_config_dir(config.model.path), local_files_only=True)
    except (OSError, ValueError) as err:
        raise UserError(f"model.path={config.model.path!r} has no usable tokenizer ({err})") from err
    return tokenizer, build_stage_data(config, tokenizer)


@contextmanager
def _single_threaded_torch() -> Iterator[None]:
    """The controller's torch ops run on one thread for the run. Its tensors are small (a batch's token ids and
    rewards), and an intra-op thread team of its own takes cores from the workers: Ray runs them at a lower priority
    (niceness 15), so on a small machine the controller's idle threads preempt the training (vs_trl: about 5-10%
    of a step on 2 cores)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _start(
    config: JobConfig,
    run_dir: Path,
    checkpoints,
    state: TrainerState,
    latest,
    stack: ExitStack,
    tokenizer,
    data,
    ray_start: BackgroundStart | None = None,
):
    from megarl.cluster.orphans import kill_leftover_processes, record_local_processes
    from megarl.cluster.ray_runtime import start_ray, stop_ray
    from megarl.rewards.runner import RewardRunner
    from megarl.rollout.sglang_launch import model_is_mla
    from megarl.rollout.weights_format import rollout_quantization
    from megarl.trainer.lifecycle.checkpointer import Checkpointer
    from megarl.trainer.lifecycle.deadline_defaults import phase_timeouts
    from megarl.trainer.lifecycle.handover import Handover
    from megarl.trainer.lifecycle.roles import start_roles
    from megarl.trainer.lifecycle.stage_data import RunParts, restore_positions, total_steps
    from megarl.trainer.loops.evaluation import Evaluator
    from megarl.trainer.loops.steps import Steps
    from megarl.trainer.observability.memory_metrics import MemoryProbe
    from megarl.trainer.observability.metrics import build_logger
    from megarl.trainer.observability.plots import BackgroundPlotter
    from megarl.trainer.observability.progress import RunProgress
    from megarl.trainer.rollout_side.agent_rollout import rollout_generator
    from megarl.trainer.rollout_side.engine_sync import WeightSync
    from megarl.trainer.rollout_side.sync_probe import build_probe

    restore_positions(data, state)
    plots = BackgroundPlotter(run_dir) if config.logging.plots else None
    if plots is not None:  # the last callback to run: the final drawing overlaps everything's shutdown
        stack.callback(plots.close, False)
    stack.enter_context(_single_threaded_torch())
    rewards = stack.enter_context(RewardRunner(config.reward))
    cluster = config.ray_cluster()
    if ray_start is not None:
        ray_info = ray_start.result()
    else:
        if cluster.is_local:
            kill_leftover_processes(run_dir)  # of an earlier driver of this run that was killed hard
        ray_info = start_ray(cluster)
    stack.callback(stop_ray)
    kind = "a local instance" if ray_info.started_locally else f"joined {ray_info.address}"
    _say(f"Ray: {kind} ({ray_info.describe()}); starting the workers")
    resume = _Resume(latest, state.stage_index) if latest else None
    begun = time.monotonic()
    roles = start_roles(config, rl_optimizer_steps(config), resume)
    stack.callback(roles.shutdown)
    _say(f"workers ready in {time.monotonic() - begun:.1f} s ({_describe_workers(roles)})")
    if cluster.is_local:
        record_local_processes(run_dir)
    if latest is not None:
        _restore_roles(config, roles, latest, state)
    logger = stack.enter_context(build_logger(run_dir, config.logging, resume_step=state.global_step))
    progress = RunProgress(
        total_steps(config),
        state.global_step,
        keys=config.logging.progress_keys,
        enabled=config.logging.progress,
        console_every=config.logging.console_every,
    )
    stack.callback(progress.close)
    quantization = rollout_quantization(config.rollout, config.model.path)
    transport = config.weight_sync_transport()
    mla = model_is_mla(config.model.path) if config.rollout.backend == "sglang" else None  # delta sync's rule
    sync = WeightSync(roles, state, config.rollout, transport, quantization, run_dir / "weight_sync", mla)
    sync.probe = build_probe(config, data.prompts, tokenizer, quantization)
    on_gpus = roles.on_gpus()
    hand_over = on_gpus or config.placement.handover == "always"
    handover = Handover(roles, config.placement.offload, lambda: sync(new_version=False), enabled=hand_over)
    trained = {"actor": roles.actor, "critic": roles.critic}
    if "rm" in config.run.stages:
        trained["reward_model"] = roles.reward_model
    evaluator = None
    if data.eval_prompts is not None and len(data.eval_prompts):
        generate = rollout_generator(config, roles.rollout, tokenizer, config.rollout.eval_sampling)
        evaluator = Evaluator(generate, data.eval_prompts, rewards, handover)
    steps = Steps(
        state,
        logger,
        progress,
        Checkpointer(checkpoints, {k: g for k, g in trained.items() if g is not None}, state, handover),
        config.checkpoint,
        handover,
        MemoryProbe(roles.processes(), config.logging.memory, every_phase=on_gpus or handover.enabled),
        evaluator,
        num_sample_logs=config.rl.num_sample_logs,
        deadlines=phase_timeouts(config, len(data.eval_prompts) if data.eval_prompts is not None else 0),
        plots=plots,
        should_plot=config.logging.should_plot,
    )
    log.info("phase deadlines (s): %s", ", ".join(f"{name} {s:g}" for name, s in steps.deadlines.items()))
    if plots is not None:
        stack.callback(plots.finish)
    return RunParts(config, roles, tokenizer, rewards, checkpoints, steps, handover, sync)


def _say(line: str) -> None:
    """A start-up line: before the first step the progress display does not exist yet."""
    print(f"megarl: {line}", flush=True)


def _describe_workers(roles) -> str:
    from megarl.workers.hybrid_worker import EngineView

    sharing = roles.sharing_groups()
    groups = [
        f"{group.role} {group.world_size}" + ("" if group in sharing else " on GPUs of its own")
        for group in roles.training_groups()
    ]
    engines = roles.rollout.world_size
    where = "inside the actor's workers" if isinstance(roles.rollout, EngineView) else "in workers of their own"
    return f"{', '.join(groups)}; {engines} rollout engine{'s' * (engines != 1)} {where}"


class _Resume:
    def __init__(self, folder: Path, stage_index: int):
        self.folder = folder
        self.stage_index = stage_index


def rl_optimizer_steps(config: JobConfig) -> int:
    return config.rl.num_steps * config.rl.ppo_epochs * config.rl.mini_batches


def _restore_roles(config: JobConfig, roles, latest: Path, state: TrainerState) -> None:
    """Optimizer and RNG states of the trained roles (their weights were loaded at set-up). A stage that had not
    started when the checkpoint was written starts with a fresh optimizer."""
    if state.step == 0:
        return
    for name, group in (("actor", roles.actor), ("critic", roles.critic), ("reward_model", roles.reward_model)):
        if group is not None and (latest / name).is_dir():
            group.call("load_checkpoint", str(latest / name), True, False)


STOP_SIGNALS = {signal.SIGINT: 130, signal.SIGTERM: 75, signal.SIGUSR1: 75}
"""Signals that stop a run at the next step's end with a checkpoint, and the exit code each gives: 130 for Ctrl-C;
75 (EX_TEMPFAIL: "try again") for SIGTERM (Kubernetes, `scancel`, a node drain) and SIGUSR1 (Slurm's warning
before the time limit, `#SBATCH --signal=B:USR1@300`): a scheduler that sees 75 requeues the job, and the same
command resumes from that checkpoint."""


def _run_stages(run, data) -> int:
    from megarl.trainer.lifecycle.stage_data import run_stage

    steps, state = run.steps, run.steps.state
    received: list[int] = []
    handler = _stop_handler(steps, received)
    previous = {signum: signal.signal(signum, handler) for signum in STOP_SIGNALS}
    try:
        while state.stage_index < len(run.config.run.stages):
            run_stage(run, data)
            state.stage_index += 1
            state.step = 0
            if run.config.checkpoint.save_at_end:
                with steps.phase("checkpoint"):
                    steps.checkpointer.save(data.samplers())
    except StopRun as stop:
        steps.progress.message(f"megarl: {stop}")
        return STOP_SIGNALS[received[0]] if received else 130
    finally:
        for signum, before in previous.items():
            signal.signal(signum, before)
    return 0


def _summarize(config: JobConfig, checkpoints: RunCheckpoints, code: int, seconds: float) -> None:
    """The end-of-run summary (megarl/trainer/observability/summary.py); it never fails a finished run."""
    from megarl.trainer.lifecycle.stage_data import stage_steps
    from megarl.trainer.observability.summary import RunSummary, print_summary, resume_command

    run_dir = Path(config.run.dir)
    stopped = None if code == 0 else {130: "Ctrl-C", 75: "stop signal: requeue or rerun to resume"}.get(code, str(code))
    try:
        print_summary(
            RunSummary(
                run_dir,
                [(stage, stage_steps(config, stage)) for stage in config.run.stages],
                seconds,
                resume_command(run_dir),
                checkpoints.pointed(),  # not latest(): its check of the shards costs seconds of imports
                stopped,
            )
        )
    except Exception as err:
        log.warning("could not print the run's summary: %s", err)


def _stop_handler(steps, received: list[int]):
    """The first stop signal: finish the step, save a checkpoint, stop. A second one: stop at once (the last
    checkpoint stands)."""

    def handle(signum, frame):
        if steps.stop_requested:
            raise KeyboardInterrupt
        received.append(signum)
        steps.stop_requested = True
        name = signal.Signals(signum).name
        again = "Ctrl-C" if signum == signal.SIGINT else name
        steps.progress.message(
            f"megarl: {name}: stopping after this step (a checkpoint will be saved); {again} again to abort"
        )

    return handle
