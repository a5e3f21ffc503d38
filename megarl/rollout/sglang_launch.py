"""The SGLang servers a job launches: one command line per engine and per node of it, known before anything starts.

`megarl plan` and `megarl train --dry-run` print these lines; the rollout workers launch the same ones (ports and
GPUs as planned here, the host address and the model folder resolved on the node). Engines started by the trainer
always load dummy weights: the trainer pushes the real ones with its first sync, before any generation (a megarl
checkpoint's hf/ folder has no weights to load, and reading a 671B checkpoint twice would cost minutes).

Ports: engine k of a node listens on `rollout.sglang.port + k`; an engine across nodes (whole nodes, so k = 0) meets
at its node 0 on `port + PORT_SPAN` (SGLang's --dist-init-addr).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

from megarl.rollout.config import RolloutConfig
from megarl.rollout.sglang_server import NodePlace, build_server_command

LISTEN_HOST = "0.0.0.0"
"""Servers listen on every interface of their node: trainers on other nodes reach them at the node's address."""
PORT_SPAN = 100
"""Ports from rollout.sglang.port to port + PORT_SPAN - 1 serve HTTP, the next PORT_SPAN the multi-node rendezvous."""
NODE0_ADDRESS = "$ENGINE_NODE0_ADDRESS"
"""Stands for the address of an engine's first node in printed plans (known once the nodes are allocated)."""


def engine_port(rollout: RolloutConfig, first_gpu_on_node: int) -> int:
    """The HTTP port of the engine whose first GPU is `first_gpu_on_node` (its node's numbering)."""
    return rollout.sglang.port + first_gpu_on_node // rollout.gpus_per_engine


@dataclass(frozen=True)
class EngineLaunch:
    engine: int
    node: int
    """The cluster node (0-based) the process runs on."""
    node_rank: int
    """Its rank among the engine's nodes (0: the server the trainer talks to)."""
    gpus: tuple[int, ...]
    """The node's GPUs it uses (its CUDA_VISIBLE_DEVICES)."""
    port: int
    command: list[str]

    def render(self) -> str:
        return shlex.join(self.command)


def rollout_model_dir(model_path: str | Path) -> str:
    """The folder the engines read config and tokenizer from: a megarl checkpoint's hf/, else the HF folder itself
    (decided without the folder existing here: a checkpoint is recognised by its files when they are present)."""
    from megarl.checkpoint.model_dir import hf_config_dir

    return str(hf_config_dir(model_path))


def model_is_mla(model_path: str | Path) -> bool | None:
    """Whether the rollout model's attention is MLA (DeepSeek-V3 family), for rollout.weight_sync_delta's resolution
    (RolloutConfig.sync_delta: SGLang's loaders post-process MLA weights, so deltas stay off); None where the
    model's config.json cannot be read here or its family is not one megarl knows."""
    from megarl.errors import UserError
    from megarl.models.hf_config import read_config_json
    from megarl.models.registry import get_architecture

    try:
        return get_architecture(read_config_json(rollout_model_dir(model_path)).get("model_type")).mla
    except UserError:
        return None


def engine_launches(
    rollout: RolloutConfig,
    model_path: str | Path,
    *,
    num_engines: int,
    first_gpu: int,
    gpus_per_node: int,
    node0_address: str = NODE0_ADDRESS,
) -> list[EngineLaunch]:
    """Every server process of every engine, in engine order then node rank. Engines tile the rollout GPUs from
    cluster GPU `first_gpu` on (placement.rollout_first_gpu)."""
    from megarl.rollout.routing import engine_routing_layout
    from megarl.rollout.weights_format import rollout_quantization

    sglang = rollout.sglang
    quantization = rollout_quantization(rollout, model_path)
    routed_experts = engine_routing_layout(rollout.routed_experts, model_path) is not None
    gpe = rollout.gpus_per_engine
    nodes_per_engine = max(1, gpe // gpus_per_node)
    gpus_on_node = min(gpe, gpus_per_node)
    launches = []
    for engine in range(num_engines):
        first = first_gpu + engine * gpe
        port = engine_port(rollout, first % gpus_per_node)  # an engine across nodes starts at GPU 0: the first port
        for node_rank in range(nodes_per_engine):
            node = first // gpus_per_node + node_rank
            place = NodePlace(
                nodes_per_engine,
                node_rank,
                f"{node0_address}:{port + PORT_SPAN}" if nodes_per_engine > 1 else None,
            )
            local_first = first % gpus_per_node
            command = build_server_command(
                sglang,
                rollout_model_dir(model_path),
                host=LISTEN_HOST,
                port=port,
                load_format="dummy",
                node=place,
                quantization=quantization,
                return_routed_experts=routed_experts,
            )
            gpus = tuple(range(local_first, local_first + gpus_on_node))
            launches.append(EngineLaunch(engine, node, node_rank, gpus, port, command))
    return launches


def render_launches(launches: list[EngineLaunch]) -> list[str]:
    """The report lines: a header per process (engine, node, GPUs), then its command."""
    lines = []
    for launch in launches:
        gpus = ",".join(map(str, launch.gpus))
        where = f"engine {launch.engine}" + (f" node-rank {launch.node_rank}" if launch.node_rank else "")
        lines.append(f"  {where} on node {launch.node}, CUDA_VISIBLE_DEVICES={gpus}:")
        lines.append(f"    {launch.render()}")
    return lines
