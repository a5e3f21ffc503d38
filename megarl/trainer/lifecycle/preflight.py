"""Checks that need the model's config.json or the machine, run before Ray or any model starts.

The config loader already checked each section and what spans sections (megarl/job.py). Here: the model
source exists, its architecture is supported, every role's TP/PP/EP splits the model (naming the key and the valid
sizes), every role's layout fits its GPUs, and the batch shapes fit the data-parallel sizes.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from megarl.errors import UserError

if TYPE_CHECKING:
    from megarl.job import JobConfig, RoleConfig


def load_model_config(config: JobConfig, off_machine: bool = False):
    """The HF config of the run's model: from model.path (a HF folder or megarl checkpoint), or model.init.config
    when the model is still to be built. off_machine (plan, --dry-run): model.path may live on the cluster only,
    and plan.model_config stands in for its config.json."""
    from megarl.checkpoint.hub import is_hub_id, resolve_model_path
    from megarl.checkpoint.model_dir import hf_config_dir
    from megarl.models.hf_config import load_hf_config

    path = Path(config.model.path)
    if is_hub_id(config.model.path) and config.model.init is None and not (off_machine and config.plan.model_config):
        path = Path(resolve_model_path(config.model.path, "model.path", weights=False))  # config and tokenizer
    if path.exists():
        return load_hf_config(hf_config_dir(path))
    if off_machine and config.plan.model_config and config.model.init is None:
        from megarl.plan.model_size import hf_config_from_dict, load_config_json
        from megarl.plan.planner import find_config_json

        found = find_config_json("", config.plan.model_config, "plan.model_config")
        return hf_config_from_dict(load_config_json(found, "plan.model_config"))
    if config.model.init is None:
        raise UserError(
            f"model.path={config.model.path!r} does not exist; give a HF model folder or a megarl checkpoint "
            "(or model.init to build a small model there)"
        )
    from megarl.models.hf_config import config_from_dict

    init_path = Path(config.model.init.config)
    try:
        raw = json.loads(init_path.read_text())
    except (OSError, ValueError) as err:
        raise UserError(f"model.init.config={str(init_path)!r} is not a readable config.json ({err})") from err
    raw["vocab_size"] = raw.get("vocab_size", 128)
    return config_from_dict(raw)


def used_roles(config: JobConfig) -> dict[str, RoleConfig]:
    roles = {"actor": config.actor}
    if config.needs_critic:
        roles["critic"] = config.critic
    if config.needs_ref:
        roles["ref"] = config.ref
    if config.reward_model.enabled or "rm" in config.run.stages:
        roles["reward_model"] = config.reward_model
    return roles


def check_model_files(path: str, hf_config) -> None:
    """The starting weights are intact before anything is built from them (megarl/checkpoint/verify.py): a megarl
    checkpoint's every shard, a HF folder's safetensors headers and its shapes against config.json."""
    from megarl.checkpoint.model_dir import is_megarl_checkpoint
    from megarl.checkpoint.verify import check_hf_weights, check_megarl_checkpoint

    folder = Path(path)
    if not folder.is_dir():
        return  # a model.init to build: nothing stored yet
    if is_megarl_checkpoint(folder):
        check_megarl_checkpoint(folder)
    elif any(folder.glob("*.safetensors")):
        check_hf_weights(folder, hf_config)


RAY_NODES_ENV = "MEGARL_RAY_NODES"
"""The number of Ray nodes tools/slurm/megarl.sbatch started (one per Slurm task), exported to the entry command."""


def check_ray_nodes(cluster, env: Mapping[str, str] = os.environ) -> None:
    """Inside the Slurm template, cluster.num_nodes must be the number of Ray nodes the job started: fewer leaves
    nodes idle, more waits for nodes that never come (cluster.init_timeout_s) before it fails."""
    started = env.get(RAY_NODES_ENV)
    if cluster.is_local or not started or int(started) == cluster.num_nodes:
        return
    raise UserError(
        f"cluster.num_nodes={cluster.num_nodes} but this Slurm job started {started} Ray node(s) (one per task, "
        f"{RAY_NODES_ENV}={started}); submit with sbatch --nodes={cluster.num_nodes} (one task per node) or set "
        f"cluster.num_nodes={started}"
    )


def check_role_layout(name: str, role: RoleConfig, arch, hf_config, gpus: int) -> int:
    """The role's TP/PP/EP split its model (`hf_config`, architecture `arch`) and its `gpus` workers; returns its
    data-parallel size."""
    from megarl.models.layout import check_parallel_layout

    key = f"{name}.model.parallel"
    parallel = role.model.parallel
    check_parallel_layout(arch, hf_config, parallel, prefix=f"{key}.")
    model_parallel = parallel.model_parallel_size
    if gpus % model_parallel:
        valid = [n for n in range(model_parallel, 8 * model_parallel + 1, model_parallel)]
        raise UserError(
            f"{key}: tp*pp*cp={model_parallel} does not divide placement.train_gpus={gpus} (the role's workers); "
            f"valid train_gpus: {', '.join(map(str, valid))}, ..."
        )
    expert_ranks = parallel.ep * (parallel.etp if parallel.etp is not None else parallel.tp) * parallel.pp
    if parallel.ep > 1 and gpus % expert_ranks:
        raise UserError(
            f"{key}: ep*etp*pp={expert_ranks} does not divide placement.train_gpus={gpus} (Megatron lays experts "
            "out over the data-parallel ranks of each stage)"
        )
    return gpus // model_parallel


def preflight(config: JobConfig, check_memory: bool = True, off_machine: bool = False) -> None:
    """Every check train makes before Ray starts; `megarl plan` and `--dry-run` run it too (off_machine: the model
    files may be on the cluster only, see load_model_config)."""
    from megarl.models.registry import get_architecture
    from megarl.rollout.weights_format import rollout_quantization
    from megarl.runtime.folders import check_writable_folder

    if not off_machine:  # the run folder: on this machine (a plan may be made elsewhere)
        check_writable_folder(config.run.dir, "run.dir")
        check_ray_nodes(config.cluster)
    hf_config = load_model_config(config, off_machine)
    arch = get_architecture(hf_config.model_type)
    arch.check_supported(hf_config)
    if not off_machine:
        check_model_files(config.model.path, hf_config)
    if config.rl_stages and config.rollout.backend == "sglang":
        arch.check_sglang_supported(hf_config)
        check_sglang_remote_code(config, off_machine)
    gpus = config.placement.train_gpus
    for name, role in used_roles(config).items():
        dp = check_role_layout(name, role, arch, hf_config, gpus)
        if name == "reward_model" and "rm" in config.run.stages and config.rm.batch_size % dp:
            raise UserError(
                f"rm.batch_size={config.rm.batch_size} must be a multiple of the reward model's data-parallel size "
                f"{dp} (each rank trains on whole pairs)"
            )
    engine_gpus, node_gpus = config.rollout.gpus_per_engine, config.cluster.gpus_per_node
    if node_gpus is not None and engine_gpus > node_gpus and engine_gpus % node_gpus:
        raise UserError(
            f"rollout.gpus_per_engine={engine_gpus} spans nodes of cluster.gpus_per_node={node_gpus} GPUs: an engine "
            f"larger than a node takes whole nodes; use a multiple of {node_gpus}"
        )
    if config.rl_stages:
        rollout_quantization(config.rollout, config.model.path)  # an FP8 format the engines cannot take is named
    if config.rl_stages and config.agent.enabled:
        from megarl.agents.environment import load_environment

        load_environment(config.agent.env, config.agent.env_kwargs)  # a bad name or constructor fails here
    if config.rl_stages and config.algorithm.routing_replay != "off" and arch.moe is None:
        warnings.warn(
            f"algorithm.routing_replay={config.algorithm.routing_replay} has no effect: {hf_config.model_type} is "
            "not a mixture-of-experts model",
            UserWarning,
            stacklevel=2,
        )
    check_teacher(config, off_machine)  # a teacher the run trains first (teacher.train): once it exists
    if check_memory:
        _check_memory(config)
    if config.placement.mode == "colocated" and gpus % config.rollout.gpus_per_engine:
        raise UserError(
            f"placement.train_gpus={gpus} is not a multiple of rollout.gpus_per_engine="
            f"{config.rollout.gpus_per_engine}: colocated engines share the training GPUs"
        )


def check_sglang_remote_code(config: JobConfig, off_machine: bool = False) -> None:
    """SGLang reads config.json itself: a model_type that megarl reads as another family's (Kimi K2's `kimi_k2`,
    hf_config.MODEL_TYPE_ALIASES) is known to SGLang only through the checkpoint's own code, which it runs only with
    rollout.sglang.trust_remote_code (otherwise each engine fails minutes into its start-up)."""
    from megarl.checkpoint.hub import is_hub_id, resolve_model_path
    from megarl.models.hf_config import MODEL_TYPE_ALIASES
    from megarl.plan.model_size import load_config_json
    from megarl.plan.planner import find_config_json

    if config.rollout.sglang.trust_remote_code:
        return
    path = config.model.path
    if is_hub_id(path) and config.model.init is None and not (off_machine and config.plan.model_config):
        path = resolve_model_path(path, "model.path", weights=False)  # cached by load_model_config already
    init = config.model.init.config if config.model.init is not None else None
    found = find_config_json(path, config.plan.model_config, "model.path", init_config=init)
    model_type = load_config_json(found, "model.path").get("model_type")
    if model_type in MODEL_TYPE_ALIASES:
        raise UserError(
            f"rollout.sglang.trust_remote_code=false, but {found} says model_type={model_type!r}, which SGLang "
            f"knows only through the checkpoint's own code (served as {MODEL_TYPE_ALIASES[model_type]}): set "
            "rollout.sglang.trust_remote_code=true, as SGLang's own instructions for this model do"
        )


def check_teacher(config: JobConfig, off_machine: bool = False, tokenizer=None) -> None:
    """The teacher's model exists, its architecture is supported, its layout splits it over the role's workers,
    and (given the student's `tokenizer`) it has the student's vocabulary. A teacher still to be trained
    (teacher.train) or, off_machine, not on this machine, is checked later."""
    from megarl.checkpoint.model_dir import hf_config_dir
    from megarl.models.hf_config import load_hf_config
    from megarl.models.registry import get_architecture
    from megarl.trainer.lifecycle.teacher import check_same_tokenizer

    path = config.teacher.model.path
    if not config.needs_teacher or not path:
        return
    if not Path(path).exists():
        if off_machine:
            return
        raise UserError(
            f"teacher.model.path={path!r} does not exist; give a HF model folder or a megarl checkpoint folder with "
            "the student's tokenizer, or leave it empty and set teacher.train.config to train one first"
        )
    if config.teacher.backend == "sglang":  # the server holds the weights: its tokenizer, and that it answers
        if tokenizer is not None:
            check_same_tokenizer(path, tokenizer)
            check_teacher_servers(config)
        return
    hf_config = load_hf_config(hf_config_dir(path))
    arch = get_architecture(hf_config.model_type)
    arch.check_supported(hf_config)
    check_model_files(path, hf_config)
    check_role_layout("teacher", config.teacher, arch, hf_config, teacher_gpus(config))
    if tokenizer is not None:
        check_same_tokenizer(path, tokenizer)


def teacher_gpus(config: JobConfig) -> int:
    """The Megatron teacher's workers: its own GPUs (placement.teacher_gpus), else the training GPUs."""
    return config.placement.teacher_gpus or config.placement.train_gpus


def check_teacher_servers(config: JobConfig) -> None:
    """teacher.backend=sglang: every server answers (before any worker starts); says what each one serves."""
    from megarl.rollout.sglang_teacher import SGLangTeacher

    for line in SGLangTeacher.from_config(config.teacher.sglang).describe():
        print(f"megarl: teacher: {line}", flush=True)


def plans_memory(config: JobConfig) -> bool:
    """Does the planner's memory verdict decide whether the job starts? For GPU runs with plan.check_memory; CPU
    runs (the hf engine without CUDA) have no GPU memory to plan."""
    import torch

    return config.plan.check_memory and (torch.cuda.is_available() or config.rollout.backend == "sglang")


def would_start(config: JobConfig, report) -> bool:
    """Given the plan of a job that passed pre-flight: does `megarl train` start it? (plan and --dry-run exit 0
    exactly then.)"""
    if plans_memory(config):
        return report.fits
    return not _placement_problems(config, report.placement)


def _placement_problems(config: JobConfig, placement) -> list[str]:
    """What a cluster of the size the config gives (cluster.num_nodes x cluster.gpus_per_node) cannot hold: the
    roles' GPUs do not fit it, or do not tile its nodes. Refused on any machine, GPU memory planned or not; with
    cluster.gpus_per_node unset the planner assumes a node size, and nothing is refused on that guess."""
    return [] if config.cluster.gpus_per_node is None else list(placement.problems)


def _check_memory(config: JobConfig) -> None:
    """The planner's verdict (megarl plan) for GPU runs, and the placement's for every run: refuse a job that will
    not fit before any GPU is taken."""
    from megarl.plan.planner import job_placement, run_plan

    if plans_memory(config):
        report = run_plan(config)
        if not report.fits:
            raise UserError(
                "megarl plan says this job does not fit (set plan.check_memory=false to start anyway):\n  "
                + "\n  ".join(report.problems)
            )
    elif problems := _placement_problems(config, job_placement(config)):
        raise UserError("megarl plan says this job does not fit the cluster:\n  " + "\n  ".join(problems))
