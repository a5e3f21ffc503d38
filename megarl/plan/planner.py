"""`run_plan(config) -> PlanReport`: will this job fit, where does each role go, how long is a weight sync.

Nothing is started and no weights are read: the model comes from its config.json (model.path/config.json, a megarl
checkpoint's hf/config.json, or plan.model_config).

How roles share a GPU (megarl's colocated design, workers/role_model.py): the training roles and, colocated, the
rollout engine take turns on the same GPUs. A trained role outside its turn is offloaded (parameters and optimizer
states to host memory, gradient buffers freed); a frozen role (ref, a reward model during RL) keeps its parameters
on the GPU; a released SGLang engine (memory saver) keeps little. So each role's peak is what it needs in its own
turn plus what stays resident: every worker process' CUDA context and NCCL buffers, the frozen roles' parameters,
the released engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from megarl.errors import UserError
from megarl.plan.host import host_memory_per_node
from megarl.plan.memory import GB, RoleMemory, resolve_layout, role_memory
from megarl.plan.model_size import (
    ModelShape,
    count_parameters,
    hf_config_from_dict,
    hf_numel,
    load_config_json,
    model_shape,
)
from megarl.plan.placement import Placement, layout_notes, place
from megarl.plan.report import PlanReport, RoleReport, gb
from megarl.plan.rollout import SGLANG_RUNTIME_GB, EngineMemory, engine_memory
from megarl.plan.sync import estimate_sync
from megarl.rollout.sglang_launch import engine_launches
from megarl.workers.config import OptimizerSettings

if TYPE_CHECKING:
    from megarl.job import JobConfig, RoleConfig

PROCESS_GB = 1.0
"""Per worker process on a GPU: CUDA context (~0.5 GB on H100) plus NCCL communicator buffers."""
RELEASED_ENGINE_GB = 1.0
"""What a released SGLang engine (memory saver) keeps besides its process: CUDA graph pool, allocator."""
REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class PlannedRole:
    name: str
    settings: RoleConfig
    optimizer: OptimizerSettings | None
    head: str


def run_plan(config: JobConfig, config_path: str = "") -> PlanReport:
    """The plan of a job: per-role memory at peak, placement, weight sync estimate. `megarl train` calls it as its
    pre-flight memory check (`report.fits`, `report.problems`)."""
    roles = planned_roles(config)
    shapes = _shapes(config, roles)
    gpus = config.plan.gpu_memory_gb * GB
    rl = bool(config.rl_stages)
    placement = job_placement(config, roles)
    longest = _longest_sample(config)
    memories, notes = _role_memories(config, roles, shapes, placement, longest)
    engine = None
    fp8 = rl and _serves_fp8(config)
    if rl and config.rollout.backend == "sglang":
        engine = engine_memory(shapes["actor"][0], config.rollout.sglang, gpus, fp8=fp8)
        notes += _context_window_notes(config, shapes["actor"][2], longest)
    elif rl:
        notes.append(f"rollout.backend={config.rollout.backend}: the engine runs on the CPU; its memory is not planned")
    colocated_engine = engine is not None and config.placement.mode == "colocated"
    engine_keeps = _released_engine_bytes(config, engine, notes) if colocated_engine else 0.0
    sharing = [role for role in roles if not _own_gpus(config, role.name)]  # the roles on the training GPUs
    processes = len(sharing) + (1 if colocated_engine else 0)
    frozen = [memories[role.name] for role in sharing if not memories[role.name].trainable]
    shared = {role.name: memories[role.name] for role in sharing}
    reports = [
        _role_report(memories[role.name], role, shared, processes, engine_keeps, gpus)
        if role in sharing
        else _role_report(memories[role.name], role, {}, 1, 0.0, gpus)
        for role in roles
    ]
    sync = None
    if engine is not None:
        reports.append(_rollout_report(config, engine, frozen, processes, placement, longest, gpus))
        sync = estimate_sync(
            shapes["actor"][0],
            memories["actor"].layout,
            placement,
            config.plan.intra_node_gbps,
            config.plan.inter_node_gbps,
            config.rollout.bucket_bytes,
            config.rollout.sglang.tp,
            config.weight_sync_transport(),
            fp8=fp8,
            shared_fs_gbps=config.plan.shared_fs_gbps,
        )
    launches = []
    if engine is not None:
        launches = engine_launches(
            config.rollout,
            config.model.path,
            num_engines=placement.num_engines,
            first_gpu=placement.rollout_first_gpu,
            gpus_per_node=placement.gpus_per_node,
        )
    gpus_on_node = min(config.placement.train_gpus, placement.gpus_per_node)
    host = host_memory_per_node(
        list(memories.values()),
        gpus_on_node,
        gpus_on_node if colocated_engine else 0,
        config.cluster.object_store_memory_mb,
        config.plan.host_memory_gb,
    )
    return PlanReport(
        config_path=config_path,
        model=_describe_model(roles, shapes),
        gpu_bytes=gpus,
        placement=placement,
        roles=reports,
        sync=sync,
        sync_bandwidths=(config.plan.intra_node_gbps, config.plan.inter_node_gbps, config.plan.shared_fs_gbps),
        host=host,
        host_memory_gb=config.plan.host_memory_gb,
        launches=launches,
        notes=notes + [note for shape, _, _ in shapes.values() for note in shape.notes],
    )


def _serves_fp8(config: JobConfig) -> bool:
    from megarl.rollout.weights_format import rollout_quantization

    return rollout_quantization(config.rollout, config.model.path) is not None


def job_placement(config: JobConfig, roles: list[PlannedRole] | None = None) -> Placement:
    """Where the job's roles and rollout engines go on the cluster (`roles`: planned_roles(config))."""
    return place(
        config.placement.mode,
        config.placement.train_gpus,
        config.placement.rollout_gpus,
        config.rollout.gpus_per_engine,
        config.cluster.num_nodes,
        config.cluster.gpus_per_node,
        [role.name for role in roles or planned_roles(config) if not _own_gpus(config, role.name)],
        with_rollout=bool(config.rl_stages),
        teacher_gpus=config.placement.teacher_gpus if config.needs_teacher_workers else 0,
    )


