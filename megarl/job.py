"""The job config: one YAML file (configs/*.yaml) is this tree of the components' own config dataclasses.

Each section belongs to the package that uses it (docs/architecture.md, habit 2); this module only nests them and checks
what spans sections. Checks that need the model's config.json or the cluster (parallel sizes against heads and experts,
GPUs against the cluster) run in the trainer's pre-flight, still before Ray starts
(megarl/trainer/lifecycle/preflight.py).
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from megarl.agents.config import AgentConfig
from megarl.algorithms.config import AlgorithmConfig
from megarl.cluster.config import ClusterConfig, cuda_available
from megarl.config.paths import path_field
from megarl.data.config import PromptDataConfig
from megarl.errors import UserError
from megarl.rewards.config import RewardConfig
from megarl.rollout.config import RolloutConfig
from megarl.trainer.config import STAGES, CheckpointConfig, RLConfig, RMConfig, SFTConfig
from megarl.trainer.observability.logging_config import LoggingConfig
from megarl.workers.config import MicroBatchSettings, ModelSettings, OptimizerSettings


@dataclass
class RunConfig:
    name: str = "run"
    """Name of the run (folder name, logger run name)."""
    dir: str = path_field("file", "runs/${run.name}")
    """Run folder: resolved config, metrics.jsonl, TensorBoard, plots, checkpoints."""
    seed: int = 1
    """Seeds rollout sampling and the workers' random streams (value heads, dropout); a resumed run derives them
    from it. Data order has its own seed (data.seed, sft.data.seed, rm.data.seed), a built model `model.init.seed`."""
    stages: list[str] = field(default_factory=lambda: ["grpo"])
    """What to run, in order: sft (supervised, e.g. a cold start), grpo / ppo (the RL loop; ppo trains a critic),
    rm (reward-model training). Later stages continue from the actor of earlier ones."""
    resume: Literal["auto", "never"] = "auto"
    """auto: continue from run.dir/checkpoints/latest when it exists; never: refuse a run folder that has one."""
    max_restarts: int = 1
    """When a worker process dies or a worker call fails mid-run, restart every role from the last checkpoint up
    to this many times before giving up (0 = stop at the first failure)."""
    phase_timeouts: dict[str, float | None] = field(default_factory=dict)
    """Deadline in seconds of each phase of a step: rollout, reward, handover, logprobs, update, sync, checkpoint,
    eval, wait, health (e.g. {rollout: 900, update: 1200}); a phase past it stops with an error naming the phase,
    the role (or engine) and the ranks that did not answer, and counts as a failure for run.max_restarts. Unset or
    null: a default that grows with the phase's work (docs/reliability.md, Phase deadlines)."""

    def check(self, key: str) -> None:
        from megarl.trainer.loops.deadlines import check_phase_timeouts

        if self.max_restarts < 0:
            raise UserError(f"{key}.max_restarts={self.max_restarts} must be >= 0")
        check_phase_timeouts(self.phase_timeouts, f"{key}.phase_timeouts")
        unknown = [s for s in self.stages if s not in STAGES]
        if unknown or not self.stages:
            raise UserError(f"{key}.stages={self.stages} must list stages from: {', '.join(STAGES)}")


@dataclass
class ModelInit:
    """Build a fresh model instead of loading weights (the CPU quickstart: there is no model hub here)."""

    config: str = path_field("file", "")
    """A HF config.json (e.g. configs/models/quickstart.json) to build a randomly initialized model from."""
    tokenizer: Literal["char"] = "char"
    """The tokenizer to build: char = one token per printable ASCII character (megarl.data.char_tokenizer)."""
    seed: int = 0
    """Initialization seed."""


@dataclass
class ModelSource:
    path: str = path_field("model", "")
    """The starting weights of every role: a HF model folder or a megarl checkpoint folder."""
    init: ModelInit | None = None
    """If set and `path` does not exist yet, build a tiny model there first (HF folder with tokenizer)."""

    def check(self, key: str) -> None:
        if not self.path:
            raise UserError(f"{key}.path is empty: give a HF model folder or a megarl checkpoint folder")


@dataclass
class RoleConfig:
    """A Megatron role (actor, critic, ref, reward model): its model and micro-batching. The frozen roles (ref, and
    the reward model during RL) have no optimizer: `optim` there is refused, naming what trains them instead."""

    REFUSED_KEYS: ClassVar[dict[str, str]] = {
        "optim": "has no effect for a frozen role: it is never trained, so it has no optimizer; remove it"
    }

    model: ModelSettings = field(default_factory=lambda: ModelSettings(path="${model.path}"))
    micro_batch: MicroBatchSettings = field(default_factory=MicroBatchSettings)


