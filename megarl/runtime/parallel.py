"""The parallel layout of one Megatron model: how its weights and work split across ranks."""

from __future__ import annotations

from dataclasses import dataclass

from megarl.errors import UserError


@dataclass(frozen=True)
class ParallelConfig:
    """Sizes of the parallel axes. Data parallelism takes whatever ranks are left: world / (tp * pp * cp)."""

    tp: int = 1
    """Tensor-parallel size: each weight matrix is split across this many ranks."""
    pp: int = 1
    """Pipeline-parallel size: the layers are split into this many stages."""
    vpp: int = 1
    """Virtual pipeline chunks per pipeline stage (interleaved schedule); 1 means no interleaving."""
    ep: int = 1
    """Expert-parallel size (MoE models): the experts are split across this many ranks."""
    etp: int | None = None
    """Expert tensor-parallel size; None means the same as `tp`."""
    cp: int = 1
    """Context-parallel size: each sequence is split across this many ranks."""
    sequence_parallel: bool = False
    """Split activations along the sequence inside tensor-parallel regions (needs tp > 1)."""

    def __post_init__(self) -> None:
        for axis in ("tp", "pp", "vpp", "ep", "cp"):
            if getattr(self, axis) < 1:
                raise UserError(f"parallel.{axis}={getattr(self, axis)} must be >= 1")
        if self.etp is not None and self.etp < 1:
            raise UserError(f"parallel.etp={self.etp} must be >= 1 or None")
        if self.vpp > 1 and self.pp == 1:
            raise UserError(f"parallel.vpp={self.vpp} needs pipeline parallelism (parallel.pp > 1)")

    @property
    def model_parallel_size(self) -> int:
        """Ranks that hold one full copy of the model (data parallelism multiplies this)."""
        return self.tp * self.pp * self.cp

    @property
    def vpp_or_none(self) -> int | None:
        """The virtual pipeline size as Megatron-Core spells it (None when not interleaved)."""
        return self.vpp if self.vpp > 1 else None

    def megatron_sizes(self) -> dict[str, int | None]:
        """The sizes under Megatron-Core's names, which `initialize_model_parallel` and `TransformerConfig` share."""
        return dict(
            tensor_model_parallel_size=self.tp,
            pipeline_model_parallel_size=self.pp,
            virtual_pipeline_model_parallel_size=self.vpp_or_none,
            context_parallel_size=self.cp,
            expert_model_parallel_size=self.ep,
            expert_tensor_parallel_size=self.etp,
        )

    def layout_dict(self) -> dict[str, int]:
        """The layout as recorded in checkpoints: the axes that are split (expert axes only when used)."""
        layout = {"tp": self.tp, "pp": self.pp, "vpp": self.vpp}
        if self.ep > 1 or self.etp is not None:
            layout.update(ep=self.ep, etp=self.etp if self.etp is not None else self.tp)
        return layout
