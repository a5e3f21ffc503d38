"""The plan's result (`PlanReport`) and its terminal rendering: a table per role, then placement and weight sync.

Numbers are GB of 2^30 bytes with one decimal, parameters in billions (B).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megarl.plan.bandwidths import render_table, table
from megarl.plan.host import HostMemory
from megarl.plan.memory import GB
from megarl.plan.placement import Placement
from megarl.plan.sync import SyncEstimate
from megarl.rollout.sglang_launch import EngineLaunch, render_launches

_WIDTH = 64  # label column


@dataclass
class RoleReport:
    """One role's per-GPU budget at its peak, and whether it fits."""

    name: str
    layout: str
    """The parallel layout, one line."""
    lines: list[tuple[str, float]]
    """(what, bytes) adding up to the peak."""
    capacity_bytes: float
    info: list[str] = field(default_factory=list)
    """Further facts shown under the table (KV cache capacity, host memory)."""
    extra_problem: str | None = None
    """A reason it does not fit besides the peak (e.g. no room for one sample's KV cache)."""
    detail: object | None = None
    """The RoleMemory / EngineMemory the lines came from."""

    @property
    def peak_bytes(self) -> float:
        return sum(value for _, value in self.lines)

    @property
    def shortfall_bytes(self) -> float:
        return max(0.0, self.peak_bytes - self.capacity_bytes)

    @property
    def fits(self) -> bool:
        return self.shortfall_bytes == 0 and self.extra_problem is None

    def problem(self) -> str | None:
        if self.shortfall_bytes:
            largest = max(self.lines, key=lambda line: line[1])
            return (
                f"{self.name}: peak {gb(self.peak_bytes)} GB per GPU exceeds plan.gpu_memory_gb="
                f"{gb(self.capacity_bytes)} by {gb(self.shortfall_bytes)} GB (largest: {largest[0]}, "
                f"{gb(largest[1])} GB)"
            )
        return f"{self.name}: {self.extra_problem}" if self.extra_problem else None

    def as_dict(self) -> dict:
        """One role in `megarl plan --json`: layout, the per-GPU budget (bytes), the verdict."""
        layout = getattr(self.detail, "layout", None)
        axes = {}
        if layout is not None:
            axes = {axis: getattr(layout, axis) for axis in ("tp", "pp", "vpp", "ep", "etp", "dp", "world")}
        elif self.detail is not None:  # the rollout engine
            axes = {axis: getattr(self.detail, axis) for axis in ("tp", "dp", "ep")}
        return {
            "layout": self.layout,
            "parallel": axes,
            "memory": {
                "lines": [{"what": what, "bytes": value} for what, value in self.lines],
                "peak_bytes": self.peak_bytes,
                "capacity_bytes": self.capacity_bytes,
                "shortfall_bytes": self.shortfall_bytes,
            },
            "fits": self.fits,
            "info": list(self.info),
            "problem": self.problem(),
        }


HOST_HEADROOM = 0.9
"""Share of a node's RAM the plan lets a job use (the OS, page cache and file system clients need the rest)."""


