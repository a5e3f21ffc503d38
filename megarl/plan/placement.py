"""Where the roles go: training GPUs, rollout engines, nodes; and which parallel groups cross nodes.

Training roles (actor, critic, ref, reward model, a distillation teacher) are each a group of `placement.train_gpus`
workers on the same GPUs, filling nodes in order (GPU 0 of node 0 first). Colocated: the rollout engines take turns
with them on those GPUs, train_gpus / gpus_per_engine engines. Split: the engines get `placement.rollout_gpus` GPUs
of their own, the ones after the training GPUs (on the same node when it has room). An engine wider than a node is
a multi-node SGLang server and must cover whole nodes; a narrower one must not straddle two. A teacher with GPUs of
its own (`placement.teacher_gpus`) takes the ones after the training and rollout GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_GPUS_PER_NODE = 8


@dataclass
class Placement:
    mode: str
    num_nodes: int
    gpus_per_node: int
    gpus_per_node_assumed: bool
    train_gpus: int
    rollout_gpus: int
    """GPUs the engines use (colocated: the training GPUs again)."""
    gpus_per_engine: int
    num_engines: int
    teacher_gpus: int = 0
    """A Megatron teacher's own GPUs, after the training and rollout GPUs (0: it shares the training GPUs)."""
    node_map: list[tuple[str, str]] = field(default_factory=list)
    """(nodes, what runs there), for the report."""
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def train_nodes(self) -> int:
        return -(-self.train_gpus // self.gpus_per_node)

    @property
    def rollout_first_gpu(self) -> int:
        """Index of the engines' first GPU over the cluster (colocated: 0, the training GPUs)."""
        return 0 if self.mode == "colocated" else self.train_gpus

    @property
    def rollout_node_ids(self) -> range:
        """Nodes holding rollout engines."""
        first = self.rollout_first_gpu // self.gpus_per_node
        last = (self.rollout_first_gpu + max(1, self.rollout_gpus) - 1) // self.gpus_per_node
        return range(first, last + 1)

    @property
    def rollout_nodes(self) -> int:
        return len(self.rollout_node_ids)

    @property
    def single_node(self) -> bool:
        """Training and rollout all on one node (weight syncs stay inside it)."""
        return self.train_nodes <= 1 and self.rollout_node_ids.stop <= 1

    @property
    def engine_nodes(self) -> int:
        """Nodes one engine spans."""
        return max(1, self.gpus_per_engine // self.gpus_per_node)


def place(
    mode: str,
    train_gpus: int,
    rollout_gpus: int,
    gpus_per_engine: int,
    num_nodes: int,
    gpus_per_node: int | None,
    training_roles: list[str],
    with_rollout: bool,
    teacher_gpus: int = 0,
) -> Placement:
    """`teacher_gpus`: a Megatron teacher's own GPUs (placement.teacher_gpus; 0: it is one of `training_roles`)."""
    gpn = gpus_per_node or DEFAULT_GPUS_PER_NODE
    engines_gpus = train_gpus if mode == "colocated" else rollout_gpus
    result = Placement(
        mode=mode,
        num_nodes=num_nodes,
        gpus_per_node=gpn,
        gpus_per_node_assumed=gpus_per_node is None,
        train_gpus=train_gpus,
        rollout_gpus=engines_gpus if with_rollout else 0,
        gpus_per_engine=gpus_per_engine,
        num_engines=engines_gpus // gpus_per_engine if with_rollout else 0,
    )
    if gpus_per_node is None:
        result.notes.append(f"cluster.gpus_per_node is null: planned with {gpn} GPUs per node")
    result.teacher_gpus = teacher_gpus
    needed = train_gpus + (rollout_gpus if mode == "split" and with_rollout else 0)
    needed = _teacher_first_gpu(needed, teacher_gpus, gpn) + teacher_gpus
    if needed > num_nodes * gpn:
        result.problems.append(
            f"placement: the job needs {needed} GPUs (train_gpus={train_gpus}"
            + (f" + rollout_gpus={rollout_gpus}" if mode == "split" else "")
            + (f" + teacher_gpus={teacher_gpus}" if teacher_gpus else "")
            + (", the teacher's from a node's first GPU" if needed > train_gpus + rollout_gpus + teacher_gpus else "")
            + f"); the cluster has {num_nodes * gpn} (cluster.num_nodes={num_nodes} x {gpn} GPUs per node)"
        )
    if train_gpus > gpn and train_gpus % gpn:
        result.problems.append(
            f"placement.train_gpus={train_gpus} spans nodes but is not a multiple of {gpn} GPUs per node; "
            "use whole nodes"
        )
    if with_rollout:
        _check_engines(result, engines_gpus)
    result.node_map = _node_map(result, training_roles, with_rollout)
    return result


def _check_engines(result: Placement, engines_gpus: int) -> None:
    gpe, gpn = result.gpus_per_engine, result.gpus_per_node
    key = "placement.train_gpus" if result.mode == "colocated" else "placement.rollout_gpus"
    if engines_gpus % gpe:
        result.problems.append(
            f"{key}={engines_gpus} is not a multiple of rollout.gpus_per_engine={gpe}: engines must tile their GPUs"
        )
    if gpe > gpn:
        if gpe % gpn:
            result.problems.append(
                f"rollout.gpus_per_engine={gpe} spans nodes but is not a multiple of {gpn} GPUs per node"
            )
        else:
            result.notes.append(
                f"each rollout engine spans {gpe // gpn} nodes: a multi-node SGLang server (--nnodes {gpe // gpn}, "
                "one process per node, started by the engine's worker on its first node); its tensor-parallel "
                "traffic crosses the inter-node network"
            )
    elif gpn % gpe:
        result.problems.append(
            f"rollout.gpus_per_engine={gpe} does not divide {gpn} GPUs per node: an engine would straddle two nodes"
        )


def _teacher_first_gpu(used: int, teacher_gpus: int, gpn: int) -> int:
    """The teacher's first GPU after `used` ones: the next node's first when it would not fit in what is left of
    the current node (its pool is one node's GPUs, or whole nodes)."""
    if teacher_gpus and used % gpn and used % gpn + teacher_gpus > gpn:
        return -(-used // gpn) * gpn
    return used


def _span(first: int, count: int) -> str:
    return f"node {first}" if count == 1 else f"nodes {first}-{first + count - 1}"


def _node_map(result: Placement, roles: list[str], with_rollout: bool) -> list[tuple[str, str]]:
    gpn = result.gpus_per_node
    train_nodes = result.train_nodes
    training = f"{', '.join(roles)} ({result.train_gpus} GPU{'s' if result.train_gpus > 1 else ''}"
    training += f", {min(result.train_gpus, gpn)} per node)"
    engines = ""
    if with_rollout and result.num_engines:
        engines = f"rollout ({result.num_engines} engine{'s' if result.num_engines > 1 else ''} x "
        engines += f"{result.gpus_per_engine} GPU{'s' if result.gpus_per_engine > 1 else ''})"
    if result.mode == "colocated":
        what = training + (f"; {engines}, taking turns" if engines else "")
        rows = [(_span(0, train_nodes), what)]
    else:
        rows = [(_span(0, train_nodes), training)]
        if engines:
            rows.append((_span(result.rollout_node_ids.start, result.rollout_nodes), engines))
    if result.teacher_gpus:
        used = result.train_gpus + (result.rollout_gpus if result.mode == "split" else 0)
        first = _teacher_first_gpu(used, result.teacher_gpus, gpn)
        last = first + result.teacher_gpus - 1
        count = result.teacher_gpus
        rows.append(
            (_span(first // gpn, last // gpn - first // gpn + 1), f"teacher ({count} GPU{'s' if count > 1 else ''})")
        )
    return rows


def layout_notes(
    role: str, tp: int, ep: int, etp: int, pp: int, world: int, gpus_per_node: int, moe: bool
) -> list[str]:
    """Which of a role's parallel groups cross nodes (Megatron orders ranks tp fastest, then cp, ep / dp, pp)."""
    notes = []
    if tp > gpus_per_node:
        notes.append(f"{role}: tp={tp} is wider than a node: tensor-parallel all-reduces cross the network")
    if moe and ep * etp > gpus_per_node:
        nodes = ep * etp // gpus_per_node
        notes.append(
            f"{role}: the expert-parallel group (ep x etp = {ep * etp}) spans {nodes} nodes: token "
            "all-to-all crosses the inter-node network"
        )
    if pp > 1 and world // pp >= gpus_per_node:
        notes.append(f"{role}: pipeline stages sit on different nodes (point-to-point sends cross the network)")
    return notes
