"""Saving a run checkpoint: every trained role's state plus the trainer state, as one atomic step folder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from megarl.cluster.worker_group import WorkerGroup
from megarl.runtime import faults
from megarl.trainer.lifecycle.handover import Handover
from megarl.trainer.lifecycle.run_checkpoint import RunCheckpoints, TrainerState


class Checkpointer:
    def __init__(
        self, checkpoints: RunCheckpoints, trained: dict[str, WorkerGroup], state: TrainerState, handover: Handover
    ):
        self.checkpoints = checkpoints
        self.trained = trained
        """The roles whose state a checkpoint holds, by folder name (actor, critic, reward_model)."""
        self.state = state
        self.handover = handover

    def save(self, samplers: dict[str, Any]) -> Path:
        """Collective over the trained roles; the trainer state records the samplers' positions."""
        self.handover.to_training()
        staging = self.checkpoints.begin(self.state.global_step)
        pending = [group.async_call("save_checkpoint", str(staging / name)) for name, group in self.trained.items()]
        for call in pending:
            call.result()
        faults.hit("checkpoint.roles_written")
        self.state.data = {name: sampler.state_dict() for name, sampler in samplers.items()}
        return self.checkpoints.commit(staging, self.state)