@dataclass
class PlanReport:
    config_path: str
    model: str
    """One line about the model (architecture, parameters, HF size, where its config.json came from)."""
    gpu_bytes: float
    placement: Placement
    roles: list[RoleReport]
    sync: SyncEstimate | None = None
    sync_bandwidths: tuple[float, float, float] = (0.0, 0.0, 0.0)
    """GB/s inside a node, per GPU between nodes, of the shared file system."""
    host: HostMemory | None = None
    """Host memory of a training node (megarl/plan/host.py)."""
    host_memory_gb: float | None = None
    """plan.host_memory_gb: the node's RAM, when given."""
    launches: list[EngineLaunch] = field(default_factory=list)
    """The SGLang server processes the job starts (megarl/rollout/sglang_launch.py)."""
    notes: list[str] = field(default_factory=list)

    def role(self, name: str) -> RoleReport:
        for role in self.roles:
            if role.name == name:
                return role
        raise KeyError(f"no role {name!r} in the plan; planned: {', '.join(r.name for r in self.roles)}")

    @property
    def host_bytes_per_node(self) -> float:
        return self.host.total if self.host is not None else 0.0

    @property
    def problems(self) -> list[str]:
        problems = list(self.placement.problems) + [p for r in self.roles if (p := r.problem()) is not None]
        if self.host_memory_gb is not None and self.host_bytes_per_node > HOST_HEADROOM * self.host_memory_gb * GB:
            problems.append(
                f"host memory: about {gb(self.host_bytes_per_node)} GB per node ({self.host.describe()}) exceeds "
                f"{HOST_HEADROOM:.0%} of plan.host_memory_gb={self.host_memory_gb:g}"
            )
        return problems

    @property
    def fits(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict:
        """`megarl plan --json`: the plan as one JSON-ready object (bytes as numbers, seconds as floats)."""
        pl = self.placement
        return {
            "config": self.config_path,
            "model": self.model,
            "gpu_bytes": self.gpu_bytes,
            "roles": {role.name: role.as_dict() for role in self.roles},
            "placement": {
                "mode": pl.mode,
                "num_nodes": pl.num_nodes,
                "gpus_per_node": pl.gpus_per_node,
                "train_gpus": pl.train_gpus,
                "rollout_gpus": pl.rollout_gpus,
                "gpus_per_engine": pl.gpus_per_engine,
                "num_engines": pl.num_engines,
                "engine_nodes": pl.engine_nodes,
                "node_map": [{"nodes": nodes, "what": what} for nodes, what in pl.node_map],
            },
            "sync": self.sync.as_dict() if self.sync is not None else None,
            "bandwidths": table(*self.sync_bandwidths) if self.sync is not None else [],
            "host_bytes_per_node": self.host_bytes_per_node,
            "launches": [launch.command for launch in self.launches],
            "notes": list(dict.fromkeys(pl.notes + self.notes)),
            "problems": self.problems,
            "fits": self.fits,
        }

    def render(self) -> str:
        out = [f"megarl plan: {self.config_path}", f"model      {self.model}"]
        pl = self.placement
        nodes = f"{pl.num_nodes} node{'s' if pl.num_nodes > 1 else ''} x {pl.gpus_per_node} GPUs"
        out.append(f"cluster    {nodes}, {gb(self.gpu_bytes)} GB per GPU; placement {pl.mode}")
        out.append("")
        out.append("placement")
        for nodes_text, what in pl.node_map:
            out.append(f"  {nodes_text:<14} {what}")
        for role in self.roles:
            out.append("")
            out += _render_role(role)
        if self.sync is not None:
            out.append("")
            out += _render_sync(self.sync, *self.sync_bandwidths)
        if self.launches:
            out.append("")
            out.append("SGLang servers (one per engine and node; the trainer pushes the weights at its first sync)")
            out += render_launches(self.launches)
        if self.host_bytes_per_node >= 0.1 * GB:
            out.append("")
            limit = f" of {self.host_memory_gb:g}" if self.host_memory_gb is not None else ""
            out.append(f"host memory: about {gb(self.host_bytes_per_node)} GB per node{limit} ({self.host.describe()})")
        notes = list(dict.fromkeys(pl.notes + self.notes))
        if notes:
            out.append("")
            out.append("notes")
            out += [f"  - {note}" for note in notes]
        out.append("")
        problems = self.problems
        if problems:
            out.append("DOES NOT FIT")
            out += [f"  - {problem}" for problem in problems]
        else:
            out.append("fits: every role within plan.gpu_memory_gb")
        return "\n".join(out)


def gb(nbytes: float) -> str:
    return f"{nbytes / GB:.1f}"


def _render_role(role: RoleReport) -> list[str]:
    out = [f"{role.name:<10} {role.layout}", f"  {'per GPU':<{_WIDTH}} {'GB':>7}"]
    for label, value in role.lines:
        out.append(f"  {label:<{_WIDTH}} {gb(value):>7}")
    peak, cap = role.peak_bytes, role.capacity_bytes
    verdict = f"fits ({gb(cap - peak)} GB free)" if role.fits else "DOES NOT FIT"
    if role.shortfall_bytes:
        verdict += f" (short by {gb(role.shortfall_bytes)} GB)"
    out.append(f"  {'peak':<{_WIDTH}} {gb(peak):>7} of {gb(cap)}  {verdict}")
    out += [f"  {line}" for line in role.info]
    return out


def _render_sync(sync: SyncEstimate, intra: float, inter: float, shared_fs: float) -> list[str]:
    links = f"{intra:g} GB/s inside a node and {inter:g} GB/s per GPU between nodes"
    if sync.transport == "disk":
        links = f"{shared_fs:g} GB/s of shared file system (plan.shared_fs_gbps)"
    return [
        "weight sync (actor -> rollout engines), one update",
        f"  bytes       {gb(sync.total_bytes)} GB of HF tensors; {sync.num_senders} sending rank(s), the busiest "
        f"sends {gb(sync.max_sender_bytes)} GB in {sync.num_buckets} bucket(s)",
        f"  transport   {sync.transport}: {sync.road}",
        f"  time        gather {sync.gather_s:.1f} s + transfer {sync.transfer_s:.1f} s + per-bucket calls "
        f"{sync.overhead_s:.1f} s = {sync.seconds:.1f} s",
        f"              (a lower bound at {links}; measured syncs run 1.5-3x longer)",
        "  figures assumed (megarl/plan/bandwidths.py; config: this job's plan.* keys)",
        *render_table(intra, inter, shared_fs),
    ]