@dataclass
class TrainedRoleConfig(RoleConfig):
    """A role the RL stages train (actor, critic): also its optimizer."""

    optim: OptimizerSettings = field(default_factory=OptimizerSettings)


@dataclass
class RewardModelConfig(RoleConfig):
    REFUSED_KEYS: ClassVar[dict[str, str]] = {
        "optim": "has no effect for a frozen role: the reward model only scores samples during RL; the rm stage "
        "trains it with rm.optim"
    }

    enabled: bool = False
    """Score samples with a reward model (added to the rule reward scaled by `coef`)."""
    coef: float = 1.0
    """Weight of the reward model's score in the reward."""


@dataclass
class TeacherTraining:
    """A teacher the run trains itself, first, when teacher.model.path is empty (the distillation quickstart)."""

    config: str = path_field("file", "")
    """A job config that trains the teacher (e.g. quickstart.yaml), run in run.dir/teacher before this job's
    stages (resumed there, or skipped when that folder holds its finished run); the teacher is its last
    checkpoint's actor."""
    overrides: list[str] = field(default_factory=list)
    """Overrides of that job's keys, as on the command line (`rl.num_steps=20`); its run.dir is run.dir/teacher."""


@dataclass
class TeacherServer:
    """An SGLang server that already serves the teacher (teacher.backend=sglang), e.g. a large teacher on nodes of
    its own: it scores the student's tokens through /generate (prompt log-probs, nothing generated)."""

    urls: list[str] = field(default_factory=list)
    """Its base URLs (http://host:port), one per server; requests are spread over them."""
    timeout_s: float = 600.0
    """Deadline of one scoring request."""
    max_request_tokens: int = 65536
    """Tokens per /generate request (samples are grouped up to this many; a longer sample goes alone)."""
    parallel_requests: int = 4
    """Requests in flight at once, over all servers."""
    retries: int = 1
    """A failed request is sent again, to the next server, this many times before the step fails."""

    def check(self, key: str) -> None:
        for name in ("timeout_s", "max_request_tokens", "parallel_requests"):
            if getattr(self, name) <= 0:
                raise UserError(f"{key}.{name}={getattr(self, name)} must be > 0")
        if self.retries < 0:
            raise UserError(f"{key}.retries={self.retries} must be >= 0")

    def check_urls(self, key: str) -> None:
        """For a job that uses the servers (teacher.backend=sglang)."""
        bad = [url for url in self.urls if not url.startswith(("http://", "https://"))]
        if not self.urls or bad:
            shown = f" ({', '.join(map(repr, bad))} is not one)" if bad else ""
            raise UserError(
                f"{key}.urls={self.urls}: teacher.backend=sglang needs the base URL of at least one SGLang server "
                f"serving the teacher, e.g. [http://10.0.0.5:30000]{shown}"
            )


@dataclass
class TeacherConfig(RoleConfig):
    """On-policy distillation's teacher (algorithm.distill_coef > 0): a frozen model with the student's tokenizer,
    any registered architecture, that scores every token the actor samples. backend megatron: one more group of
    placement.train_gpus workers (colocated: it shares the actor's GPUs), loaded and run like the ref model;
    backend sglang: an SGLang server the user runs (teacher.sglang.urls) returns the log-probs."""

    backend: Literal["megatron", "sglang"] = "megatron"
    """What serves the teacher: megatron (a frozen Megatron model next to the actor), or sglang (a running SGLang
    server, teacher.sglang; prompt log-probs come at temperature 1, so rollout.sampling.temperature must be 1)."""
    model: ModelSettings = field(default_factory=ModelSettings)
    """The teacher's weights (model.path: a HF folder or a megarl checkpoint folder) and its own layout. With
    backend sglang: a folder with the teacher's config.json and tokenizer, checked against the student's (the
    weights stay with the server)."""
    train: TeacherTraining = field(default_factory=TeacherTraining)
    sglang: TeacherServer = field(default_factory=TeacherServer)
    """The SGLang server(s) serving the teacher (backend sglang)."""

    def check(self, key: str) -> None:
        if self.backend not in ("megatron", "sglang"):
            raise UserError(f"{key}.backend={self.backend!r}: valid are megatron, sglang")


