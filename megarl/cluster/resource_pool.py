"""GPUs reserved for one or more roles: placement groups of bundles {"GPU": 1, "CPU": c}, ordered by node.

Rank i of a worker group runs in bundle i of its pool (bundle i * stride for a group with a bundle stride, e.g. one
rollout worker per multi-GPU engine). Bundles are ordered by node (by IP), so the ranks of one node are contiguous:
with 8 GPUs per node, ranks 0..7 share node 0, which is what Megatron's TP groups (consecutive ranks) want. Several
worker groups may share a pool (colocation), each taking a fraction of every bundle's GPU. `bundle_gpu_ids()` tells
the driver which GPU of which node each bundle holds, for processes that drive several bundles' GPUs themselves.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from megarl.cluster.config import PlacementStrategy
from megarl.cluster.ray_runtime import NodeInfo, cluster_nodes, describe_nodes, ip_sort_key
from megarl.errors import UserError

_EPS = 1e-6  # Ray keeps resources to 4 decimals: 3 x 1/3 of a GPU must still fit in one
_PROBE_GPUS = 1e-4  # Ray's smallest GPU share: what a bundle_gpu_ids probe task takes of its bundle


@dataclass(frozen=True)
class _Reservation:
    label: str
    num_bundles: int
    gpus: float
    cpus: float


def order_bundles(placements: list[tuple[int, int, str]], node_ips: dict[str, str]) -> list[tuple[int, int]]:
    """Bundles in rank order: by node IP, then placement group, then bundle index.

    `placements` holds (placement group index, bundle index, node id) of every bundle; `node_ips` maps node ids
    to IPs. The result lists (placement group index, bundle index).
    """

    def key(placement: tuple[int, int, str]) -> tuple:
        pg_index, bundle_index, node_id = placement
        return (ip_sort_key(node_ips.get(node_id, node_id)), node_id, pg_index, bundle_index)

    return [(pg_index, bundle_index) for pg_index, bundle_index, _ in sorted(placements, key=key)]


@dataclass(frozen=True)
class BundleGPUs:
    """Where one bundle of a pool is: its node and the GPU Ray gave it."""

    node_id: str
    """Ray node id of the bundle's node."""
    gpu_ids: tuple[str, ...]
    """`ray.get_gpu_ids()` of a task in the bundle: entries of the node's CUDA_VISIBLE_DEVICES when Ray was started
    with it set, else device indices of the node (logical ones on a machine without GPUs)."""


def _probe_bundle() -> BundleGPUs:
    """Run in a bundle: its node and GPU ids (as strings: Ray gives ints or strings depending on the node)."""
    gpu_ids = tuple(str(gpu_id) for gpu_id in ray.get_gpu_ids())
    return BundleGPUs(ray.get_runtime_context().get_node_id(), gpu_ids)


def local_ranks(node_ids: list[str]) -> list[int]:
    """For each rank, its index among the ranks of the same node (ranks listed in order)."""
    seen: dict[str, int] = {}
    ranks = []
    for node_id in node_ids:
        ranks.append(seen.get(node_id, 0))
        seen[node_id] = ranks[-1] + 1
    return ranks


