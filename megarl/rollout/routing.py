"""Routed experts as the rollout engine chose them: recorded per token, carried with the sample, replayed by the
trainer (R3, rollout routing replay; workers/routing_replay.py).

One completion's routing is a tensor [positions, moe_layers, topk] of expert ids: row t holds the experts that token
t of prompt + response was sent to in every MoE layer (dense layers are left out), ids sorted. It covers positions
0 .. N-2 of the N tokens: the last token is never fed to the engine, and its routing does not change any log-prob
the trainer computes (the logits at t predict token t+1). This is SGLang's own convention (`[start, seqlen - 1)`).
Ids are stored compactly: uint8 up to 256 experts, int16 beyond (`RoutingLayout.dtype`).

- `RoutingRecorder`: the `hf` engine's record, through forward hooks on the Hugging Face routers
  (`model.layers.{i}.mlp.gate`, gpt-oss's `mlp.router`: `RoutingLayout.hf_router`), whose output ends with the chosen
  ids [tokens, topk]: Mixtral, Qwen3-MoE, DeepSeek-V3 with group-limited routing and gpt-oss alike in transformers 5.x.
- `decode_sglang_routing`: SGLang's `meta_info["routed_experts"]`, base64 of int32 [seqlen - 1, num_hidden_layers,
  topk] (sglang 0.5.23, `srt/state_capturer/routed_experts.py`), with the dense layers dropped.
- `routing_problem`: what is wrong with a completion's routing (shape, ids out of range), in words.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from pathlib import Path

import torch

from megarl.models.moe import RoutingLayout


class RoutingRecorder:
    """Records the experts a transformers MoE model chooses, layer by layer, during each forward call."""

    def __init__(self, model: torch.nn.Module, layout: RoutingLayout):
        self.layout = layout
        self._chosen: dict[int, torch.Tensor] = {}
        self._handles = []
        layers = model.model.layers
        for position, layer_id in enumerate(layout.moe_layers):
            try:
                gate = layers[layer_id].get_submodule(layout.hf_router)
            except AttributeError:
                gate = None
            if gate is None:
                import transformers

                raise RuntimeError(
                    f"hf engine: model.layers.{layer_id}.{layout.hf_router} (a MoE router) not found in "
                    f"{type(model).__name__} (transformers {transformers.__version__}); routing cannot be recorded"
                )
            self._handles.append(gate.register_forward_hook(self._hook(position)))

    def _hook(self, position: int):
        def record(module, inputs, output) -> None:
            self._chosen[position] = output[-1]  # [tokens, topk] chosen expert ids

        return record

    @property
    def layout_shape(self) -> tuple[int, int]:
        """(moe_layers, topk): the shape of one token's routing."""
        return len(self.layout.moe_layers), self.layout.topk

    def take(self) -> torch.Tensor:
        """The routing of the tokens of the last forward call [tokens, moe_layers, topk] (tokens batch-major, as
        the model flattens [batch, seq]), on the CPU in the compact dtype; clears the record."""
        missing = [self.layout.moe_layers[p] for p in range(len(self.layout.moe_layers)) if p not in self._chosen]
        if missing:
            raise RuntimeError(f"hf engine: no routing recorded for MoE layers {missing} in the last forward")
        chosen = torch.stack([self._chosen[p] for p in range(len(self.layout.moe_layers))], dim=1)
        self._chosen.clear()
        return chosen.sort(dim=-1).values.to("cpu", self.layout.dtype)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def decode_sglang_routing(encoded: str, layout: RoutingLayout) -> torch.Tensor:
    """SGLang's base64 int32 routed experts -> [positions, moe_layers, topk] in the compact dtype, ids sorted (ids
    out of range stay int32, for the trainer's check to name with their sample: algorithm.routing_invalid)."""
    import numpy as np

    flat = np.frombuffer(base64.b64decode(encoded), dtype=np.int32)
    per_position = layout.num_layers * layout.topk
    if flat.size % per_position:
        raise ValueError(
            f"routed_experts holds {flat.size} ids, not a whole number of positions of {layout.num_layers} layers "
            f"x top-{layout.topk}"
        )
    routed = torch.from_numpy(flat.copy()).view(-1, layout.num_layers, layout.topk)
    routed = routed[:, list(layout.moe_layers)].sort(dim=-1).values
    if routed.numel() and (routed.min() < 0 or routed.max() >= layout.num_experts):
        return routed  # int32: the compact dtype would wrap the bad ids; routing_problem names them with the sample
    return routed.to(layout.dtype)


def routing_problem(routed: torch.Tensor | None, num_tokens: int, layout: RoutingLayout) -> str | None:
    """Why `routed` cannot be replayed for a sample of `num_tokens` tokens (prompt + response), or None if it can."""
    if routed is None:
        return "no routing was recorded"
    expected = (num_tokens - 1, len(layout.moe_layers), layout.topk)
    if tuple(routed.shape) != expected:
        return (
            f"routing of shape {tuple(routed.shape)}; expected {expected} (positions = tokens - 1, MoE layers "
            f"{list(layout.moe_layers)}, top-{layout.topk})"
        )
    if routed.numel():
        as_int = routed.to(torch.int32)
        out_of_range = (as_int < 0) | (as_int >= layout.num_experts)
        if out_of_range.any():
            position, layer, _ = out_of_range.nonzero()[0].tolist()
            return (
                f"expert id {int(as_int[position, layer].max())} at position {position} of MoE layer "
                f"{layout.moe_layers[layer]}, outside [0, {layout.num_experts})"
            )
        if layout.topk > 1 and (as_int[..., 1:] == as_int[..., :-1]).any():
            position, layer, _ = (as_int[..., 1:] == as_int[..., :-1]).nonzero()[0].tolist()
            return f"the same expert twice at position {position} of MoE layer {layout.moe_layers[layer]}"
    return None


def stack_rows(rows: Sequence[torch.Tensor], width: int, layout: RoutingLayout) -> torch.Tensor:
    """Per-sample routings [positions_i, moe_layers, topk] as one [samples, width, moe_layers, topk] tensor, zero
    past each sample's positions."""
    out = torch.zeros((len(rows), width, len(layout.moe_layers), layout.topk), dtype=layout.dtype)
    for i, routed in enumerate(rows):
        out[i, : routed.shape[0]] = routed
    return out


def engine_routing_layout(routed_experts: str, model_dir: str | Path) -> RoutingLayout | None:
    """The routing the engines record for the model in `model_dir` (a HF folder or a megarl checkpoint):
    None when rollout.routed_experts is off, for a dense model, or when no config.json is on this machine (a plan
    made elsewhere)."""
    from megarl.checkpoint.model_dir import hf_config_dir
    from megarl.models.hf_config import load_hf_config
    from megarl.models.registry import routing_layout

    if routed_experts == "off":
        return None
    folder = hf_config_dir(model_dir)
    if not (Path(folder) / "config.json").is_file():
        return None
    return routing_layout(load_hf_config(folder))
