"""Gated DeltaNet linear attention (Qwen3-Next's `linear_attention` layers) that runs on CPU too.

Megatron-Core 0.16.1's `GatedDeltaNet` (megatron/core/ssm/gated_delta_net.py) refuses to be built without
flash-linear-attention (Triton kernels) and puts its parameters on the current CUDA device. This subclass keeps its
parameters, their names and its distributed-checkpoint layout (`sharded_state_dict`: in_proj cut into q, k, v, z,
beta, alpha and conv1d into q, k, v, so a checkpoint reloads at any tensor-parallel size), and computes the layer
itself: a depthwise causal convolution and the chunked gated delta rule written out in PyTorch below, or FLA's
`chunk_gated_delta_rule` when FLA is installed and the tensors are on a GPU.

Two differences from Megatron's module, both to compute what the HF model computes:
- `out_norm` is a gated RMSNorm whose weight multiplies as it is (HF `Qwen3NextRMSNormGated`), also when the
  model's other norms are zero-centered (weight applied as 1 + w): Megatron builds it from the config, zero-centered
  with them.
- Packed rows (Megatron's THD layout, megarl/data/packing.py) are run sample by sample, padded after each sample's
  tokens (the convolution and the recurrence are causal, so padding after a sample never reaches it): no state
  crosses from one sample to the next. Shared prompts (a sample taking its first tokens from a root sample) run on
  the same slots as megarl's SDPA attention. Context parallelism is not supported (refused at layout check).

The delta rule, per value head with state S [key_dim, value_dim], from S = 0 at each sample's start:
    S_t = exp(g_t) S_{t-1};  S_t += k_t (beta_t (v_t - S_t^T k_t))^T;  o_t = S_t^T q_t / sqrt(key_dim)
with q and k L2-normalized, g_t = -exp(A_log) softplus(a_t + dt_bias) and beta_t = sigmoid(b_t).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.ssm.gated_delta_net import HAVE_FLA, GatedDeltaNetSubmodules
from megatron.core.ssm.gated_delta_net import GatedDeltaNet as MegatronGatedDeltaNet
from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import build_module

from megarl.data.packing import packed_attention_index
from megarl.models.sdpa_attention import shared_prompt_slots

CHUNK = 64
"""Positions per chunk of the chunked delta rule: within a chunk the recurrence is one triangular solve."""


def _wide(t: torch.Tensor) -> torch.Tensor:
    """t in fp32, or as it is when wider (float64 checks)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def param_device() -> torch.device:
    """Where a module built now puts its own parameters, as Megatron's layers do: the current GPU, the CPU without
    one, or the meta device when the model is built for shapes only."""
    if torch.empty(0).device.type == "meta":
        return torch.device("meta")
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dimension (FLA's and HF's `l2norm`)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """SiLU of a depthwise causal convolution: x [batch, channels, seq], weight [channels, 1, kernel]; position t
    reads positions t - kernel + 1 .. t (zeros before the start)."""
    kernel = weight.shape[-1]
    out = F.conv1d(x.to(weight.dtype), weight, bias, padding=kernel - 1, groups=x.shape[1])
    return F.silu(out[..., : x.shape[-1]]).to(x.dtype)


def chunked_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, chunk: int = CHUNK
) -> torch.Tensor:
    """The gated delta rule's outputs [batch, seq, heads, value_dim] for q, k [batch, seq, heads, key_dim] (already
    L2-normalized), v [batch, seq, heads, value_dim], g (log decay, <= 0) and beta [batch, seq, heads], in fp32.

    Within a chunk of c positions, with gamma the cumulative log decay from the chunk's start and S0 the state
    before it, the updates u_i = beta_i (v_i - (S_i^-)^T k_i) solve the unit lower-triangular system
        (I + A) U = beta V - beta exp(gamma) K S0,   A_ij = beta_i exp(gamma_i - gamma_j) k_i.k_j  (j < i)
    and then O = exp(gamma) Q S0 + (Q K^T * D) U with D_ij = exp(gamma_i - gamma_j) (j <= i), and the state after
    the chunk is exp(gamma_c) S0 + (exp(gamma_c - gamma) K)^T U."""
    dtype = v.dtype
    q, k, v = (_wide(t.transpose(1, 2)) for t in (q, k, v))  # [batch, heads, seq, dim]
    g, beta = (_wide(t.transpose(1, 2)) for t in (g, beta))  # [batch, heads, seq]
    batch, heads, seq, key_dim = k.shape
    q = q * key_dim**-0.5
    state = q.new_zeros(batch, heads, key_dim, v.shape[-1])
    outputs = []
    for start in range(0, seq, chunk):
        stop = min(start + chunk, seq)
        qc, kc, vc, bc = q[:, :, start:stop], k[:, :, start:stop], v[:, :, start:stop], beta[:, :, start:stop]
        gamma = g[:, :, start:stop].cumsum(dim=-1)
        lower = torch.ones(stop - start, stop - start, dtype=torch.bool, device=q.device).tril()
        decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~lower, float("-inf")).exp()
        system = (bc[..., None] * (kc @ kc.transpose(-1, -2)) * decay).tril(-1)
        system = system + torch.eye(stop - start, dtype=q.dtype, device=q.device)
        rhs = bc[..., None] * vc - (bc * gamma.exp())[..., None] * (kc @ state)
        updates = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        outputs.append((qc * gamma.exp()[..., None]) @ state + ((qc @ kc.transpose(-1, -2)) * decay) @ updates)
        last = gamma[..., -1:]
        state = state * last[..., None].exp() + (kc * (last - gamma).exp()[..., None]).transpose(-1, -2) @ updates
    return torch.cat(outputs, dim=2).transpose(1, 2).to(dtype)