class ResourcePool:
    """`num_nodes x gpus_per_node` bundles {"GPU": 1, "CPU": cpus_per_bundle}, reserved when built.

    strategy "per_node": one STRICT_PACK placement group per node; "pack": one PACK group over all bundles (Ray
    may spread it over nodes). A request the cluster can never satisfy raises `UserError` at once; one that does
    not fit now (other pools hold the GPUs) raises after `timeout_s`, and nothing stays reserved.
    """

    def __init__(
        self,
        name: str,
        num_nodes: int,
        gpus_per_node: int,
        cpus_per_bundle: float = 1.0,
        strategy: PlacementStrategy = "per_node",
        timeout_s: float = 300.0,
    ):
        if num_nodes < 1 or gpus_per_node < 1 or cpus_per_bundle < 0:
            raise UserError(
                f"resource pool '{name}': num_nodes={num_nodes} and gpus_per_node={gpus_per_node} must be >= 1, "
                f"cpus_per_bundle={cpus_per_bundle} >= 0"
            )
        if strategy not in _STRATEGIES:
            valid = ", ".join(_STRATEGIES)
            raise UserError(f"resource pool '{name}': strategy={strategy!r} is not known; valid: {valid}")
        self.name = name
        self.num_nodes = num_nodes
        self.gpus_per_node = gpus_per_node
        self.cpus_per_bundle = cpus_per_bundle
        self.strategy = strategy
        self._reservations: dict[int, _Reservation] = {}
        self._bundle_gpus: list[BundleGPUs] | None = None
        if not ray.is_initialized():
            raise RuntimeError(f"resource pool '{name}': Ray is not running; call megarl.cluster.start_ray first")
        self._check_cluster_can_hold()
        self.placement_groups = self._build_placement_groups(timeout_s)
        self.bundles, self.node_ids, self.node_ips = self._order_bundles()

    @property
    def world_size(self) -> int:
        """Bundles (GPUs) in the pool: the largest world a worker group on it can have."""
        return self.num_nodes * self.gpus_per_node

    @property
    def local_ranks(self) -> list[int]:
        """For each bundle (rank), its index among the pool's bundles on the same node."""
        return local_ranks(self.node_ids)

    def __repr__(self) -> str:
        return (
            f"ResourcePool({self.name!r}, {self.num_nodes} nodes x {self.gpus_per_node} GPUs, "
            f"{self.cpus_per_bundle:g} CPUs per GPU, {self.strategy})"
        )

    # -- building ------------------------------------------------------------------------------------------------

    def _request(self) -> str:
        return (
            f"resource pool '{self.name}' asks for {self.world_size} GPUs ({self.num_nodes} nodes x "
            f"{self.gpus_per_node}, {self.cpus_per_bundle:g} CPUs per GPU, placement '{self.strategy}')"
        )

    def _check_cluster_can_hold(self) -> None:
        """Fail now, with the cluster's shape, when no placement could ever satisfy the request."""
        nodes = cluster_nodes()
        total_gpus = sum(node.num_gpus for node in nodes)
        total_cpus = sum(node.num_cpus for node in nodes)
        cluster = f"the cluster has {total_gpus:g} GPUs and {total_cpus:g} CPUs: {describe_nodes(nodes)}"
        if total_gpus + _EPS < self.world_size or total_cpus + _EPS < self.world_size * self.cpus_per_bundle:
            raise UserError(f"{self._request()}; {cluster}")
        if self.strategy == "per_node":
            num_fitting = sum(self._node_groups_fitting(node) for node in nodes)
            if num_fitting < self.num_nodes:
                raise UserError(
                    f"{self._request()}; per_node placement needs {self.num_nodes} node(s) each holding "
                    f"{self.gpus_per_node} GPUs and {self.gpus_per_node * self.cpus_per_bundle:g} CPUs, the "
                    f"cluster has room for {num_fitting}: {describe_nodes(nodes)}"
                )

    def _node_groups_fitting(self, node: NodeInfo) -> int:
        by_gpus = math.floor(node.num_gpus / self.gpus_per_node + _EPS)
        cpus_needed = self.gpus_per_node * self.cpus_per_bundle
        by_cpus = math.floor(node.num_cpus / cpus_needed + _EPS) if cpus_needed > 0 else by_gpus
        return min(by_gpus, by_cpus)

    def _build_placement_groups(self, timeout_s: float) -> list[PlacementGroup]:
        bundle = {"GPU": 1.0, "CPU": float(self.cpus_per_bundle)}
        if self.strategy == "per_node":
            shapes = [("STRICT_PACK", self.gpus_per_node)] * self.num_nodes
        else:
            shapes = [("PACK", self.world_size)]
        tag = uuid.uuid4().hex[:8]
        groups = [
            placement_group([dict(bundle)] * num_bundles, strategy=strategy, name=f"megarl-{self.name}-{i}-{tag}")
            for i, (strategy, num_bundles) in enumerate(shapes)
        ]
        ready, _ = ray.wait([group.ready() for group in groups], num_returns=len(groups), timeout=timeout_s)
        if len(ready) < len(groups):
            for group in groups:
                remove_placement_group(group)
            free = ray.available_resources()
            raise UserError(
                f"{self._request()} could not be placed within {timeout_s:g} s: {free.get('GPU', 0.0):g} GPUs and "
                f"{free.get('CPU', 0.0):g} CPUs are free now (other pools or jobs hold the rest); the cluster: "
                f"{describe_nodes(cluster_nodes())}"
            )
        return groups

    def _order_bundles(self) -> tuple[list[tuple[PlacementGroup, int]], list[str], list[str]]:
        placements = []
        for pg_index, group in enumerate(self.placement_groups):
            bundle_nodes = placement_group_table(group)["bundles_to_node_id"]
            placements += [(pg_index, bundle_index, node_id) for bundle_index, node_id in bundle_nodes.items()]
        node_ips = {node.node_id: node.ip for node in cluster_nodes()}
        node_of = {(pg_index, bundle_index): node_id for pg_index, bundle_index, node_id in placements}
        order = order_bundles(placements, node_ips)
        bundles = [(self.placement_groups[pg_index], bundle_index) for pg_index, bundle_index in order]
        node_ids = [node_of[place] for place in order]
        return bundles, node_ids, [node_ips.get(node_id, "?") for node_id in node_ids]

    def bundle_gpu_ids(self, timeout_s: float = 120.0) -> list[BundleGPUs]:
        """For each bundle (rank order), its node and GPU ids: asked once, by one tiny task per bundle, then kept.

        Each probe takes Ray's smallest GPU share (1/10000) and no CPU of its bundle, so ask before worker groups
        take whole GPUs (colocated shares of 1/k leave nothing over for k = 2, 4, 5, ...). Raises RuntimeError when
        the probes do not all run within `timeout_s`.
        """
        if self._bundle_gpus is not None:
            return self._bundle_gpus
        if not self.placement_groups:
            raise RuntimeError(f"resource pool '{self.name}' was removed")
        probe = ray.remote(_probe_bundle)
        refs = [
            probe.options(
                num_cpus=0,
                num_gpus=_PROBE_GPUS,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=placement_group, placement_group_bundle_index=bundle_index
                ),
                max_retries=0,
            ).remote()
            for placement_group, bundle_index in self.bundles
        ]
        _, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        if pending:
            for ref in pending:
                ray.cancel(ref, force=True)
            raise RuntimeError(
                f"resource pool '{self.name}': {len(pending)} of {len(refs)} bundles did not say which GPU they hold "
                f"within {timeout_s:g} s; a probe needs {_PROBE_GPUS:g} of the bundle's GPU free: ask before worker "
                f"groups fill the bundles (held now by: {self._holders()})"
            )
        self._bundle_gpus = ray.get(refs)
        return self._bundle_gpus

    def _holders(self) -> str:
        held = [r for r in self._reservations.values() if r.num_bundles > 0]
        return ", ".join(f"{r.label} ({r.gpus:g} GPU, {r.cpus:g} CPU)" for r in held) or "nobody"

    # -- sharing between worker groups ---------------------------------------------------------------------------

    def reserve(self, key: int, label: str, num_bundles: int, gpus: float, cpus: float) -> None:
        """Book `gpus` and `cpus` of each of the first `num_bundles` bundles for a worker group (`key` its id).

        Ray would leave workers that do not fit pending forever; booking here turns that into an error naming the
        groups that already share the pool. (A group with a bundle stride books the span its workers lie in.)
        """
        if num_bundles > self.world_size:
            raise UserError(
                f"{label} needs the first {num_bundles} bundles of resource pool '{self.name}', which has "
                f"{self.world_size} ({self.num_nodes} nodes x {self.gpus_per_node} GPUs)"
            )
        if not self.placement_groups:
            raise RuntimeError(f"resource pool '{self.name}' was removed")
        held = [r for r in self._reservations.values() if r.num_bundles > 0]
        used_gpus = sum(r.gpus for r in held)
        used_cpus = sum(r.cpus for r in held)
        if used_gpus + gpus > 1 + _EPS or used_cpus + cpus > self.cpus_per_bundle + _EPS:
            holders = self._holders()
            raise UserError(
                f"{label} asks for {gpus:g} GPU and {cpus:g} CPU of each bundle of resource pool '{self.name}' "
                f"(1 GPU, {self.cpus_per_bundle:g} CPU each), already held by {holders}; colocated groups must "
                f"share: their num_gpus_per_worker (and CPU shares) must add up to at most one bundle"
            )
        self._reservations[key] = _Reservation(label, num_bundles, gpus, cpus)

    def release(self, key: int) -> None:
        """Give back what `reserve(key, ...)` booked (nothing if it booked nothing)."""
        self._reservations.pop(key, None)

    def __enter__(self) -> ResourcePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def remove(self) -> None:
        """Free the placement groups; Ray kills the workers still running in them."""
        for group in self.placement_groups:
            remove_placement_group(group)
        self.placement_groups = []
        self.bundles = []
        self._reservations.clear()
        self._bundle_gpus = None


_STRATEGIES = ("per_node", "pack")
