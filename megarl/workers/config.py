"""Settings of the Megatron role workers (actor, critic, ref, reward model). Imports nothing heavy."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megarl.config.paths import path_field
from megarl.errors import UserError
from megarl.runtime.parallel import ParallelConfig


@dataclass
class OptimizerSettings:
    """AdamW with warm-up and decay. On GPU: Megatron's optimizer (distributed optimizer optional); on CPU a torch
    AdamW behind the same interface."""

    lr: float = 1e-6
    """Peak learning rate."""
    min_lr: float = 0.0
    """Learning rate at the end of the decay."""
    warmup_steps: int = 0
    """Optimizer steps of linear warm-up from 0 to lr."""
    decay_style: Literal["constant", "linear", "cosine"] = "constant"
    """Decay after warm-up, down to min_lr at decay_steps."""
    decay_steps: int = 0
    """Optimizer steps over which the LR decays; 0 = the trainer's total number of optimizer steps."""
    weight_decay: float = 0.0
    """Decoupled weight decay (AdamW); not applied to biases and norms."""
    beta1: float = 0.9
    """Adam's decay rate of the gradient's running mean, in [0, 1)."""
    beta2: float = 0.999
    """Adam's decay rate of the squared gradient's running mean, in [0, 1)."""
    eps: float = 1e-8
    """Added to the denominator of Adam's update, for numerical stability."""
    clip_grad: float = 1.0
    """Clip the global gradient norm (over all model-parallel ranks) to this; 0 = no clipping."""
    use_distributed_optimizer: bool = True
    """GPU: shard optimizer states over data-parallel ranks (Megatron's distributed optimizer)."""
    offload_optimizer: bool = False
    """GPU: keep optimizer states on the CPU (Megatron's optimizer CPU offload)."""
    max_consecutive_skips: int = 3
    """Optimizer steps in a row with a non-finite gradient norm (each skipped) after which the run stops, naming the
    role, the step and the first non-finite gradient; 0 = never stop."""

    def check(self, key: str) -> None:
        if self.lr < 0 or self.min_lr < 0:
            raise UserError(f"{key}.lr and {key}.min_lr must be >= 0 (got {self.lr}, {self.min_lr})")
        if self.min_lr > self.lr:
            raise UserError(f"{key}.min_lr={self.min_lr} is above {key}.lr={self.lr}")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise UserError(f"{key}.{name}={getattr(self, name)} must be in [0, 1)")
        if self.max_consecutive_skips < 0:
            raise UserError(f"{key}.max_consecutive_skips={self.max_consecutive_skips} must be >= 0 (0 = never stop)")
        if self.clip_grad < 0:
            raise UserError(f"{key}.clip_grad={self.clip_grad} must be >= 0 (0 = no clipping)")
        if self.offload_optimizer and not self.use_distributed_optimizer:
            raise UserError(
                f"{key}.offload_optimizer=true needs {key}.use_distributed_optimizer=true (Megatron offloads the "
                "distributed optimizer's shards)"
            )


@dataclass
class ModelSettings:
    """Where a role's weights come from and how its Megatron model is built."""

    path: str = path_field("model", "")
    """A Hugging Face model folder or a megarl checkpoint folder (written by `megarl convert` or training)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    """Parameter dtype of the Megatron model (float32 on CPU)."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """How the model is split across the role's workers; data parallelism takes the ranks left over."""
    recompute: bool = False
    """Recompute activations in the backward pass (full layers): less memory, ~30% more compute."""
    vocab_multiple: int = 128
    """Pad the vocabulary to a multiple of this x tp (Megatron's rule) when loading from HF."""
    spec_backend: Literal["auto", "local", "te"] = "auto"
    """Layer spec: Transformer Engine where present (auto), or Megatron's local modules."""

    def check(self, key: str) -> None:
        if self.vocab_multiple < 1:
            raise UserError(f"{key}.vocab_multiple={self.vocab_multiple} must be >= 1")


@dataclass
class MicroBatchSettings:
    """How a role's share of a batch is cut into micro-batches."""

    max_tokens: int = 8192
    """Token budget of one micro-batch (rows x longest row; packed: the samples' tokens); a longer sample gets a
    micro-batch of its own."""
    packing: bool = True
    """Pack each micro-batch's samples into one row with no padding (Megatron's THD layout; attention stays within
    each sample): log-probs, values, scores and updates of every role (a reward model's pairs stay in one
    micro-batch), and SFT. MoE passes that compare or replay rollout routing run padded rows (their per-sample
    routing records are row-aligned); false: padded rows everywhere. Where the model allows it, a packed sample
    that repeats the prompt of the sample before it (GRPO's n samples) lays it once (megarl/data/packing.py)."""
    packing_min_padding: float = 0.1
    """Pack only a batch whose padded rows would spend at least this share of their tokens on padding (or on
    prompts packing would not lay again): rows of about one length gain nothing from packing and pay for its index
    work (0: always pack). Expert-parallel ranks always pack (they must agree and hold different rows)."""
    forward_max_tokens: int = 0
    """Budget for forward-only passes (log-probs, values); 0 = 2 x max_tokens."""
    logprob_chunk_tokens: int = 0
    """Roles with a language-model head (actor, ref, teacher): compute log-probs and entropy over chunks of this
    many tokens (LM head, log-softmax and entropy per chunk, recomputed per chunk in the backward), so [tokens x
    vocab] logits never exist for a whole micro-batch; the numbers equal the unchunked ones to float rounding.
    Pays for long sequences and large vocabularies (docs/long_context.md); 0 = off (logits of a whole micro-batch
    at once). Value heads (critic, reward model) ignore it."""

    def check(self, key: str) -> None:
        if self.max_tokens < 1:
            raise UserError(f"{key}.max_tokens={self.max_tokens} must be >= 1")
        if self.logprob_chunk_tokens < 0:
            raise UserError(
                f"{key}.logprob_chunk_tokens={self.logprob_chunk_tokens} must be >= 0 (0 = off; e.g. 4096 computes "
                "log-probs 4096 tokens at a time)"
            )
        if not 0 <= self.packing_min_padding < 1:
            raise UserError(f"{key}.packing_min_padding={self.packing_min_padding} must be in [0, 1)")

    @property
    def forward_budget(self) -> int:
        return self.forward_max_tokens or 2 * self.max_tokens