def _fla_delta_rule(q, k, v, g, beta) -> torch.Tensor:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    out, _ = chunk_gated_delta_rule(q, k, v, g=g, beta=beta, output_final_state=False, use_qk_l2norm_in_kernel=False)
    return out


class GatedRMSNorm(torch.nn.Module):
    """RMSNorm over each value head, its weight applied as is, times SiLU of the output gate z (HF
    `Qwen3NextRMSNormGated`), in fp32."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, tp_group=None):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype, device=param_device()))
        self.eps = eps
        self.tp_group = tp_group

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

        # one weight for every head, each TP rank holding some heads: its gradient is the sum over the TP group (the
        # backward of this copy all-reduces it; Megatron sums replicated norm weights only under sequence
        # parallelism, and only for sequence-split inputs)
        weight = self.weight
        if self.tp_group is not None and self.tp_group.size() > 1:
            weight = copy_to_tensor_model_parallel_region(weight, group=self.tp_group)
        x32 = _wide(x)
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (_wide(weight) * normed * F.silu(_wide(gate))).to(x.dtype)


class GatedDeltaNet(MegatronGatedDeltaNet):
    """Megatron's GatedDeltaNet with a PyTorch path (see the module docstring); same constructor contract."""

    def __init__(
        self,
        config,
        submodules: GatedDeltaNetSubmodules,
        layer_number: int | None = None,
        bias: bool = False,
        conv_bias: bool = False,
        pg_collection=None,
        **unused,  # cp_comm_type and the like: the attention modules' keyword arguments
    ):
        MegatronModule.__init__(self, config)  # not Megatron's __init__: it demands FLA and a CUDA device
        self.layer_number, self.bias, self.conv_bias, self.use_qk_l2norm = layer_number, bias, conv_bias, True
        self.pg_collection = (
            pg_collection if pg_collection is not None else ProcessGroupCollection.use_mpu_process_groups()
        )
        self.tp_size = self.pg_collection.tp.size()
        self.sp_size = self.tp_size if config.sequence_parallel else 1
        self.hidden_size, self.act_fn = config.hidden_size, F.silu
        self.conv_kernel_dim = config.linear_conv_kernel_dim
        self.key_head_dim, self.value_head_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.num_key_heads, self.num_value_heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.qk_dim = self.key_head_dim * self.num_key_heads
        self.v_dim = self.value_head_dim * self.num_value_heads
        self.in_proj_dim = self.qk_dim * 2 + self.v_dim * 2 + self.num_value_heads * 2
        self.in_proj = build_module(
            submodules.in_proj,
            self.hidden_size,
            self.in_proj_dim,
            config=config,
            init_method=config.init_method,
            gather_output=False,
            bias=bias,
            skip_bias_add=False,
            is_expert=False,
            tp_comm_buffer_name="fc1",
            tp_group=self.pg_collection.tp,
        )
        self.conv_dim = self.qk_dim * 2 + self.v_dim
        self.conv_dim_local_tp = self.conv_dim // self.tp_size
        self.conv1d = torch.nn.Conv1d(
            self.conv_dim_local_tp,
            self.conv_dim_local_tp,
            self.conv_kernel_dim,
            groups=self.conv_dim_local_tp,
            padding=self.conv_kernel_dim - 1,
            bias=conv_bias,
            dtype=config.params_dtype,
            device=param_device(),
        )
        self.num_v_heads_local_tp = heads = self.num_value_heads // self.tp_size
        self.dt_bias = torch.nn.Parameter(torch.empty(heads, dtype=config.params_dtype, device=param_device()))
        self.A_log = torch.nn.Parameter(torch.empty(heads, dtype=config.params_dtype, device=param_device()))
        for param in (self.conv1d.weight, self.dt_bias, self.A_log, *([self.conv1d.bias] if conv_bias else [])):
            set_tensor_model_parallel_attributes(param, True, 0, 1)  # this rank's channels and heads
        self.out_norm = GatedRMSNorm(
            config, self.value_head_dim, eps=config.layernorm_epsilon, tp_group=self.pg_collection.tp
        )
        self.out_proj = build_module(
            submodules.out_proj,
            self.v_dim,
            self.hidden_size,
            config=config,
            init_method=config.output_layer_init_method,
            bias=bias,
            input_is_parallel=True,
            skip_bias_add=True,
            is_expert=False,
            tp_comm_buffer_name="fc2",
            tp_group=self.pg_collection.tp,
        )
        if config.perform_initialization:
            with torch.no_grad():
                self.dt_bias.fill_(1.0)
                self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1, 16).log())

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, packed_seq_params=None, **unused):
        """[seq, batch, hidden] (packed: [tokens, 1, hidden]) -> (output, bias) as Megatron's attentions return."""
        if attention_mask is not None:
            raise NotImplementedError("GatedDeltaNet runs right-padded or packed rows, without an attention mask")
        projected, _ = self.in_proj(hidden_states)  # [seq, batch, in_proj_dim / tp] (sequence parallel: gathered)
        if packed_seq_params is None:
            mixed = self._mix(projected.transpose(0, 1)).transpose(0, 1)
        else:
            mixed = self._packed(projected, packed_seq_params)
        return self.out_proj(mixed)

    def _packed(self, projected: torch.Tensor, params) -> torch.Tensor:
        """Each packed sample in its own row of slots, padded after its tokens: [tokens, 1, d] -> [tokens, 1, v]."""
        cu_seqlens = params.cu_seqlens_q
        if getattr(cu_seqlens, "context_split", None) is not None:
            raise NotImplementedError("GatedDeltaNet does not support context parallelism")
        tokens = projected[:, 0]
        sharing = getattr(params, "shared_prefix", None)
        if sharing is not None:
            gather, slot_of_token, samples, width = shared_prompt_slots(cu_seqlens, sharing)
            slots = torch.cat([tokens, tokens.new_zeros(1, tokens.shape[1])]).index_select(0, gather)
        else:
            slot_of_token, samples, width = packed_attention_index(cu_seqlens)
            slot_of_token = slot_of_token.to(tokens.device)
            slots = tokens.new_zeros(samples * width, tokens.shape[1]).index_copy(0, slot_of_token, tokens)
        mixed = self._mix(slots.view(samples, width, -1))
        return mixed.reshape(samples * width, -1).index_select(0, slot_of_token)[:, None]

    def _mix(self, projected: torch.Tensor) -> torch.Tensor:
        """The layer between its two projections, batch first: [batch, seq, in_proj_dim / tp] -> [.., v_dim / tp]."""
        batch, seq, _ = projected.shape
        qk, v_local, heads = self.qk_dim // self.tp_size, self.v_dim // self.tp_size, self.num_v_heads_local_tp
        qkv, gate, b, a = torch.split(projected, [2 * qk + v_local, v_local, heads, heads], dim=-1)
        qkv = causal_conv1d(qkv.transpose(1, 2), self.conv1d.weight, self.conv1d.bias).transpose(1, 2)
        query, key, value = torch.split(qkv, [qk, qk, v_local], dim=-1)
        query, key = (l2_normalize(_wide(t.reshape(batch, seq, -1, self.key_head_dim))) for t in (query, key))
        value = value.reshape(batch, seq, heads, self.value_head_dim)
        repeat = self.num_value_heads // self.num_key_heads
        if repeat > 1:  # value heads g * repeat .. g * repeat + repeat - 1 read key head g
            query, key = (t.repeat_interleave(repeat, dim=2) for t in (query, key))
        g = -_wide(self.A_log).exp() * F.softplus(_wide(a) + _wide(self.dt_bias))
        beta = _wide(b).sigmoid()
        if HAVE_FLA and value.is_cuda:
            out = _fla_delta_rule(query.to(value.dtype), key.to(value.dtype), value, g, beta.to(value.dtype))
        else:
            out = chunked_gated_delta_rule(query, key, value, g, beta)
        out = self.out_norm(out, gate.reshape(batch, seq, heads, self.value_head_dim))
        return out.reshape(batch, seq, -1)


def gated_delta_net_spec(use_te: bool):
    """The layer spec of a GDN token mixer (its own input norm stays a separate module: nothing fused)."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    if use_te:
        from megatron.core.extensions.transformer_engine import TEColumnParallelLinear, TERowParallelLinear

        column, row = TEColumnParallelLinear, TERowParallelLinear
    else:
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

        column, row = ColumnParallelLinear, RowParallelLinear
    return ModuleSpec(module=GatedDeltaNet, submodules=GatedDeltaNetSubmodules(in_proj=column, out_proj=row))
