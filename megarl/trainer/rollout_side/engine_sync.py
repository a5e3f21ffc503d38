"""The controller's side of a weight sync: the actor's weights into every rollout engine, as a new weight version.

A sync is a transaction (FIELD: half-applied updates): begin on every engine, stream the buckets, finish, verify,
and only then is the version the engines' own. If the sending side fails, every engine is told to stop serving the
mix it may hold (and refuses to generate until a complete sync), and the error goes up; a verified mismatch stops
the run naming the tensor.

An engine the fleet started again alone (engine_fleet.py) gets `sync_engine(rank)`: a full sync of that engine
only, at the version the others hold (in the synchronous loop the actor's weights are still those of that
version); until it lands the engine refuses to generate.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from megarl.errors import RunFailure
from megarl.rollout.config import RolloutConfig
from megarl.trainer.lifecycle.roles import Roles
from megarl.trainer.lifecycle.run_checkpoint import TrainerState
from megarl.trainer.rollout_side.sync_probe import ProbeMismatch

if TYPE_CHECKING:
    from megarl.cluster.worker_group import PendingCall
    from megarl.trainer.lifecycle.handover import Handover
    from megarl.trainer.rollout_side.sync_probe import SyncProbe

log = logging.getLogger("megarl")


class WeightSync:
    """`sync()` pushes the actor's weights into every engine as the next weight version; `sync(new_version=False)`
    pushes them again at the version they have (engines that restarted or released their weights)."""

    def __init__(
        self,
        roles: Roles,
        state: TrainerState,
        rollout: RolloutConfig,
        transport: str,
        quantization: dict | None = None,
        disk_root: Path | None = None,
        mla: bool | None = None,
    ):
        self.roles = roles
        self.state = state
        self.rollout = rollout
        self.transport = transport
        """rollout.weight_sync resolved (megarl/rollout/transports.py)."""
        self.quantization = quantization
        """rollout.weights_format resolved (megarl/rollout/weights_format.py): FP8 config or None."""
        self.disk_root = disk_root
        """The disk transport: where each sync's folder goes (the run directory, on a file system every node
        shares)."""
        self.route = None
        """How the weights travel (a SyncRoute), asked of the engines at the first sync."""
        self.num_syncs = 0
        self.delta = rollout.sync_delta(transport, quantization, mla)
        """rollout.weight_sync_delta resolved: syncs after a full one send only the changed elements."""
        self.full_next = True
        """The next delta-capable sync sends whole tensors: the first in this process (a start or a resume: the
        senders have no snapshot), after a failed sync (the engines are quarantined), and for engines that restarted
        or released their weights (`sync(new_version=False)`)."""
        self._started: tuple[int, bool, PendingCall] | None = None
        """A hybrid sync submitted ahead (`start`): its version, whether it keeps samples, the call."""
        self.probe: SyncProbe | None = None
        """The behavioural check (sync_probe.py), set by the run when it has training prompts."""
        self._probe_due: int | None = None
        """The version of the last verified sync, until the probe has run after it."""
        self._relaunches = 0
        """Engines started again so far (engine_fleet.py): each gives the route new workers (and NCCL group name)."""
        if getattr(roles.rollout, "recovers", False):  # an EngineFleet: its restarted engines are synced here
            roles.rollout.resync = self

    @property
    def version(self) -> int:
        """The weight version the engines serve (that of the last sync)."""
        return self.state.weight_version

    @property
    def step(self) -> int:
        """The step running now, numbered as metrics.jsonl and the progress line do (from 1): an engine failure's
        record."""
        return self.state.global_step + 1

    def sync_engine(self, rank: int) -> None:
        """A full sync of engine `rank` alone, at the version the engines serve: an engine started again."""
        self._relaunches += 1
        self.route = None  # the engine has a new worker: every sending rank gets the new route
        route = self._ensure_route()
        route = dataclasses.replace(route, engines=(route.engines[rank],), delta="full" if self.delta else "off")
        folder = self._fresh_folder(self.version) if self.transport == "disk" else None
        if folder is not None:
            route = dataclasses.replace(route, disk_dir=str(folder))
        self._transaction(route, self.version, folder, False, ranks=[rank])
        log.info("weight sync: engine %d started again, given version %d in full", rank, self.version)

    def start(self) -> None:
        """A hybrid engine's next sync (a new version), submitted now: Ray runs an actor's calls in order, so the
        actor's worker starts it as soon as the calls already queued (the update) end, without a round trip
        through the controller in between. The next `sync()` waits for it instead of sending it. Other transports
        (several groups, a transaction around them) send nothing ahead."""
        if self.transport != "in_process" or self._started is not None:
            return
        version, check = self.state.weight_version + 1, self._keeps_samples()
        pending = self.roles.actor.async_call(
            "sync_into_engine", self._ensure_route(), version, self.rollout.bucket_bytes, check
        )
        self._started = (version, check, pending)

    def __call__(self, new_version: bool = True, verify: bool = False) -> dict[str, float]:
        """One sync (a transaction, module docstring); `verify`: compare sampled tensors afterwards whatever
        rollout.verify_sync says."""
        version = self.state.weight_version + int(new_version)
        actor = self.roles.actor
        route, folder = self._ensure_route(), None
        if self.transport == "disk":
            folder = self._fresh_folder(version)
            route = dataclasses.replace(route, disk_dir=str(folder))
        if self.delta:
            route = dataclasses.replace(route, delta="full" if self.full_next or not new_version else "delta")
        check = verify or self._keeps_samples()
        started, self._started = self._started, None
        if started is not None:  # submitted ahead by start(): the same version, or it is a bug here
            if started[0] != version:
                raise RuntimeError(f"weight sync: version {started[0]} was started, version {version} is asked for")
            check, results = started[1], started[2].result()
            sent, received = [r["sent"] for r in results], [r["received"] for r in results]
        elif self.transport == "in_process":  # a hybrid engine: its worker runs the whole transaction in one call
            results = actor.call("sync_into_engine", route, version, self.rollout.bucket_bytes, check)
            sent, received = [r["sent"] for r in results], [r["received"] for r in results]
        else:
            try:
                sent, received = self._transaction(route, version, folder, check)
            except BaseException:
                self.full_next = True  # a delta never lands on engines that may hold a mix
                raise
            self.full_next = False
        self.num_syncs += 1
        verified = 0
        if check:
            verified = self._verify([item for s in sent for item in s["samples"]], version)
            self._probe_due = version
        self.state.weight_version = version
        return {
            "sync/bytes": sum(s["bytes"] for s in sent),
            "sync/full_bytes": sum(s.get("full_bytes", s["bytes"]) for s in sent),
            "sync/delta": float(route.delta == "delta"),
            "sync/seconds": max(s["seconds"] for s in sent),
            "sync/engine_seconds": max(r.seconds for r in received),
            "sync/weight_version": float(version),
            "sync/ipc_engines": max(s["ipc_engines"] for s in sent),
            "sync/in_process_engines": max(s["in_process_engines"] for s in sent),
            "sync/shared_memory_engines": max(s.get("shared_memory_engines", 0.0) for s in sent),
            "sync/verified_tensors": float(verified),
        }

    def run_probe(self, handover: Handover) -> dict[str, float]:
        """The behavioural check after a verified sync, once (sync_probe.py): the engines generate, the actor
        scores. When an engine disagrees, every engine is fenced and given the version again in full, verified,
        and probed once more: a bucket spoiled in flight is not spoiled twice, while weights that are wrong every
        time (a mapping bug) fail again and stop the run naming the engine (RunFailure). {} when none is due."""
        if self.probe is None or self._probe_due is None:
            return {}
        version, self._probe_due = self._probe_due, None
        try:
            return self.probe(self.roles, handover, version)
        except ProbeMismatch as failure:
            log.warning(
                "%s; weight sync: giving every engine version %d again in full, then probing again",
                failure.summary,
                version,
            )
        if self.transport != "in_process":  # a hybrid engine's sync is one call that replaces its weights whole
            self.roles.rollout.call("abandon_weight_update", "the sync probe found wrong weights")
        handover.to_rollout(lambda: self(new_version=False, verify=True))
        self._probe_due = None
        return {**self.probe(self.roles, handover, version), "sync/retries": 1.0}

    def _keeps_samples(self) -> bool:
        """Whether this sync is verified (the senders keep the sampled norm weights for it)."""
        verify = self.rollout.verify_sync
        return verify == "every" or (verify == "first" and self.num_syncs == 0)

    def _ensure_route(self):
        if self.route is None:
            self.route = self._route()
        return self.route

    def _transaction(
        self, route, version: int, folder: Path | None, keep_samples: bool, ranks: list[int] | None = None
    ) -> tuple[list[dict], list]:
        """Begin on every engine (or on `ranks`), stream from every sending rank, finish: (what each rank sent,
        what each engine received). A failure on the sending side makes the engines abandon the update."""
        rollout, actor = self.roles.rollout, self.roles.actor

        def engines(method: str, *args):
            return rollout.call(method, *args) if ranks is None else rollout.call_ranks(ranks, method, *args)

        engines("begin_weight_update", version, route.delta != "delta")
        try:
            sent = actor.call("sync_weights", route, version, self.rollout.bucket_bytes, keep_samples, collect="all")
            if folder is not None:
                engines("load_weights_from_disk", str(folder))
        except BaseException as err:
            try:
                engines("abandon_weight_update", str(err).splitlines()[0][:300])
            except Exception as abandon:  # an engine that died mid-sync cannot abandon: the sync's error says why
                err.add_note(f"(the engines could not be told to abandon the update: {str(abandon).splitlines()[0]})")
            raise
        finally:
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)
        return sent, engines("finish_weight_update", version)

    def _fresh_folder(self, version: int) -> Path:
        if self.disk_root is None:
            raise RuntimeError("rollout.weight_sync=disk needs the run directory (WeightSync disk_root)")
        folder = self.disk_root / f"v{version}"
        shutil.rmtree(folder, ignore_errors=True)  # what a crashed sync left
        folder.mkdir(parents=True)
        return folder

    def _route(self):
        from megarl.workers.sync_route import EngineTarget, SyncRoute

        rollout = self.roles.rollout
        devices = rollout.call("device_uuids") if self.roles.colocated else [[] for _ in rollout.workers]
        endpoints = rollout.call("sglang_endpoint")
        parts = self.rollout.backend == "hf"  # the hf engine writes parts of tensors in place (hf_weights.py)
        # a CPU hf engine's weights in shared memory: the ranks on its node write them in place (shared_weights.py)
        host_road = parts and self.transport in ("ipc", "object_store")
        shared = rollout.call("shared_weights") if host_road else [None for _ in rollout.workers]
        engines = tuple(
            EngineTarget(worker, tuple(d), endpoint, takes_parts=parts, shared_weights=s)
            for worker, d, endpoint, s in zip(rollout.workers, devices, endpoints, shared)
        )
        fmt = "fp8" if self.quantization else "as trained"
        log.info("weight sync: %s into %d engine(s), weights %s", self.transport, len(engines), fmt)
        name = {"group_name": f"megarl_weights_{self._relaunches}"} if self._relaunches else {}
        return SyncRoute(
            self.transport,
            engines,
            **name,
            timeout_s=self.rollout.sglang.control_timeout_s,
            gpus_per_engine=self.rollout.gpus_per_engine,
            quantization=self.quantization,
        )

    def _verify(self, samples: list, version: int) -> int:
        """Every engine holds exactly the sampled tensors the trainer sent, or the run stops naming them. Returns
        how many tensors were compared on each engine."""
        problems = self.roles.rollout.call("verify_weights", samples)
        bad = [f"engine {i}: {line}" for i, lines in enumerate(problems) for line in lines]
        if bad:
            raise RunFailure(
                f"weight sync to version {version} did not land ({len(bad)} tensor(s) differ); first: {bad[0]}. "
                "Stopping: rollouts from these engines would not come from the trainer's weights "
                "(rollout.verify_sync=never skips this check)."
            )
        log.info("weight sync verified on %d tensor(s) x %d engine(s)", len(samples), len(problems))
        return len(samples)