@dataclass
class OffloadConfig:
    """What colocated training roles move to pinned host memory while the rollout engines hold the GPUs."""

    params: bool = True
    """Model weights (GPU only: on a CPU machine they already live in host memory)."""
    grads: bool = True
    """Gradient buffers (freed; they are zeroed at the next update anyway)."""
    optimizer: bool = True
    """Optimizer states and fp32 main weights."""


@dataclass
class PlacementConfig:
    """Where the roles run. Each training role (actor, critic, ref, reward model) is one group of `train_gpus`
    workers; rollout engines take `rollout.gpus_per_engine` GPUs each."""

    mode: Literal["colocated", "split"] = "colocated"
    """colocated: every role shares the training GPUs and they take turns (memory handed over by offloading);
    split: the rollout engines have GPUs of their own (needed for asynchronous RL)."""
    train_gpus: int = 1
    """GPUs (workers) of each training role's group."""
    rollout_gpus: int = 0
    """split: GPUs of the rollout engines (a multiple of rollout.gpus_per_engine)."""
    teacher_gpus: int = 0
    """On-policy distillation with a Megatron teacher: 0 puts the teacher's group on the training GPUs, beside the
    actor (`train_gpus` workers, memory shared); N gives it N GPUs of its own, after the training and rollout GPUs
    (its `teacher.model.parallel` layout then splits over N), so a large teacher takes none of the actor's memory."""
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    """colocated: what the training roles hand over while the engines generate (trainer/lifecycle/handover.py)."""
    handover: Literal["auto", "always"] = "auto"
    """colocated: when the roles and engines hand memory over around each generation. auto: when the workers
    compute on GPUs (on a CPU machine everything lives in host memory, and each handover call is a Ray round trip
    for nothing); always: on a CPU machine too (frees the gradient buffers while the engines generate, and runs the
    GPU path's calls where a test can see them)."""

    def check(self, key: str) -> None:
        if self.train_gpus < 1:
            raise UserError(f"{key}.train_gpus={self.train_gpus} must be >= 1")
        if self.mode == "split" and self.rollout_gpus < 1:
            raise UserError(f"{key}.mode=split needs {key}.rollout_gpus >= 1")
        if self.mode == "colocated" and self.rollout_gpus:
            raise UserError(f"{key}.rollout_gpus={self.rollout_gpus} has no effect with {key}.mode=colocated; use 0")
        if self.teacher_gpus < 0:
            raise UserError(f"{key}.teacher_gpus={self.teacher_gpus} must be >= 0 (0: on the training GPUs)")

    @property
    def gpus(self) -> int:
        """Every GPU the job's placement takes."""
        return self.train_gpus + self.rollout_gpus + self.teacher_gpus


@dataclass
class PlanConfig:
    """Hardware figures `megarl plan` and the pre-flight memory check use."""

    gpu_memory_gb: float = 80.0
    """Memory of one GPU, in GB."""
    intra_node_gbps: float = 900.0
    """GPU-to-GPU bandwidth inside a node, GB/s (NVLink; H100 SXM: ~900)."""
    inter_node_gbps: float = 50.0
    """Per-GPU bandwidth between nodes, GB/s (e.g. 400 Gb/s InfiniBand = 50 GB/s)."""
    shared_fs_gbps: float = 20.0
    """Aggregate bandwidth of the file system every node shares (the run directory), GB/s: the disk weight
    transport's speed (engines across nodes)."""
    host_memory_gb: float | None = None
    """Host memory of one node, GB; given, the plan refuses a job whose host memory per node exceeds 90% of it."""
    model_config: str | None = path_field("file", None)
    """A config.json to plan with when model.path is not on this machine (e.g. planning on a laptop)."""
    check_memory: bool = True
    """`megarl train` refuses to start when the plan says a role does not fit."""


