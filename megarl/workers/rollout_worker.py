"""The Ray worker of a rollout engine: one engine per worker (megarl/rollout), built by name from a registry.

Engines are independent replicas: the controller splits requests among them. Weight updates arrive from the
actor's sending ranks as buckets (workers/weight_sync.py), framed by begin/finish calls from the controller.

Calls run on threads (`max_concurrency`), so that `abort`, `health` and `weight_version` reach the worker while a
`generate` runs (asynchronous RL interrupts generation for weight syncs); every other engine call takes `_lock`,
so those still run one at a time, as on a single-threaded worker.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from megarl.cluster.worker import Worker
from megarl.rollout.config import RolloutConfig, SamplingParams
from megarl.rollout.engine import Bucket, Completion, GenerateRequest, RolloutEngine, SyncStats
from megarl.runtime import faults

ENGINES = {
    "hf": "megarl.rollout.hf_engine:HFEngine",
    "sglang": "megarl.rollout.sglang_engine:SGLangEngine",
}


def build_engine(backend: str, model_path: str, config: RolloutConfig, **kwargs: Any) -> RolloutEngine:
    import importlib

    module_name, class_name = ENGINES[backend].split(":")
    engine_cls = getattr(importlib.import_module(module_name), class_name)
    engine_config = getattr(config, backend)
    return engine_cls(model_path, engine_config, **kwargs)


class RolloutWorker(Worker):
    max_concurrency = 8
    """Calls at once (WorkerGroup's default for this class): a generate call, an abort, health checks, the weight
    buckets in flight (two per sending rank) and an evaluation waiting for the engine."""

    def __init__(self):
        self._lock = threading.Lock()

    def setup(self, model_path: str, config: RolloutConfig) -> dict[str, Any]:
        """Start the engine on `model_path`; a megarl checkpoint gives its HF config and tokenizer only (the
        weights arrive with the first sync)."""
        from transformers.utils import logging as hf_logging

        from megarl.checkpoint.model_io import hf_config_dir

        hf_logging.disable_progress_bar()  # one bar per engine in the driver's log says nothing
        start = time.perf_counter()
        with self._lock:
            self.engine = build_engine(config.backend, str(hf_config_dir(model_path)), config)
            self._sync_start = 0.0
            self._sync_tensors = self._sync_bytes = 0
        return {"seconds": time.perf_counter() - start}

    def generate(self, requests: list[GenerateRequest], sampling: SamplingParams) -> list[list[Completion]]:
        faults.hit("rollout.generate")
        with self._lock:
            return self.engine.generate(requests, sampling)

    def abort(self) -> None:
        """Interrupt the generate call in progress (its unfinished completions return with finish reason `abort`);
        no effect when none runs. Does not wait for the lock."""
        self.engine.abort()

    def weight_version(self) -> int:
        """The version of the weights the engine serves (does not wait for a generate call)."""
        return int(self.engine.weight_version)

    def begin_weight_update(self, version: int) -> None:
        with self._lock:
            self._sync_start = time.perf_counter()
            self._sync_tensors = self._sync_bytes = 0
            self.engine.begin_weight_update(version)

    def apply_bucket(self, bucket: Bucket) -> None:
        with self._lock:
            self.engine.apply_bucket(bucket)
            self._sync_tensors += len(bucket)
            self._sync_bytes += sum(t.nbytes for _, t in bucket)

    def finish_weight_update(self, version: int) -> SyncStats:
        with self._lock:
            self.engine.finish_weight_update(version)
            seconds = time.perf_counter() - self._sync_start
            return SyncStats(version, self._sync_tensors, self._sync_bytes, seconds)

    def release_memory(self) -> None:
        with self._lock:
            self.engine.release_memory()

    def resume_memory(self) -> None:
        with self._lock:
            self.engine.resume_memory()

    def health(self) -> dict[str, Any]:
        return self.engine.health()

    def shutdown_engine(self) -> None:
        self.engine.abort()  # a generate call in flight ends at its next decode step and frees the lock
        with self._lock:
            self.engine.shutdown()
