"""Run checkpoints: `run_dir/checkpoints/step_N/` with each trained role's state and `trainer_state.json`.

    checkpoints/
      step_12/
        actor/               workers/role_checkpoint.py: weights (a megarl checkpoint folder), optimizer, RNG
        critic/              (when the run has one)
        trainer_state.json   stage, step, data position, weight version, config hash, metrics that resume needs
      latest                 a text file naming the newest complete step folder (written last, atomically)

A checkpoint becomes visible only when complete: it is written as `.step_N.partial`, renamed to `step_N`, and only
then is `latest` replaced (write to a temporary file, fsync, rename). A crash at any point leaves the previous
checkpoint as `latest`; a stale `.partial` folder is removed at the next save. Older checkpoints beyond `keep`
are deleted only after the new one is in place, and disappear at once: each is renamed to `.step_N.deleting`
before it is removed, so a crash mid-deletion never leaves a half-deleted `step_N` behind.

Nothing a run keeps using lives only inside a step folder: what a role loaded from one (HF side files, carried
tensors) is captured at load time (checkpoint/carried.py), the trainer state is read into memory at resume.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from megarl.checkpoint.verify import check_megarl_checkpoint
from megarl.errors import UserError
from megarl.runtime import faults

LATEST = "latest"
STATE_FILE = "trainer_state.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")
log = logging.getLogger("megarl")


@dataclass
class TrainerState:
    """Everything besides the roles' own state that an exact resume needs."""

    stage_index: int = 0
    """Index into run.stages of the stage in progress."""
    step: int = 0
    """Steps of that stage already completed."""
    global_step: int = 0
    """Steps of all stages completed (the x axis of metrics.jsonl)."""
    weight_version: int = 0
    """Version of the actor's weights (bumped by every update that was synced to the rollout engines)."""
    data: dict[str, Any] = field(default_factory=dict)
    """Sampler positions by name (epoch and index in the epoch's permutation)."""
    config_hash: str = ""
    """Hash of the resolved config that wrote the checkpoint (a changed config is reported on resume)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Loop-specific counters (e.g. consecutive skipped steps)."""

    def save(self, folder: Path) -> None:
        _write_atomic(folder / STATE_FILE, json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, folder: Path) -> TrainerState:
        path = folder / STATE_FILE
        try:
            return cls(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError) as err:
            raise UserError(f"{path} is not a readable trainer state ({err}); the checkpoint is incomplete") from err


class RunCheckpoints:
    def __init__(self, run_dir: str | Path, keep: int = 2):
        self.root = Path(run_dir) / "checkpoints"
        self.keep = keep

    def pointed(self) -> Path | None:
        """The folder `latest` names, unchecked (what a run that just saved it reports), or None."""
        pointer = self.root / LATEST
        return self.root / pointer.read_text().strip() if pointer.is_file() else None

    def latest(self) -> Path | None:
        """The newest complete checkpoint folder, or None."""
        folder = self.pointed()
        if folder is None:
            return None
        if not (folder / STATE_FILE).is_file():
            raise UserError(
                f"{self.root / LATEST} names {folder.name}, which is not a complete checkpoint (no {STATE_FILE}); "
                f"point it at another step folder in {self.root} or remove it to start afresh"
            )
        steps = {int(m[1]): f for f in self.root.iterdir() if (m := _STEP_DIR.match(f.name)) and f.is_dir()}
        newest = int(_STEP_DIR.match(folder.name)[1]) if _STEP_DIR.match(folder.name) else None
        older = [steps[n] for n in sorted(steps, reverse=True) if newest is not None and n < newest]
        for candidate in [folder, *older]:
            if not (candidate / STATE_FILE).is_file():
                continue
            try:
                check_megarl_checkpoint(candidate)  # a lost or truncated shard: that checkpoint cannot be resumed
            except UserError as damage:
                log.warning("checkpoint %s is damaged, not resuming from it: %s", candidate.name, damage)
                continue
            return candidate
        raise UserError(
            f"no intact checkpoint in {self.root} (the newest, {folder.name}, and every older one is damaged: see "
            "the warnings above); restore the missing files or remove the checkpoints to start afresh"
        )

    def begin(self, global_step: int) -> Path:
        """A fresh staging folder for the checkpoint of `global_step` (stale staging folders removed)."""
        self.root.mkdir(parents=True, exist_ok=True)
        for stale in [*self.root.glob(".step_*.partial"), *self.root.glob(".step_*.deleting")]:
            shutil.rmtree(stale, ignore_errors=True)
        staging = self.root / f".step_{global_step}.partial"
        staging.mkdir()
        return staging

    def commit(self, staging: Path, state: TrainerState) -> Path:
        """Finish a checkpoint: trainer state in, rename into place, then point `latest` at it, then prune."""
        state.save(staging)
        _fsync_dir(staging)
        faults.hit("checkpoint.state_written")
        final = self.root / staging.name.removeprefix(".").removesuffix(".partial")
        if final.exists():  # a re-run of the same step after a crash between rename and `latest`
            shutil.rmtree(final)
        os.rename(staging, final)
        _fsync_dir(self.root)
        faults.hit("checkpoint.renamed")
        _write_atomic(self.root / LATEST, final.name + "\n")
        faults.hit("checkpoint.latest_updated")
        self._prune(final)
        return final

    def _prune(self, newest: Path) -> None:
        if self.keep <= 0:
            return
        steps = sorted(
            (int(m.group(1)), p) for p in self.root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()
        )
        for _, folder in steps[: max(len(steps) - self.keep, 0)]:
            if folder != newest:
                doomed = folder.with_name(f".{folder.name}.deleting")
                os.rename(folder, doomed)  # invisible at once; a crash below leaves only a hidden folder
                faults.hit("checkpoint.rotating")
                shutil.rmtree(doomed, ignore_errors=True)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
