"""The parallel layout of one Megatron model: how its weights and work split across ranks.

`ParallelConfig` is both the `parallel` section of a role's job config (`actor.model.parallel`, see
megarl/workers/config.py) and what the runtime takes. Like every config dataclass it is validated by `check(key)`,
not on construction: the config loader builds it first and then calls `check` with its full key, so errors name
`actor.model.parallel.tp`. Code that builds one from other user input (the convert CLI's flags) calls `check` itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megarl.errors import UserError
from megarl.runtime.stages import StageLayout

CP_COMM_TYPES = ("p2p", "all_gather", "a2a")
"""Transformer Engine's context-parallel exchanges megarl passes on (Megatron's `cp_comm_type`)."""


@dataclass(frozen=True)
class ParallelConfig:
    """How one model is split across its ranks: the sizes of the parallel axes. Data parallelism takes the ranks left
    over: world / (tp * pp * cp)."""

    tp: int = 1
    """Tensor-parallel size: each weight matrix is split across this many ranks."""
    pp: int = 1
    """Pipeline-parallel size: the layers are split into this many stages."""
    vpp: int = 1
    """Virtual pipeline chunks per pipeline stage (interleaved schedule); 1 means no interleaving."""
    pp_first_stage_layers: int | None = None
    """Decoder layers of the first pipeline stage when it should hold fewer (it also holds the embedding); the
    other stages share the rest evenly. null: an even split. Megatron's `decoder_first_pipeline_num_layers`."""
    pp_last_stage_layers: int | None = None
    """Decoder layers of the last pipeline stage (it also holds the output layer and loss); null: an even split.
    Megatron's `decoder_last_pipeline_num_layers`."""
    ep: int = 1
    """Expert-parallel size (MoE models): the experts are split across this many ranks."""
    etp: int | None = None
    """Expert tensor-parallel size; null (the default) means the same as `tp`."""
    cp: int = 1
    """Context-parallel size: each sequence split across this many ranks (each packed sample padded to a multiple
    of 2 x cp tokens and cut into 2 x cp chunks, rank r holding chunks r and 2cp-1-r; docs/long_context.md). The
    numbers equal cp = 1: CPU through megarl's attention, GPU through Transformer Engine's."""
    cp_comm_type: str = "p2p"
    """GPU (Transformer Engine's CP attention): how keys and values travel between the CP ranks: `p2p` (a ring,
    overlapped with the attention), `all_gather`, or `a2a` (heads scattered over the CP ranks: cp must divide the
    attention and key/value heads). megarl's CPU attention always all-gathers."""
    sequence_parallel: bool = False
    """Split activations along the sequence inside tensor-parallel regions (needs tp > 1; Transformer Engine
    layers)."""

    def check(self, key: str = "parallel") -> None:
        """Raise a UserError naming `{key}.<axis>` when a size is impossible on its own (whether the model can be
        split this way is checked against its config by megarl.models.layout). key="--" names the axes as
        command-line flags (`--tp`)."""
        for axis in ("tp", "pp", "vpp", "ep", "cp"):
            if getattr(self, axis) < 1:
                raise UserError(f"{_name(key, axis)}={getattr(self, axis)} must be >= 1")
        if self.cp_comm_type not in CP_COMM_TYPES:
            raise UserError(
                f"{_name(key, 'cp_comm_type')}={self.cp_comm_type!r} is not one of {', '.join(CP_COMM_TYPES)}"
            )
        if self.etp is not None and self.etp < 1:
            raise UserError(f"{_name(key, 'etp')}={self.etp} must be >= 1 (or unset: the same as tp)")
        if (self.pp_first_stage_layers is not None or self.pp_last_stage_layers is not None) and self.pp == 1:
            first, last = _name(key, "pp_first_stage_layers"), _name(key, "pp_last_stage_layers")
            raise UserError(f"{first}/{last} need pipeline parallelism ({_name(key, 'pp')} > 1)")
        if self.vpp > 1 and self.pp == 1:
            raise UserError(f"{_name(key, 'vpp')}={self.vpp} needs pipeline parallelism ({_name(key, 'pp')} > 1)")
        if self.sequence_parallel and self.tp == 1:
            raise UserError(f"{_name(key, 'sequence_parallel')}=true needs {_name(key, 'tp')} > 1")

    @property
    def model_parallel_size(self) -> int:
        """Ranks that hold one full copy of the model (data parallelism multiplies this)."""
        return self.tp * self.pp * self.cp

    @property
    def min_world_size(self) -> int:
        """The fewest ranks that run this layout: each pipeline stage holds one full dense copy (tp x cp ranks) and
        one full grid of experts (etp x ep ranks)."""
        etp = self.etp if self.etp is not None else self.tp
        return self.pp * math.lcm(self.tp * self.cp, etp * self.ep)

    @property
    def vpp_or_none(self) -> int | None:
        """The virtual pipeline size as Megatron-Core spells it (None when not interleaved)."""
        return self.vpp if self.vpp > 1 else None

    @property
    def stages(self) -> StageLayout:
        """Which layers each pipeline stage holds (megarl.runtime.stages)."""
        return StageLayout(self.pp, self.vpp, self.pp_first_stage_layers, self.pp_last_stage_layers)

    def megatron_stage_kwargs(self) -> dict[str, int | None]:
        """The uneven-stage fields of Megatron's TransformerConfig."""
        return dict(
            num_layers_in_first_pipeline_stage=self.pp_first_stage_layers,
            num_layers_in_last_pipeline_stage=self.pp_last_stage_layers,
        )

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
        if self.pp_first_stage_layers is not None:
            layout["pp_first_stage_layers"] = self.pp_first_stage_layers
        if self.pp_last_stage_layers is not None:
            layout["pp_last_stage_layers"] = self.pp_last_stage_layers
        if self.ep > 1 or self.etp is not None:
            layout.update(ep=self.ep, etp=self.etp if self.etp is not None else self.tp)
        return layout


def _name(key: str, axis: str) -> str:
    """`key.axis`, or `--axis` for the command-line key "--"."""
    return f"{key}{axis.replace('_', '-')}" if key.endswith("-") else f"{key}.{axis}"