def _own_gpus(config: JobConfig, role: str) -> bool:
    """Whether `role` has GPUs of its own rather than the training GPUs (a teacher with placement.teacher_gpus)."""
    return role == "teacher" and config.placement.teacher_gpus > 0


def planned_roles(config: JobConfig) -> list[PlannedRole]:
    """The roles of the job's stages, with their optimizer when they train (None when frozen)."""
    stages = config.run.stages
    rl = bool(config.rl_stages)
    roles: list[PlannedRole] = []
    if rl or "sft" in stages:
        roles.append(PlannedRole("actor", config.actor, config.actor.optim if rl else config.sft.optim, "lm"))
    if config.needs_critic:
        roles.append(PlannedRole("critic", config.critic, config.critic.optim, "value"))
    if config.needs_ref:
        roles.append(PlannedRole("ref", config.ref, None, "lm"))
    if config.needs_teacher_workers:  # an SGLang-served teacher takes none of the job's GPUs
        roles.append(PlannedRole("teacher", config.teacher, None, "lm"))
    if "rm" in stages:
        roles.append(PlannedRole("reward_model", config.reward_model, config.rm.optim, "value"))
    elif rl and config.reward_model.enabled:
        roles.append(PlannedRole("reward_model", config.reward_model, None, "value"))
    if not roles:
        raise UserError(f"run.stages={stages} has no Megatron role to plan")
    return roles


def find_config_json(model_path: str, fallback: str | None, key: str, init_config: str | None = None) -> Path:
    """model_path/config.json, a megarl checkpoint's hf/config.json, else `fallback` (plan.model_config), else
    `init_config` (model.init.config: the model a run builds itself). A relative fallback is looked up from the
    working directory, then from the megarl repository, which ships configs/models."""
    if model_path:
        base = Path(model_path).expanduser()
        for candidate in (base / "config.json", base / "hf" / "config.json"):
            if candidate.is_file():
                return candidate
    for name, value in (("plan.model_config", fallback), ("model.init.config", init_config)):
        if not value:
            continue
        path = Path(value).expanduser()
        for candidate in (path, REPO_ROOT / path):
            if candidate.is_file():
                return candidate
        raise UserError(f"{name}={value!r} is not a file (looked in {Path.cwd()} and {REPO_ROOT})")
    raise UserError(
        f"{key}={model_path!r} has no config.json (nor hf/config.json) on this machine; set plan.model_config to the "
        "model's config.json to plan without the weights"
    )


def _shapes(config: JobConfig, roles: list[PlannedRole]) -> dict[str, tuple[ModelShape, object, Path]]:
    """Per role: (model shape, HF config, the config.json it came from); each file read once."""
    cache: dict[tuple[Path, str], tuple[ModelShape, object, Path]] = {}
    shapes = {}
    for role in roles:
        key = f"{role.name}.model.path"
        model_path, init = role.settings.model.path, None
        if config.model.init and model_path == config.model.path:
            init = config.model.init.config
        if role.name == "teacher" and not model_path:  # a teacher the run trains first: that job's actor
            model_path, init = _trained_teacher_model(config)
        path = find_config_json(model_path, config.plan.model_config, key, init)
        backend = "local" if role.settings.model.spec_backend == "local" else "te"
        if (path, backend) not in cache:
            hf_config = hf_config_from_dict(load_config_json(path, key))
            cache[path, backend] = (model_shape(hf_config, backend), hf_config, path)
        shapes[role.name] = cache[path, backend]
    return shapes


