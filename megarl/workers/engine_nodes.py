"""The other nodes of a rollout engine that spans several (SGLang `--nnodes`): one small Ray actor per node.

An engine of g GPUs on nodes of n GPUs (g = N x n) is driven by one RolloutWorker on its first node (node-rank 0:
the server the controller and the weight senders talk to). That worker starts an `EngineNode` actor on the first
bundle of each other node of the engine, in the same placement group, which launches the same SGLang command with
`--node-rank k` on that node's GPUs and watches the process; it serves no HTTP (SGLang's ranks on other nodes take
their work from node 0's scheduler, weight updates included: a sync posted to node 0 reaches every node's TP ranks).

A node's death stops the engine: its SGLang ranks fail node 0's collectives, and the RolloutWorker checks its nodes
before each generate and weight update and after any failed call, raising an error that names the node
(`check_engine_nodes`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from megarl.errors import RunFailure

NODE_PING_TIMEOUT_S = 30.0
NOSET_CUDA_VISIBLE_DEVICES = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"
"""Set to 1 in a worker's environment, Ray leaves its CUDA_VISIBLE_DEVICES as the node's: the worker sees every GPU."""


@dataclass(frozen=True)
class EngineNodeSlot:
    """Where node-rank `node_rank` of an engine runs: a bundle of the rollout pool (its placement group and index
    in it) and the GPU ids Ray gave that node's bundles of the engine."""

    node_rank: int
    placement_group: Any
    bundle_index: int
    gpu_ids: tuple[str, ...]


class EngineNode:
    """A Ray actor on one node of a multi-node engine: runs that node's SGLang process."""

    def __init__(self) -> None:
        self.server = None

    def launch(
        self, config, command: list[str], gpu_ids: list[str], node_rank: int, nnodes: int, reap: Sequence[int] = ()
    ) -> int:
        """Start this node's SGLang process (`config`: the SGLangEngineConfig); not waiting for health: node 0
        answers for the engine. `reap`: the process groups the engine this one replaces left on this node, killed
        first (Ray kills what a dead actor started, unless told not to; a session of its own may escape it).
        Returns the new process group."""
        from megarl.rollout.sglang_server import SGLangServer, build_server_env, reap_process_groups

        reap_process_groups(reap)
        env = build_server_env(config, list(gpu_ids), nnodes=nnodes)  # ids as Ray gives them (indices or UUIDs)
        self.server = SGLangServer(command, url=f"node-rank {node_rank}", env=env)
        self.server.start(wait_ready=False)
        return self.server.process.pid  # its own session: the pid is the process group

    def problem(self) -> str | None:
        """None while this node's SGLang process runs; else what happened (exit code, log tail)."""
        if self.server is None:
            return "its SGLang process was never started"
        try:
            self.server.check_alive()
        except Exception as err:  # reported, not raised: the caller names the node
            return str(err)
        return None

    def stop(self) -> int | None:
        return self.server.stop() if self.server is not None else None


def start_engine_nodes(
    slots: list[EngineNodeSlot], config, command_for, env: dict[str, str], reap: Sequence[Sequence[int]] = ()
) -> tuple[list, list[list[int]]]:
    """Start an EngineNode actor in each slot and launch its node's process (`config`: the SGLangEngineConfig,
    `command_for(node_rank)`: the command, `reap`: per slot, process groups left there by the engine this one
    replaces). Returns the actor handles and each one's process groups (node-rank order)."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    node_cls = ray.remote(EngineNode)
    nnodes = len(slots) + 1
    nodes = []
    for slot in slots:
        strategy = PlacementGroupSchedulingStrategy(
            placement_group=slot.placement_group, placement_group_bundle_index=slot.bundle_index
        )
        nodes.append(
            node_cls.options(
                num_gpus=0, num_cpus=0, scheduling_strategy=strategy, runtime_env={"env_vars": env}, max_restarts=0
            ).remote()
        )
    reap = list(reap) + [[]] * (len(slots) - len(reap))
    pgids = ray.get(
        [
            node.launch.remote(config, command_for(slot.node_rank), list(slot.gpu_ids), slot.node_rank, nnodes, old)
            for node, slot, old in zip(nodes, slots, reap)
        ]
    )
    return nodes, [[pgid] for pgid in pgids]


def check_engine_nodes(nodes: list, slots: list[EngineNodeSlot], engine: str) -> None:
    """Raise RunFailure naming the first node of the engine that is gone or whose SGLang process exited."""
    import ray

    for node, slot in zip(nodes, slots):
        try:
            problem = ray.get(node.problem.remote(), timeout=NODE_PING_TIMEOUT_S)
        except Exception as err:  # the actor, or its whole node, is gone
            problem = f"its Ray actor is unreachable ({type(err).__name__}: {str(err).splitlines()[0][:200]})"
        if problem is not None:
            raise RunFailure(
                f"{engine}: node-rank {slot.node_rank} of the engine stopped: {problem}. A multi-node engine cannot "
                "run without any of its nodes; the run stops (resume from the last checkpoint once the node is back)"
            )


def stop_engine_nodes(nodes: list) -> None:
    import contextlib

    import ray

    for node in nodes:
        with contextlib.suppress(Exception):
            ray.get(node.stop.remote(), timeout=NODE_PING_TIMEOUT_S)
        with contextlib.suppress(Exception):
            ray.kill(node, no_restart=True)
