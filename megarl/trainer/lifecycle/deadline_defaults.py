"""The default deadline of each phase of a step (run.phase_timeouts unset or null), from the job's config: they grow
with the phase's work (rows, tokens, engines, training GPUs), generously, for slow hardware (a CPU, a 671B MoE). The
phases and their checks: trainer/loops/deadlines.py; the table of formulas: docs/reliability.md, Phase deadlines.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megarl.job import JobConfig

_BASE_S = {"rollout": 600, "reward": 600, "handover": 600, "logprobs": 1800, "update": 1800, "sync": 1800}
_CHECKPOINT_S = 3600.0
_HEALTH_S = 120.0
_DECODE_STEP_S = 0.25
"""Seconds one decode step of a wave of _WAVE sequences may take on one engine."""
_WAVE = 128
_REWARD_PER_ROW_S = 0.2
_FORWARD_PER_TOKEN_S = 0.01
"""Seconds of one training GPU per token of a forward pass; an update counts three (forward and backward)."""


def default_timeouts(config: JobConfig, eval_rows: int = 0) -> dict[str, float]:
    """Every phase's default deadline, in seconds, for this job (`eval_rows`: prompts of the eval set)."""
    rollout, rl = config.rollout, config.rl
    engines = max(_num_engines(config), 1)
    turns = config.agent.max_turns if config.agent.enabled else 1
    rows = rl.prompts_per_step * rollout.sampling.n
    prompt_tokens = config.data.max_prompt_tokens or 1024
    train_gpus = config.placement.train_gpus

    def generate_s(num_rows: int, max_new_tokens: int) -> float:
        waves = math.ceil(num_rows / engines / _WAVE)
        return _BASE_S["rollout"] + _DECODE_STEP_S * max_new_tokens * turns * max(waves, 1)

    rl_tokens = rows * (prompt_tokens + rollout.sampling.max_new_tokens)
    stages = config.run.stages
    train_tokens = max(
        rl_tokens if config.rl_stages else 0,
        config.sft.batch_size * config.sft.data.max_tokens if "sft" in stages else 0,
        2 * config.rm.batch_size * config.rm.data.max_tokens if "rm" in stages else 0,  # a pair: two sequences
    )
    forward_s = _FORWARD_PER_TOKEN_S * rl_tokens / train_gpus
    update_s = 3 * _FORWARD_PER_TOKEN_S * train_tokens * rl.ppo_epochs / train_gpus
    eval_rows = eval_rows * rollout.eval_sampling.n
    timeouts = {
        "rollout": generate_s(rows, rollout.sampling.max_new_tokens),
        "reward": _BASE_S["reward"] + _REWARD_PER_ROW_S * rows,
        "handover": float(_BASE_S["handover"]),
        "logprobs": _BASE_S["logprobs"] + forward_s,
        "update": _BASE_S["update"] + update_s,
        "sync": float(_BASE_S["sync"]),
        "checkpoint": _CHECKPOINT_S,
        "eval": generate_s(eval_rows, rollout.eval_sampling.max_new_tokens) + _REWARD_PER_ROW_S * eval_rows,
        "health": _HEALTH_S,
    }
    timeouts["wait"] = timeouts["rollout"] + timeouts["reward"]
    return {name: round(seconds, 1) for name, seconds in timeouts.items()}


def phase_timeouts(config: JobConfig, eval_rows: int = 0) -> dict[str, float]:
    """The deadline of every phase: `run.phase_timeouts` where set, else the default."""
    timeouts = default_timeouts(config, eval_rows)
    timeouts.update({name: float(s) for name, s in config.run.phase_timeouts.items() if s is not None})
    return timeouts


def _num_engines(config: JobConfig) -> int:
    placement, per_engine = config.placement, config.rollout.gpus_per_engine
    gpus = placement.rollout_gpus if placement.mode == "split" else placement.train_gpus
    return gpus // per_engine
