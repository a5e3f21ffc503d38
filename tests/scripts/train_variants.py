"""`megarl train` with the algorithm changed between steps: one run (one Ray session, one worker pool) trains one
step with each algorithm variant named on the command line, in that order. The end-to-end test of every policy loss
and advantage estimator uses it (tests/test_algorithm_variants.py): one start of the roles instead of one per variant.

    python tests/scripts/train_variants.py CONFIG VARIANT [VARIANT ...]

A VARIANT is a comma-separated list of overrides of the `algorithm` section (e.g. `policy_loss.name=sapo` or
`policy_loss.name=gpg,advantage.estimator=gpg`), each loaded and checked as a user's config would be. The run is
CONFIG with the first variant and rl.num_steps = the number of variants; at the end of step i the policy loss and
advantage sections of variant i + 1 replace the live ones (the actor's loss object holds the policy-loss section and
is sent to the workers with every update; the controller reads the estimator at every step). Each step logs
`test/variant` = its variant's index. What only run_rl's start decides (the roles, the greedy baseline generator of
remax, the old-log-prob pass) comes from the first variant and CONFIG.
"""

from __future__ import annotations

import sys
from dataclasses import fields

from megarl.config import load_config
from megarl.job import JobConfig
from megarl.trainer.lifecycle.run import train
from megarl.trainer.loops.steps import Steps

SECTIONS = ("policy_loss", "advantage")


def _overrides(variant: str) -> list[str]:
    return [f"algorithm.{item}" for item in variant.split(",") if item]


def main(config_path: str, variants: list[str]) -> int:
    algorithms = [load_config(JobConfig, config_path, _overrides(v)).algorithm for v in variants]
    config = load_config(JobConfig, config_path, [*_overrides(variants[0]), f"rl.num_steps={len(variants)}"])
    live = config.algorithm
    step_end = Steps.end

    def end(self: Steps, metrics: dict[str, float], *args, **kwargs) -> None:
        index = self.state.step
        metrics["test/variant"] = float(index)
        step_end(self, metrics, *args, **kwargs)
        if index + 1 < len(algorithms):
            for section in SECTIONS:
                target, source = getattr(live, section), getattr(algorithms[index + 1], section)
                for f in fields(target):
                    setattr(target, f.name, getattr(source, f.name))

    Steps.end = end
    return train(config)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
