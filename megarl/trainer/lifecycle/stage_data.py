"""The stages of a run: their data (read and checked before anything starts, samplers resumed from the trainer
state) and what happens between stages (a fresh optimizer, weights synced into the engines, the reference model
taking the actor's weights after SFT, a baseline evaluation)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from megarl.data.pairs import PairDataset
from megarl.data.prompts import PromptDataset
from megarl.data.sft import SFTDataset
from megarl.rewards.runner import RewardRunner
from megarl.trainer.lifecycle.handover import Handover
from megarl.trainer.lifecycle.roles import Roles
from megarl.trainer.lifecycle.run_checkpoint import RunCheckpoints, TrainerState
from megarl.trainer.loops.steps import Steps
from megarl.trainer.rollout_side.engine_sync import WeightSync

if TYPE_CHECKING:
    from megarl.job import JobConfig


@dataclass
class StageData:
    prompts: PromptDataset | None = None
    eval_prompts: PromptDataset | None = None
    sft: SFTDataset | None = None
    pairs: PairDataset | None = None
    prompt_sampler: Any = None
    sft_sampler: Any = None
    pair_sampler: Any = None

    def samplers(self) -> dict[str, Any]:
        named = {"prompts": self.prompt_sampler, "sft": self.sft_sampler, "rm": self.pair_sampler}
        return {name: sampler for name, sampler in named.items() if sampler is not None}


@dataclass
class RunParts:
    """What the stages of a run are built from; `run_stage` hands each loop the parts it uses."""

    config: JobConfig
    roles: Roles
    tokenizer: Any
    rewards: RewardRunner
    checkpoints: RunCheckpoints
    steps: Steps
    handover: Handover
    sync: WeightSync


def build_stage_data(config: JobConfig, tokenizer) -> StageData:
    """Read, render and check every dataset the stages use (a bad row fails here, before anything starts)."""
    data = StageData()
    if config.rl_stages:
        data.prompts = PromptDataset(config.data, tokenizer, "train", key="data")
        data.prompt_sampler = data.prompts.sampler(config.rl.prompts_per_step)
    if config.data.eval_files:
        data.eval_prompts = PromptDataset(config.data, tokenizer, "eval", key="data")
    if "sft" in config.run.stages:
        data.sft = SFTDataset(config.sft.data, tokenizer, "train", key="sft.data")
        data.sft_sampler = data.sft.sampler(config.sft.batch_size)
    if "rm" in config.run.stages:
        data.pairs = PairDataset(config.rm.data, tokenizer, "train", key="rm.data")
        data.pair_sampler = data.pairs.sampler(config.rm.batch_size)
    return data


def restore_positions(data: StageData, state: TrainerState) -> None:
    """Samplers continue where the checkpoint's run stopped."""
    for name, sampler in data.samplers().items():
        if name in state.data:
            sampler.load_state_dict(state.data[name])


def stage_steps(config: JobConfig, stage: str) -> int:
    return {"sft": config.sft.num_steps, "rm": config.rm.num_steps}.get(stage, config.rl.num_steps)


def total_steps(config: JobConfig) -> int:
    return sum(stage_steps(config, stage) for stage in config.run.stages)


def run_stage(run: RunParts, data: StageData) -> None:
    from megarl.trainer.loops.rl_loop import run_rl
    from megarl.trainer.loops.rm_loop import run_rm
    from megarl.trainer.loops.sft_loop import run_sft

    config, roles, steps, state = run.config, run.roles, run.steps, run.steps.state
    stage = config.run.stages[state.stage_index]
    steps.progress.message(f"megarl: stage {stage} ({stage_steps(config, stage)} steps) from step {state.step}")
    if stage == "sft":
        _prepare_optimizer(run, config.sft.optim, config.sft.num_steps)
        run_sft(config.sft, roles.actor, data.sft, data.sft_sampler, steps, run.handover, run.sync)
    elif stage == "rm":
        run_rm(config.rm, roles.reward_model, data.pairs, data.pair_sampler, steps, run.handover)
    else:
        _prepare_optimizer(run, config.actor.optim, config.rl.num_steps * config.rl.ppo_epochs * config.rl.mini_batches)
        _prepare_rl(run)
        if config.rl.mode == "async":
            from megarl.trainer.loops.async_loop import run_async_rl

            run_async_rl(config, roles, run.tokenizer, data.prompt_sampler, steps, run.sync)
        else:
            run_rl(config, roles, run.tokenizer, run.rewards, data.prompt_sampler, steps, run.handover, run.sync)


def _prepare_optimizer(run: RunParts, settings, total_steps: int) -> None:
    """A stage that starts after another gets its own optimizer (the first stage's was built at set-up)."""
    state = run.steps.state
    if state.step == 0 and state.stage_index > 0:
        run.handover.to_training()
        run.roles.actor.call("set_optimizer", settings, total_steps)


def _prepare_rl(run: RunParts) -> None:
    """Engines get the actor's current weights; after SFT the reference model becomes the SFT'd actor."""
    state, steps = run.steps.state, run.steps
    previous = run.config.run.stages[: state.stage_index]
    if state.step == 0 and run.roles.ref is not None and "sft" in previous:
        latest = run.checkpoints.latest()
        if latest is None:
            raise RuntimeError("the reference model needs the end-of-SFT checkpoint (checkpoint.save_at_end)")
        run.handover.to_training()
        run.roles.ref.call("load_checkpoint", str(latest / "actor"), False)
    # a resumed stage's engines restarted: they get the weights again, at the version they already have
    metrics = run.handover.to_rollout(lambda: run.sync(new_version=state.step == 0))
    metrics.update(run.sync.run_probe(run.handover))  # the engines behave like the actor, or the run stops
    if state.step == 0 and state.stage_index == 0 and run.config.rl.eval_at_start:
        if steps.evaluator is not None:
            with steps.phase("eval"):
                metrics.update(steps.evaluator.evaluate())
        steps.logger.log(state.global_step, metrics)
        steps.progress.message(_describe_eval(metrics))


def _describe_eval(metrics: dict[str, float]) -> str:
    if "eval/accuracy" not in metrics:
        return "megarl: no eval set (data.eval_files)"
    return (
        f"megarl: eval accuracy {metrics['eval/accuracy']:.3f} on {int(metrics['eval/num_prompts'])} prompts "
        f"(reward {metrics['eval/reward']:.3f})"
    )
