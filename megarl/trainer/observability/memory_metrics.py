"""Per-phase memory of every worker, so that a user sees the colocated handover working (and a leak growing).

When a phase of a step ends, every worker group is asked for its memory (`Worker.memory_stats`, one call per
group); the controller does not wait for the answers (a worker answers before its next call, so the numbers are
those of the phase's end) and collects them when the step's metrics are taken (on a CPU machine without a
handover: the update phase's only). A step's metrics then carry, per phase:
  - `memory/<phase>/<role>_allocated_gb`: the role's peak CUDA allocation during the phase (largest rank);
  - `memory/<phase>/reserved_gb`: CUDA memory reserved by the caching allocators (all roles of a GPU, summed);
  - `memory/<phase>/device_used_gb`: the device's used memory as the driver sees it (largest GPU);
  - `memory/<phase>/rss_gb`: host memory resident in the worker processes (summed; on a CPU machine the only one).
"""

from __future__ import annotations

from collections.abc import Sequence

from megarl.cluster.worker_group import WorkerGroup

PREFIX = "memory/"


class MemoryProbe:
    def __init__(self, groups: Sequence[WorkerGroup], enabled: bool = True, every_phase: bool = True):
        self.groups = list(groups)
        self.enabled = enabled
        self.every_phase = every_phase
        """False: the update phase only (`memory/update/...`, the step's peak): a CPU machine without a handover,
        where the phases share the processes' host memory and a call per group and phase costs more than it
        tells."""
        self._metrics: dict[str, float] = {}
        self._pending: list[tuple[str, list]] = []
        """(phase, [(role, call)]) asked for and not yet collected."""

    def sample(self, phase: str) -> None:
        """Ask every group for its memory at the end of `phase` (a repeated phase keeps its largest numbers)."""
        if self.enabled and (self.every_phase or phase == "update"):
            self._pending.append((phase, [(group.role, group.async_call("memory_stats")) for group in self.groups]))

    def _collect(self, phase: str, pending: list) -> None:
        reports = [(role, call.result()) for role, call in pending]
        values = {"rss_gb": sum(stats["rss_gb"] for _, ranks in reports for stats in ranks)}
        on_gpu = [(role, ranks) for role, ranks in reports if "peak_allocated_gb" in ranks[0]]
        for role, ranks in on_gpu:
            values[f"{role}_allocated_gb"] = max(stats["peak_allocated_gb"] for stats in ranks)
        if on_gpu:
            values["reserved_gb"] = sum(max(s["reserved_gb"] for s in ranks) for _, ranks in on_gpu)
            values["device_used_gb"] = max(s["device_used_gb"] for _, ranks in on_gpu for s in ranks)
        for name, value in values.items():
            key = f"{PREFIX}{phase}/{name}"
            self._metrics[key] = max(value, self._metrics.get(key, 0.0))

    def step_metrics(self) -> dict[str, float]:
        """This step's numbers; the next step starts a fresh record."""
        pending, self._pending = self._pending, []
        for phase, calls in pending:
            self._collect(phase, calls)
        metrics, self._metrics = self._metrics, {}
        return metrics
