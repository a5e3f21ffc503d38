"""The run's worker groups: which roles exist, where they are placed, and their set-up.

Placement (config `placement`): colocated — every role's workers share the training GPUs (each worker reserves
1/k of its GPU for k roles; the roles take turns, handing memory over by offloading); split — the rollout engines
get GPUs of their own (asynchronous RL needs this). Each training role is one SPMD group of `train_gpus` workers.

A rollout engine of g = rollout.gpus_per_engine GPUs has one worker, on the first of its g consecutive bundles
(a group with bundle stride g); that worker sees all of its node's GPUs (Ray leaves CUDA_VISIBLE_DEVICES alone) and
starts the engine on the GPU ids of its g bundles, which the driver asks the pool for (`assign_engine_gpus`). An
engine larger than a node takes whole nodes: its worker starts the engine's processes on the other nodes through
one EngineNode actor per node, on that node's first bundle (megarl/workers/engine_nodes.py).

Hybrid engines (rollout.hf.hybrid: colocated one-GPU hf engines) have no workers: actor worker i hosts engine i,
and `roles.rollout` is a view of the actor group (megarl/workers/hybrid_worker.py).

The engines' group is an EngineFleet (megarl/trainer/rollout_side/engine_fleet.py): with split placement and
synchronous RL it starts a failed engine again alone, on its own bundle, up to rollout.max_engine_restarts times;
colocated engines share their GPUs with the training roles, and an asynchronous run's producer generates while the
actor trains, so there (and for hybrid engines) an engine failure restarts every role (run.max_restarts).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from megarl.cluster.config import ClusterConfig
from megarl.cluster.resource_pool import BundleGPUs, ResourcePool
from megarl.cluster.worker_group import WorkerGroup, start_groups
from megarl.errors import UserError
from megarl.trainer.rollout_side.engine_fleet import EngineFleet
from megarl.workers.engine_nodes import NOSET_CUDA_VISIBLE_DEVICES, EngineNodeSlot
from megarl.workers.hybrid_worker import EngineView, HybridActorWorker
from megarl.workers.megatron_worker import MegatronWorker

if TYPE_CHECKING:
    from megarl.job import JobConfig, RoleConfig
    from megarl.rollout.sglang_teacher import SGLangTeacher


FROZEN_POLICIES = ("ref", "teacher")
"""Roles holding a frozen policy (no optimizer, never saved): each is set up alike from its own config section, and
scores the rollout's tokens (trainer/loops/rl_steps.py, LOGPROB_TENSORS)."""


@dataclass
class Roles:
    actor: WorkerGroup
    rollout: EngineFleet | EngineView
    """The rollout engines' workers; a hybrid engine's (rollout.hf.hybrid) are the actor's: an EngineView."""
    critic: WorkerGroup | None
    ref: WorkerGroup | None
    reward_model: WorkerGroup | None
    pools: list[ResourcePool]
    colocated: bool
    teacher: WorkerGroup | None = None
    """On-policy distillation's teacher (teacher section): a frozen policy like `ref`."""
    teacher_server: SGLangTeacher | None = None
    """On-policy distillation's teacher served by SGLang servers the user runs (teacher.backend=sglang)."""
    teacher_on_own_gpus: bool = False
    """The teacher's group has GPUs of its own (placement.teacher_gpus): it takes no part in the handover."""
    engine_gpu_ids: list[list[str]] | None = None
    """GPU ids of each rollout engine (rank order) on its first node when engines have several GPUs; None: one
    GPU, the worker's."""
    engine_nodes: list[list[EngineNodeSlot]] | None = None
    """Each engine's other nodes (node-rank 1, 2, ...), for engines across nodes; None: engines within a node."""

    def training_groups(self) -> list[WorkerGroup]:
        return [g for g in (self.actor, self.critic, self.ref, self.teacher, self.reward_model) if g is not None]

    def sharing_groups(self) -> list[WorkerGroup]:
        """The training groups on the training GPUs: they hand their memory over to colocated engines."""
        own = self.teacher if self.teacher_on_own_gpus else None
        return [g for g in self.training_groups() if g is not own]

    def on_gpus(self) -> bool:
        """Whether the training workers compute on GPUs (one call to the actor's workers)."""
        return "cuda" in self.actor.call("device_type")

    def processes(self) -> list[WorkerGroup]:
        """Every group with workers of its own (a hybrid engine's are the actor's)."""
        engines = [] if isinstance(self.rollout, EngineView) else [self.rollout]
        return [*self.training_groups(), *engines]

    def shutdown(self) -> None:
        with contextlib.suppress(Exception):  # the group may be down already
            self.rollout.call("shutdown_engine", timeout_s=60)
        for group in (self.rollout, *self.training_groups()):
            group.shutdown()
        for pool in self.pools:
            pool.remove()


