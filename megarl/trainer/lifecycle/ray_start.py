"""The run's local Ray instance, started before the driver's own start-up work so the two overlap.

Kept apart from run.py, which imports torch: the CLI calls `early_ray_start` right after the config is checked,
then imports the trainer (torch, transformers: 2-3 s on a 2-core machine) while Ray's processes boot.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megarl.cluster.ray_runtime import BackgroundStart
    from megarl.job import JobConfig


def early_ray_start(config: JobConfig) -> BackgroundStart | None:
    """Start the run's local Ray instance in a background thread now, so that its processes boot while the driver
    imports torch and checks the model and data files (3-4 s of a 2-core machine's start-up). None where the run
    starts or joins Ray itself later: a cluster address (joining is quick), or a teacher to train first (its run
    starts its own instance). The config is checked already: a bad key never starts anything."""
    from megarl.cluster.orphans import kill_leftover_processes
    from megarl.cluster.ray_runtime import BackgroundStart

    if not config.cluster.is_local or (config.needs_teacher and not config.teacher.model.path):
        return None
    kill_leftover_processes(config.run.dir)  # of an earlier driver of this run that was killed hard
    return BackgroundStart(config.ray_cluster())
