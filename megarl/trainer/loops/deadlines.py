"""Phase deadlines of a run (`run.phase_timeouts`): how long each phase of a step may wait for its workers.

Every phase a loop opens with `steps.phase(name)` bounds the worker-group calls it makes by the phase's deadline
(megarl/cluster/deadline.py): a phase past it stops with an error naming the phase, the role and the ranks that did
not answer (for the rollout role, rank k is engine k), instead of hanging. The defaults grow with the work a phase
has in the job's config (rows, tokens, engines, training GPUs), generously: a deadline catches a hang, it does not
police speed (trainer/lifecycle/deadline_defaults.py). Imports nothing heavy (the config loader checks the keys).
"""

from __future__ import annotations

import math

from megarl.errors import UserError

PHASES: dict[str, str] = {
    "rollout": "generation on the rollout engines (each DAPO draw afresh; the async producer's generate calls)",
    "reward": "scoring the completions (the rule reward's workers, a reward model)",
    "handover": "colocated runs: the engines and the training roles trading the GPUs",
    "logprobs": "log-probs of the actor, ref and teacher, the critic's values",
    "update": "the optimizer steps of the step (every PPO epoch and mini-batch; the SFT and RM updates)",
    "sync": "the weight sync into the engines (and its verification and probe)",
    "checkpoint": "writing a run checkpoint",
    "eval": "generating and scoring the eval set",
    "wait": "async runs: the trainer waiting for the producer's next batch",
    "health": "the engine health probe before each step's rollout (SGLang /health_generate, hf: one token)",
}
"""The phases a deadline can be set for, and what each covers."""

KEY = "run.phase_timeouts"


def check_phase_timeouts(timeouts: dict[str, float | None], key: str = KEY) -> None:
    """Known phase names, values > 0 seconds or null (the default), or a UserError naming the key."""
    unknown = [name for name in timeouts if name not in PHASES]
    if unknown:
        raise UserError(f"{key} names unknown phase(s) {', '.join(map(repr, unknown))}; valid: {', '.join(PHASES)}")
    for name, value in timeouts.items():
        if value is not None and (isinstance(value, bool) or not value > 0 or math.isinf(value)):
            raise UserError(f"{key}.{name}={value} must be a number of seconds > 0, or null for the default")