def _trained_teacher_model(config: JobConfig) -> tuple[str, str | None]:
    """(model path, model.init.config) of the actor of teacher.train.config, the job that trains the teacher."""
    from megarl.config import load_config

    job = load_config(type(config), config.teacher.train.config, config.teacher.train.overrides)
    return job.model.path, job.model.init.config if job.model.init else None


def _role_memories(
    config: JobConfig, roles: list[PlannedRole], shapes: dict, placement: Placement, longest: int
) -> tuple[dict[str, RoleMemory], list[str]]:
    memories: dict[str, RoleMemory] = {}
    notes: list[str] = []
    for role in roles:
        shape, hf_config, _ = shapes[role.name]
        settings = role.settings
        world = config.placement.teacher_gpus if _own_gpus(config, role.name) else config.placement.train_gpus
        layout = resolve_layout(settings.model, world, f"{role.name}.model", shape, hf_config)
        memories[role.name] = role_memory(
            role.name, shape, layout, settings.model, settings.micro_batch, role.optimizer, longest, role.head
        )
        moe = bool(shape.moe)
        gpn = placement.gpus_per_node
        notes += layout_notes(role.name, layout.tp, layout.ep, layout.etp, layout.pp, layout.world, gpn, moe)
        if role.optimizer and role.optimizer.offload_optimizer and not role.optimizer.use_distributed_optimizer:
            notes.append(f"{role.name}.optim.offload_optimizer needs use_distributed_optimizer=true in Megatron")
    return memories, notes


def _released_engine_bytes(config: JobConfig, engine: EngineMemory, notes: list[str]) -> float:
    """What a colocated engine keeps on the GPU while the training roles run."""
    if config.rollout.sglang.enable_memory_saver:
        return RELEASED_ENGINE_GB * GB
    notes.append(
        "rollout.sglang.enable_memory_saver=false: a colocated engine cannot release its weights and KV cache, so "
        "they stay on the GPU while the training roles run"
    )
    return engine.static_bytes


def _context_window_notes(config: JobConfig, config_json: Path, longest: int) -> list[str]:
    """The engines' context window against the longest sample: SGLang fits each request into its window, so a
    longer sample would end early (an agent episode: truncated); and it refuses to start with a context_length
    above the model's own window (sglang 0.5.23, unless SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1)."""
    from megarl.rollout.sglang_model import context_window

    derived = context_window(load_config_json(config_json, "model.path"))
    asked = config.rollout.sglang.context_length
    notes = []
    if asked and asked > derived:
        notes.append(
            f"rollout.sglang.context_length={asked} is above the model's context window ({derived} tokens from "
            f"{config_json.name}): SGLang refuses to start unless SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1; "
            "extend the model with YaRN instead (docs/long_context.md)"
        )
    window = asked or derived
    if longest > window:
        source = "agent.max_total_tokens" if config.agent.enabled else "rollout.sampling.max_new_tokens"
        notes.append(
            f"the longest sample ({longest} tokens: data.max_prompt_tokens + {source}) is longer than the engines' "
            f"context window ({window} tokens): SGLang ends such samples at {window}; extend the model with YaRN "
            "(rope_scaling and max_position_embeddings in config.json: docs/long_context.md)"
        )
    return notes


def _longest_sample(config: JobConfig) -> int:
    lengths = []
    if config.rl_stages:
        # an agent episode: its prompt, then turns and observations up to agent.max_total_tokens
        after_prompt = config.agent.max_total_tokens if config.agent.enabled else config.rollout.sampling.max_new_tokens
        lengths.append((config.data.max_prompt_tokens or 0) + after_prompt)
    if "sft" in config.run.stages:
        lengths.append(config.sft.data.max_tokens)
    if "rm" in config.run.stages:
        lengths.append(config.rm.data.max_tokens)
    return max(lengths or [0])