def _pool(name: str, num_gpus: int, cluster: ClusterConfig, cpus: float) -> ResourcePool:
    per_node = cluster.gpus_per_node or num_gpus
    if num_gpus > per_node and num_gpus % per_node:
        raise ValueError(f"pool {name}: {num_gpus} GPUs is not a whole number of {per_node}-GPU nodes")
    num_nodes = max(num_gpus // per_node, 1)
    gpus_per_node = min(num_gpus, per_node)
    return ResourcePool(
        name,
        num_nodes,
        gpus_per_node,
        cpus_per_bundle=cpus,
        strategy=cluster.placement,
        timeout_s=cluster.init_timeout_s,
    )


def assign_engine_gpus(bundles: list[BundleGPUs], gpus_per_engine: int) -> list[list[tuple[int, list[str]]]]:
    """Per rollout engine, per node of it (node-rank order): (the node's first bundle, its GPU ids). Engine k gets
    bundles k*g .. k*g+g-1 (g = gpus_per_engine): part of one node, or whole nodes. `bundles` is the rollout
    pool's `bundle_gpu_ids()`, in rank order."""
    g, num_gpus = gpus_per_engine, len(bundles)
    if g < 1 or num_gpus % g:
        valid = ", ".join(str(d) for d in range(1, num_gpus + 1) if num_gpus % d == 0)
        raise UserError(f"rollout.gpus_per_engine={g} does not divide the {num_gpus} rollout GPUs; valid: {valid}")
    per_node = Counter(bundle.node_id for bundle in bundles)
    engines = []
    for k in range(num_gpus // g):
        nodes: dict[str, tuple[int, list[str]]] = {}
        for index in range(k * g, (k + 1) * g):
            first, ids = nodes.setdefault(bundles[index].node_id, (index, []))
            ids.extend(bundles[index].gpu_ids)
        if len(nodes) > 1 and any(len(ids) != per_node[node] for node, (_, ids) in nodes.items()):
            sizes = list(per_node.values())
            whole = ", ".join(str(d) for d in range(1, num_gpus + 1) if all(n % d == 0 for n in sizes))
            first, last = k * g, k * g + g - 1
            raise UserError(
                f"rollout.gpus_per_engine={g}: engine {k} would take parts of several nodes (its GPUs are bundles "
                f"{first}..{last} of the rollout pool, whose nodes hold {', '.join(map(str, sizes))} GPUs): an engine "
                f"takes part of one node or whole nodes; valid: {whole}, or a multiple of the node size"
            )
        engines.append(list(nodes.values()))
    return engines


def _share(num_roles: int) -> float:
    """The GPU fraction each of `num_roles` colocated workers reserves (rounded down to Ray's precision)."""
    return int(10_000 / num_roles) / 10_000


def start_roles(config: JobConfig, rl_optimizer_steps: int, resume: Any = None) -> Roles:
    """Start every role's worker group and set it up (models loaded, rollout engines started)."""
    cluster = config.cluster
    timeouts = cluster.timeouts()
    env = dict(cluster.worker_env)
    wanted = {
        "critic": config.needs_critic,
        "ref": config.needs_ref,
        "teacher": config.needs_teacher_workers,
        "reward_model": (bool(config.rl_stages) and config.reward_model.enabled) or "rm" in config.run.stages,
    }
    own_teacher = wanted["teacher"] and config.placement.teacher_gpus > 0  # its own GPUs: none of the actor's
    train_roles = ["actor", *[name for name, on in wanted.items() if on and not (name == "teacher" and own_teacher)]]
    colocated = config.placement.mode == "colocated"
    hybrid = config.hybrid_engine()  # the engine inside the actor's worker: no worker of its own
    train_pool = _pool("train", config.placement.train_gpus, cluster, cluster.cpus_per_worker)
    pools = [train_pool]
    if colocated:
        rollout_pool, share = train_pool, _share(len(train_roles) + (not hybrid))
        rollout_share = share
    else:
        rollout_pool = _pool("rollout", config.placement.rollout_gpus, cluster, cluster.cpus_per_worker)
        pools.append(rollout_pool)
        share, rollout_share = _share(len(train_roles)), 1.0

    def group(role: str) -> WorkerGroup:
        worker_cls = HybridActorWorker if hybrid and role == "actor" else MegatronWorker
        return WorkerGroup(
            worker_cls, train_pool, role, num_gpus_per_worker=share, env=env, timeouts=timeouts, start=False
        )

    gpus_per_engine = config.rollout.gpus_per_engine
    engine_gpu_ids, engine_nodes, rollout_env = None, None, env
    if gpus_per_engine > 1:  # asked before any group takes the pool's GPUs (the probes need a sliver of each)
        engines = assign_engine_gpus(rollout_pool.bundle_gpu_ids(), gpus_per_engine)
        engine_gpu_ids = [nodes[0][1] for nodes in engines]
        if any(len(nodes) > 1 for nodes in engines):
            engine_nodes = [
                [EngineNodeSlot(rank, *rollout_pool.bundles[first], tuple(ids)) for rank, (first, ids) in nodes[1:]]
                for nodes in (list(enumerate(nodes)) for nodes in engines)
            ]
        rollout_env = {**env, NOSET_CUDA_VISIBLE_DEVICES: "1"}
    groups = {role: group(role) for role in train_roles}
    if own_teacher:
        teacher_pool = _pool("teacher", config.placement.teacher_gpus, cluster, cluster.cpus_per_worker)
        pools.append(teacher_pool)
        groups["teacher"] = WorkerGroup(
            MegatronWorker, teacher_pool, "teacher", num_gpus_per_worker=1.0, env=env, timeouts=timeouts, start=False
        )
    if hybrid:
        rollout = EngineView(groups["actor"])
    else:
        rollout = EngineFleet(
            rollout_pool,
            "rollout",
            max_restarts=engine_restarts(config),
            world_size=rollout_pool.world_size // gpus_per_engine,
            num_gpus_per_worker=rollout_share,
            env=rollout_env,
            timeouts=timeouts,
            bundle_stride=gpus_per_engine,
            start=False,
        )
    start_groups([*groups.values(), *([] if hybrid else [rollout])])
    roles = Roles(
        actor=groups["actor"],
        rollout=rollout,
        critic=groups.get("critic"),
        ref=groups.get("ref"),
        teacher=groups.get("teacher"),
        teacher_server=served_teacher(config),
        teacher_on_own_gpus=own_teacher,
        reward_model=groups.get("reward_model"),
        pools=pools,
        colocated=colocated,
        engine_gpu_ids=engine_gpu_ids,
        engine_nodes=engine_nodes,
    )
    setup_roles(config, roles, rl_optimizer_steps, resume)
    return roles


def engine_restarts(config: JobConfig) -> int:
    """How many times single engines are started again (rollout.max_engine_restarts): 0 unless the engines have
    GPUs of their own and the loop is synchronous (module docstring)."""
    split, sync = config.placement.mode == "split", config.rl.mode == "sync"
    return config.rollout.max_engine_restarts if split and sync and not config.hybrid_engine() else 0


def setup_roles(config: JobConfig, roles: Roles, rl_optimizer_steps: int, resume: Any = None) -> None:
    """Load every role's model (from the run checkpoint when resuming) in parallel; start the rollout engines."""
    seed = config.run.seed
    first_stage = config.run.stages[min(resume.stage_index, len(config.run.stages) - 1) if resume else 0]
    actor_optim = config.sft.optim if first_stage == "sft" else config.actor.optim
    actor_steps = config.sft.num_steps if first_stage == "sft" else rl_optimizer_steps
    pending = [
        _setup(roles.actor, config.actor, "lm", actor_optim, actor_steps, seed, resume, "actor"),
        _setup_rollout(roles.rollout, config, roles.engine_gpu_ids, roles.engine_nodes),
    ]
    if roles.critic is not None:
        pending.append(
            _setup(roles.critic, config.critic, "value", config.critic.optim, rl_optimizer_steps, seed, resume)
        )
    for name in FROZEN_POLICIES:
        if (group := getattr(roles, name)) is not None:
            pending.append(_setup(group, getattr(config, name), "lm", None, 1, seed, None))
    if roles.reward_model is not None:
        trained = "rm" in config.run.stages
        optim = config.rm.optim if trained else None
        pending.append(
            _setup(roles.reward_model, config.reward_model, "value", optim, config.rm.num_steps, seed, resume)
        )
    results = [call.result() for call in pending]
    if not isinstance(roles.rollout, EngineView):
        roles.rollout.started(results[1])  # the engines' process groups: reaped when one is started again


def _setup_rollout(
    group: EngineFleet | EngineView,
    config: JobConfig,
    engine_gpu_ids: list[list[str]] | None,
    engine_nodes: list[list[EngineNodeSlot]] | None = None,
):
    if not isinstance(group, EngineView):
        group.keep_setup(config.model.path, config.rollout, engine_gpu_ids, engine_nodes)
    if engine_gpu_ids is None:
        return group.async_call("setup", config.model.path, config.rollout)
    num_engines = len(engine_gpu_ids)
    paths, rollouts = [config.model.path] * num_engines, [config.rollout] * num_engines
    kwargs = {"gpu_ids": engine_gpu_ids}
    if engine_nodes is not None:
        kwargs["nodes"] = engine_nodes
    return group.async_call("setup", paths, rollouts, **kwargs, dispatch="per_rank")


def _setup(
    group: WorkerGroup,
    role: RoleConfig,
    head: str,
    optim,
    total_steps: int,
    seed: int,
    resume: Any,
    name: str | None = None,
):
    name = name or group.role
    path = str(resume.folder / name) if resume is not None and (resume.folder / name).is_dir() else None
    return group.async_call("setup", role.model, role.micro_batch, head, optim, total_steps, seed, path)


def served_teacher(config: JobConfig) -> SGLangTeacher | None:
    """The SGLang-served teacher of a distilling job (teacher.backend=sglang); None otherwise."""
    if not config.needs_teacher or config.teacher.backend != "sglang":
        return None
    from megarl.rollout.sglang_teacher import SGLangTeacher

    return SGLangTeacher.from_config(config.teacher.sglang)
