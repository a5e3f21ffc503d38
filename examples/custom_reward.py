"""A custom reward function: correctness of an <answer>...</answer> tag, plus a small bonus for showing work.

Use it with any job config:

    megarl train --config configs/quickstart.yaml reward.fn=examples/custom_reward.py:score \\
        reward.kwargs.work_bonus=0.1

megarl calls it in batches (reward.batch_size) in worker processes with a time limit per call (reward.timeout_s);
an exception or a timeout costs only the samples involved (they get reward.default_reward). Return one float, or a
dict with "score" and extra numbers (averaged into the step's reward/* metrics), per sample.
"""

from __future__ import annotations

import re

from megarl.rewards import RewardSample, is_equivalent

ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def score(samples: list[RewardSample], work_bonus: float = 0.0) -> list[dict[str, float]]:
    results = []
    for sample in samples:
        match = ANSWER.search(sample.response)
        correct = bool(match) and is_equivalent(match.group(1).strip(), sample.label)
        shows_work = "=" in sample.response.split("<answer>")[0]
        results.append(
            {
                "score": float(correct) + (work_bonus if shows_work else 0.0),
                "acc": float(correct),
                "format_ok": float(bool(match)),
            }
        )
    return results