def _role_report(
    memory: RoleMemory,
    role: PlannedRole,
    memories: dict[str, RoleMemory],
    processes: int,
    engine_keeps: float,
    gpus: float,
) -> RoleReport:
    m = memory
    p = m.params
    lines = [(f"parameters ({m.dtype}; {p.dense / 1e9:.2f} B dense + {p.expert / 1e9:.2f} B expert)", m.param_bytes)]
    if not p.expert:
        lines[0] = (f"parameters ({m.dtype}; {p.total / 1e9:.2f} B)", m.param_bytes)
    if m.trainable:
        lines.append(("gradients (fp32 main_grad buffers)", m.grad_bytes))
        sharding = "sharded over DP" if m.distributed_optimizer else "not sharded"
        if m.offload_optimizer:
            lines.append((f"optimizer states (CPU offload: {gb(m.optimizer_host_bytes)} GB on host)", 0.0))
        else:
            states = "Adam fp32 master + m + v" if m.param_bytes < 4 * p.total else "Adam m + v"
            lines.append((f"optimizer states ({states}, {sharding})", m.optimizer_bytes))
    mode = "recompute" if m.recompute else "no recompute"
    tokens = (
        f"{m.train_tokens} tokens/micro-batch, {m.forward_tokens} forward"
        if m.trainable
        else f"{m.forward_tokens} tokens forward"
    )
    lines.append((f"activations ({mode}; {tokens})" if m.trainable else f"activations ({tokens})", m.activation_bytes))
    others = [o for name, o in memories.items() if name != m.role and not o.trainable]
    resident = processes * PROCESS_GB * GB + engine_keeps + sum(o.param_bytes for o in others)
    what = [_processes(processes)] + [f"{o.role} weights" for o in others]
    if engine_keeps:
        what.append("released engine")
    lines.append((f"resident: {', '.join(what)}", resident))
    stage = f"pipeline stage {m.stage} of {m.layout.pp}" if m.layout.pp > 1 else "one pipeline stage"
    info = [f"({stage}; {'trained' if m.trainable else 'frozen'}; {m.layout.world} GPUs)"]
    chunk = role.settings.micro_batch.logprob_chunk_tokens if role.head == "lm" else 0
    split = []
    if m.layout.cp > 1:
        split.append(f"cp {m.layout.cp}: {max(m.train_tokens, m.forward_tokens) // m.layout.cp} tokens per rank")
    if chunk:
        split.append(f"logits in {chunk}-token chunks")
    if split:
        info.append(f"({'; '.join(split)})")
    return RoleReport(role.name, m.layout.describe(bool(p.expert)), lines, gpus, info=info, detail=m)


def _rollout_report(
    config: JobConfig,
    engine: EngineMemory,
    frozen: list[RoleMemory],
    processes: int,
    placement: Placement,
    longest: int,
    gpus: float,
) -> RoleReport:
    sg = config.rollout.sglang
    colocated = config.placement.mode == "colocated"
    layout = f"{placement.num_engines} engine(s) x {engine.tp} GPUs: tp {engine.tp}"
    if sg.enable_dp_attention:
        layout += f" | dp-attention {engine.dp}"
    layout += f" | ep {engine.ep}; weights {engine.weights_label}, KV cache {engine.kv_dtype_bytes * 8}-bit"
    fraction = f"mem_fraction_static {engine.mem_fraction:.2f}{' (assumed)' if engine.mem_fraction_assumed else ''}"
    notes = []
    if engine.mem_fraction_assumed:
        notes.append("mem_fraction_static is null: planned with SGLang's usual value; set it when colocated")
    lines = [
        ("weights", engine.weight_bytes),
        (f"KV cache ({fraction} x GPU - weights)", max(0.0, engine.kv_bytes)),
        ("SGLang runtime (activations, CUDA graphs; outside the static pool)", SGLANG_RUNTIME_GB * GB),
    ]
    if colocated:
        resident = processes * PROCESS_GB * GB + sum(m.param_bytes for m in frozen)
        what = [_processes(processes)] + [f"{m.role} weights" for m in frozen]
        lines.append((f"resident: {', '.join(what)}", resident))
    else:
        lines.append(("the engine's worker process", PROCESS_GB * GB))
    per_engine = config.rl.prompts_per_step * config.rollout.sampling.n / max(1, placement.num_engines)
    capacity = engine.token_capacity
    info = [
        f"KV cache: {engine.kv_bytes_per_token / 1024:.1f} KB per token per GPU; {capacity} tokens per engine = "
        f"{capacity // max(1, longest)} samples of {longest} tokens at once (a step sends {per_engine:.0f} per engine)"
    ]
    problem = None
    need = longest * engine.kv_bytes_per_token
    if engine.kv_bytes < need:
        problem = (
            f"the KV cache has {gb(max(0.0, engine.kv_bytes))} GB per GPU, one sample of {longest} tokens needs "
            f"{gb(need)} GB: short by {gb(need - engine.kv_bytes)} GB (raise rollout.sglang.mem_fraction_static, or "
            "spread the engine over more GPUs)"
        )
    return RoleReport("rollout", layout, lines, gpus, info=info + notes, extra_problem=problem, detail=engine)


def _processes(count: int) -> str:
    return f"{count} worker process{'es' if count > 1 else ''}"


def _describe_model(roles: list[PlannedRole], shapes: dict) -> str:
    shape, _, path = shapes[roles[0].name]
    dense, expert = hf_numel(shape)
    params = count_parameters(shape, roles[0].settings.model.vocab_multiple)
    return (
        f"{shape.architecture} ({path}): {params / 1e9:.1f} B parameters in Megatron, "
        f"{gb((dense + expert) * shape.hf_dtype_bytes)} GB of {shape.hf_dtype_bytes * 8}-bit HF weights to sync"
    )