@dataclass
class JobConfig:
    run: RunConfig = field(default_factory=RunConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    model: ModelSource = field(default_factory=ModelSource)
    actor: TrainedRoleConfig = field(default_factory=TrainedRoleConfig)
    critic: TrainedRoleConfig = field(default_factory=TrainedRoleConfig)
    """Used by stages whose advantage estimator needs values (ppo / gae)."""
    ref: RoleConfig = field(default_factory=RoleConfig)
    """Used when a KL to the reference policy is on (algorithm.kl.coef or policy_loss.kl_loss_coef)."""
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    """How to use it: docs/algorithms.md, On-policy distillation."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    """Multi-turn rollouts with an environment and tools (megarl/agents/); off unless agent.env is set."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    data: PromptDataConfig = field(default_factory=PromptDataConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    rm: RMConfig = field(default_factory=RMConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)

    @property
    def rl_stages(self) -> list[str]:
        return [s for s in self.run.stages if s in ("grpo", "ppo")]

    @property
    def needs_critic(self) -> bool:
        return bool(self.rl_stages) and self.algorithm.needs_critic()

    @property
    def needs_ref(self) -> bool:
        return bool(self.rl_stages) and self.algorithm.needs_ref()

    @property
    def needs_teacher(self) -> bool:
        return bool(self.rl_stages) and self.algorithm.needs_teacher()

    @property
    def needs_teacher_workers(self) -> bool:
        """A teacher the job runs itself (backend megatron), rather than a server it calls."""
        return self.needs_teacher and self.teacher.backend == "megatron"

    def hybrid_engine(self) -> bool:
        """Whether the hf engines run inside the actor's workers, engine i in worker i (rollout.hf.hybrid); `on`
        where they cannot is a UserError naming what rules it out."""
        choice, rollout, placement = self.rollout.hf.hybrid, self.rollout, self.placement
        if choice == "off" or not self.rl_stages:
            return False
        blockers = [
            f"{key}={value!r} (needs {wanted!r})"
            for key, value, wanted in (
                ("rollout.backend", rollout.backend, "hf"),
                ("placement.mode", placement.mode, "colocated"),
                ("rollout.gpus_per_engine", rollout.gpus_per_engine, 1),
                ("rollout.weight_sync", rollout.weight_sync, "auto"),
            )
            if value != wanted
        ]
        if blockers and choice == "on":
            raise UserError(
                "rollout.hf.hybrid=on runs each engine inside an actor worker, which this job rules out: "
                f"{'; '.join(blockers)}; use rollout.hf.hybrid=auto or off"
            )
        # auto: on this machine's CPUs only (a local Ray instance, no CUDA): the hybrid has not run on a GPU yet
        return not blockers and (choice == "on" or (self.cluster.is_local and not cuda_available()))

    def ray_cluster(self) -> ClusterConfig:
        """The cluster settings to start Ray with: a local instance without GPUs announces as many logical GPUs as
        the placement needs (placement groups and bundles then work exactly as on a GPU node)."""
        cluster = self.cluster
        if not cluster.is_local or cluster.logical_gpus is not None or cuda_available():
            return cluster
        needed = self.placement.gpus
        return dataclasses.replace(cluster, logical_gpus=needed, gpus_per_node=needed)

    def weight_sync_transport(self) -> str:
        """rollout.weight_sync resolved for this job's placement and actor layout (megarl/rollout/transports.py);
        `in_process` for a hybrid engine (the actor's worker copies the weights into its own engine)."""
        from megarl.rollout.transports import resolve_weight_sync

        if self.hybrid_engine():
            return "in_process"
        per_node, per_engine = self.cluster.gpus_per_node, self.rollout.gpus_per_engine
        engine_nodes = per_engine // per_node if per_node and per_engine > per_node else 1
        return resolve_weight_sync(
            self.rollout.weight_sync, self.rollout.backend, self.placement.mode, engine_nodes=engine_nodes
        )

    def check(self, key: str) -> None:
        if "ppo" in self.run.stages and not self.algorithm.needs_critic():
            raise UserError(
                f"run.stages has ppo but algorithm.advantage.estimator={self.algorithm.advantage.estimator!r} uses no "
                "critic; use algorithm.advantage.estimator=gae for PPO, or the grpo stage"
            )
        if "grpo" in self.run.stages and self.algorithm.needs_critic():
            raise UserError(
                "run.stages has grpo but algorithm.advantage.estimator=gae needs a critic; use the ppo stage"
            )
        if self.rl_stages and not self.data.train_files:
            raise UserError("data.train_files is empty: the RL stages need prompt files")
        if "sft" in self.run.stages and not self.sft.data.train_files:
            raise UserError("sft.data.train_files is empty: the sft stage needs demonstration files")
        if "rm" in self.run.stages and not self.rm.data.train_files:
            raise UserError("rm.data.train_files is empty: the rm stage needs preference-pair files")
        if self.rl.mode == "async" and self.placement.mode != "split":
            raise UserError(
                "rl.mode=async (asynchronous RL) needs placement.mode=split: rollout and training run at the same "
                "time on different GPUs"
            )
        if self.rl.mode == "async" and self.algorithm.needs_reward_baselines():
            raise UserError(
                f"algorithm.advantage.estimator={self.algorithm.advantage.estimator!r} needs a greedy baseline "
                "response per prompt, which only rl.mode=sync generates; use rl.mode=sync or another estimator"
            )
        if self.algorithm.routing_replay == "rollout" and self.rollout.routed_experts == "off":
            raise UserError(
                "algorithm.routing_replay=rollout replays the experts the rollout engine chose, but "
                "rollout.routed_experts=off does not record them; use rollout.routed_experts=auto, or "
                "algorithm.routing_replay=old_logprob"
            )
        self._check_teacher()
        if self.rl_stages:
            self.weight_sync_transport()  # a choice the placement or layout rules out is refused here
        if self.placement.mode == "split" and self.placement.rollout_gpus % self.rollout.gpus_per_engine:
            raise UserError(
                f"placement.rollout_gpus={self.placement.rollout_gpus} is not a multiple of "
                f"rollout.gpus_per_engine={self.rollout.gpus_per_engine}"
            )

    def _check_teacher(self) -> None:
        """A distilling job names its teacher (or the job that trains it, which must load and train an actor)."""
        teacher, coef = self.teacher, self.algorithm.distill_coef
        if not self.needs_teacher:
            if self.placement.teacher_gpus:
                raise UserError(
                    f"placement.teacher_gpus={self.placement.teacher_gpus} has no effect: the job has no teacher "
                    "(algorithm.distill_coef=0 or no RL stage); use 0"
                )
            if teacher.model.path or teacher.train.config:
                why = "no RL stage" if coef > 0 else "algorithm.distill_coef=0"
                warnings.warn(f"the teacher section has no effect: {why} (no distillation)", UserWarning, stacklevel=3)
            return
        if not teacher.model.path and not teacher.train.config:
            raise UserError(
                f"algorithm.distill_coef={coef} distils from a teacher, and none is given: set teacher.model.path (a "
                "HF folder or megarl checkpoint with the student's tokenizer), or teacher.train.config (a job config "
                "that trains one first)"
            )
        if teacher.backend == "sglang":
            self._check_served_teacher()
            if self.placement.teacher_gpus:
                raise UserError(
                    f"placement.teacher_gpus={self.placement.teacher_gpus} has no effect with teacher.backend=sglang "
                    "(the servers have their own GPUs); use 0"
                )
        elif teacher.sglang.urls:
            warnings.warn(
                f"teacher.sglang.urls={teacher.sglang.urls} has no effect: teacher.backend=megatron (set "
                "teacher.backend=sglang to score with those servers)",
                UserWarning,
                stacklevel=3,
            )
        if teacher.model.path and teacher.train.config:
            warnings.warn(
                f"teacher.train.config={teacher.train.config!r} has no effect: teacher.model.path is given",
                UserWarning,
                stacklevel=3,
            )
        elif teacher.train.config:
            from megarl.config import load_config

            try:
                job = load_config(JobConfig, teacher.train.config, teacher.train.overrides)
            except UserError as err:
                raise UserError(f"teacher.train.config={teacher.train.config!r}: {err}") from err
            if not {"sft", "grpo", "ppo"} & set(job.run.stages):
                raise UserError(
                    f"teacher.train.config={teacher.train.config!r} trains no actor (run.stages={job.run.stages}): "
                    "the teacher is the actor of that job; give it an sft, grpo or ppo stage"
                )

    def _check_served_teacher(self) -> None:
        """teacher.backend=sglang: a running server scores at temperature 1 the teacher it already holds."""
        teacher, temperature = self.teacher, self.rollout.sampling.temperature
        teacher.sglang.check_urls("teacher.sglang")
        if not teacher.model.path:
            raise UserError(
                "teacher.backend=sglang needs teacher.model.path: a folder with the teacher's config.json and "
                "tokenizer, so megarl can check that it maps every token to the student's id (the server keeps the "
                "weights); a teacher the run trains first (teacher.train) is served by megatron"
            )
        if temperature != 1.0:
            raise UserError(
                f"teacher.backend=sglang with rollout.sampling.temperature={temperature}: SGLang returns prompt "
                "log-probs at temperature 1 while megarl scores the student at the sampling temperature, so the "
                "reverse KL would compare two temperatures; set rollout.sampling.temperature=1.0, or use "
                "teacher.backend=megatron (both sides at the sampling temperature)"
            )
