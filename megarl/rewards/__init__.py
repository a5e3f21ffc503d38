"""Rewards for RL on verifiable tasks: rule verifiers (math answers, formats), user reward functions, and the runner
that calls them without letting one bad sample stop the loop. Reward-model scoring lives in the reward worker group.
"""

from megarl.rewards.builtin import BUILTIN_REWARDS, boxed_reward, format_reward, gsm8k_reward, math_reward
from megarl.rewards.config import RewardConfig
from megarl.rewards.math_answer import (
    extract_answer,
    extract_boxed,
    extract_hash_answer,
    extract_last_number,
    extract_tag_answer,
)
from megarl.rewards.math_equiv import is_equivalent
from megarl.rewards.plugins import load_reward_fn
from megarl.rewards.runner import RewardRunner
from megarl.rewards.types import RewardFn, RewardFunctionError, RewardResult, RewardSample

__all__ = [
    "BUILTIN_REWARDS",
    "RewardConfig",
    "RewardFn",
    "RewardFunctionError",
    "RewardResult",
    "RewardRunner",
    "RewardSample",
    "boxed_reward",
    "extract_answer",
    "extract_boxed",
    "extract_hash_answer",
    "extract_last_number",
    "extract_tag_answer",
    "format_reward",
    "gsm8k_reward",
    "is_equivalent",
    "load_reward_fn",
    "math_reward",
]
