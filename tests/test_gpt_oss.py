"""gpt-oss (model_type gpt_oss): its own pieces checked against transformers' modules, and what only gpt-oss asks of
the bridge.

- Attention sinks and sliding windows in megarl's SDPA core attention (the CPU path; Transformer Engine's on GPU)
  against transformers' `eager_attention_forward` with its own sliding-window mask, packed samples included.
- The clamped SwiGLU expert as Megatron-Core computes it (gated quick_gelu, glu_linear_offset, clamp value, bias
  scaled by the routing weight) against transformers' `GptOssExperts`, through the weight table's own mappings.
- Experts stacked in one checkpoint tensor per projection (`experts.gate_up_proj` [experts, hidden, 2 x ffn]): read
  one expert's row at a time, joined back on export from every expert-parallel rank, bit-exact round trips.
- Settings Megatron-Core would compute differently, refused before any weight is read.

Every architecture's shared checks (logits at TP/PP/EP, routing, SGLang's loader, the hf engine's weight sync,
routing replay, `convert --verify`, context parallelism, a GRPO run) list tiny-gpt-oss in their own files.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from helpers import assert_export_is_the_checkpoint, layout_id, megatron_logits, one_result
from test_convert import assert_same_checkpoint, round_trip

from megarl.bridge.mappings import InterleavedGateUp, Transposed, VocabInfo
from megarl.bridge.safetensors_io import HFCheckpoint, ShardedSafetensorsWriter, TensorSpec, join_stacked_rows
from megarl.errors import UserError
from megarl.models.hf_config import config_from_dict
from megarl.models.layout import check_parallel_layout
from megarl.models.registry import get_architecture
from megarl.runtime.parallel import ParallelConfig as P
from megarl.testing.tiny_checkpoint import tiny_config

VOCAB = VocabInfo(1000, 1024)


def gpt_oss_config(**overrides):
    return config_from_dict({**tiny_config("tiny-gpt-oss"), **overrides})


@pytest.fixture(scope="module")
def megatron_state():
    from megarl.runtime.distributed import single_process_megatron

    with single_process_megatron():
        yield


# ---- attention: sinks and sliding windows ------------------------------------------------------------------------

HEADS, KV_HEADS, HEAD_DIM, WINDOW = 4, 2, 16, 6


def core_attention(layer_number: int, sinks: torch.Tensor | None):
    """megarl's CPU core attention for layer 1 (a sliding-window layer) or 2 (full attention) of a gpt-oss-like
    config, with the given sink logits."""
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megarl.models.sdpa_attention import SDPACoreAttention

    config = TransformerConfig(
        num_layers=2,
        hidden_size=HEADS * HEAD_DIM,
        num_attention_heads=HEADS,
        num_query_groups=KV_HEADS,
        kv_channels=HEAD_DIM,
        softmax_type="learnable" if sinks is not None else "vanilla",
        window_size=(WINDOW - 1, 0),
        window_attn_skip_freq=[1, 0],
        attention_dropout=0.0,
        use_cpu_initialization=True,
    )
    attention = SDPACoreAttention(config, layer_number, AttnMaskType.causal, "self")
    if sinks is not None:
        attention.softmax_offset.data.copy_(sinks)
    return attention.eval()


def hf_attention(q, k, v, sinks: torch.Tensor, window: int | None) -> torch.Tensor:
    """transformers' gpt-oss attention on [batch, heads, seq, dim], with its own causal / sliding-window mask:
    [batch, seq, heads, dim]."""
    from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    seq = q.shape[2]
    allowed = (sliding_window_causal_mask_function(window) if window else causal_mask_function)(
        0, 0, torch.arange(seq)[:, None], torch.arange(seq)[None, :]
    )
    mask = torch.zeros(seq, seq).masked_fill(~allowed, float("-inf"))[None, None]
    module = SimpleNamespace(sinks=sinks, num_key_value_groups=HEADS // KV_HEADS, training=False)
    out, _ = eager_attention_forward(module, q, k, v, mask, scaling=HEAD_DIM**-0.5)
    return out


def random_qkv(batch: int, seq: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, h, seq, HEAD_DIM, generator=g) for h in (HEADS, KV_HEADS, KV_HEADS))


@pytest.mark.parametrize(("layer_number", "window"), [(1, WINDOW), (2, None)], ids=["sliding", "full"])
def test_core_attention_equals_transformers_with_sinks_and_windows(megatron_state, layer_number, window):
    q, k, v = random_qkv(batch=2, seq=20)
    sinks = torch.tensor([-1.0, 0.5, 2.0, 4.0])  # large ones take most of a row's probability
    expected = hf_attention(q, k, v, sinks, window)

    megatron_layout = [t.permute(2, 0, 1, 3) for t in (q, k, v)]  # [seq, batch, heads, dim]
    with torch.no_grad():
        out = core_attention(layer_number, sinks)(*megatron_layout, attention_mask=None)
    assert (out.view(20, 2, HEADS, HEAD_DIM).transpose(0, 1) - expected).abs().max().item() < 1e-6
    # and the sinks (and the window) changed the numbers: a plain causal softmax is far from them
    plain = hf_attention(q, k, v, torch.full((HEADS,), -1e9), None)
    assert (plain - expected).abs().max().item() > 0.1


def test_packed_samples_each_attend_as_alone(megatron_state):
    """Packed rows (THD, what training feeds): each sample's window and sinks exactly as for the sample alone."""
    from megatron.core.packed_seq_params import PackedSeqParams

    q, k, v = random_qkv(batch=1, seq=30, seed=1)
    sinks = torch.tensor([0.3, -0.2, 1.0, 0.0])
    attention = core_attention(1, sinks)
    cu_seqlens = torch.tensor([0, 11, 30], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens)
    packed = [t[0].transpose(0, 1) for t in (q, k, v)]  # [tokens, heads, dim]
    with torch.no_grad():
        out = attention(*packed, attention_mask=None, packed_seq_params=params)
    for start, stop in ((0, 11), (11, 30)):
        alone = hf_attention(*(t[:, :, start:stop] for t in (q, k, v)), sinks, WINDOW)[0]
        assert (out[start:stop].view(stop - start, HEADS, HEAD_DIM) - alone).abs().max().item() < 1e-6


# ---- experts: the clamped SwiGLU ---------------------------------------------------------------------------------


def test_expert_equals_transformers_clamped_swiglu(megatron_state):
    """One expert as Megatron-Core computes it with the settings the registry gives gpt-oss, its weights mapped from
    transformers' stacked tensors by the weight table's mappings; the routing weight scales the output bias too."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    from megarl.models.builder import build_transformer_config

    hf_config = gpt_oss_config(swiglu_limit=0.6)
    torch.manual_seed(0)
    experts = GptOssExperts(hf_config)
    for tensor in experts.parameters():
        torch.nn.init.normal_(tensor, std=0.2)
    spec = get_architecture("gpt_oss").to_mcore(hf_config)
    config = build_transformer_config(spec, P(), torch.float32)
    mlp = MLP(
        config,
        MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
        is_expert=True,
        ffn_hidden_size=config.moe_ffn_hidden_size,
    )

    e = 3
    with torch.no_grad():
        mlp.linear_fc1.weight.copy_(
            InterleavedGateUp("", (), transposed=True).hf_to_mcore([experts.gate_up_proj[e]], VOCAB)
        )
        mlp.linear_fc1.bias.copy_(InterleavedGateUp("", ()).hf_to_mcore([experts.gate_up_proj_bias[e]], VOCAB))
        mlp.linear_fc2.weight.copy_(Transposed("", ()).hf_to_mcore([experts.down_proj[e]], VOCAB))
        mlp.linear_fc2.bias.copy_(experts.down_proj_bias[e])
        x, weight = torch.randn(16, hf_config.hidden_size), torch.rand(16)
        gate_up = x @ experts.gate_up_proj[e] + experts.gate_up_proj_bias[e]
        expected = (experts._apply_gate(gate_up) @ experts.down_proj[e] + experts.down_proj_bias[e]) * weight[:, None]
        out, bias = mlp(x, per_token_scale=weight)
    assert bias is None and (out - expected).abs().max().item() < 1e-5
    assert (gate_up.abs() > 0.6).float().mean().item() > 0.2  # the clamp was at work


def test_stacked_expert_mappings_invert_and_split_gate_up_pairs():
    hidden, ffn = 6, 4
    stored = torch.arange(hidden * 2 * ffn, dtype=torch.float32).view(hidden, 2 * ffn)  # [in, gate0 up0 gate1 ...]
    mapping = InterleavedGateUp("", (), transposed=True)
    full = mapping.hf_to_mcore([stored], VOCAB)
    assert torch.equal(full[:ffn], stored[:, 0::2].t()) and torch.equal(full[ffn:], stored[:, 1::2].t())
    assert torch.equal(mapping.mcore_to_hf(full, VOCAB)[0], stored)
    shards = [mapping.shard(full, r, 2) for r in range(2)]  # each TP rank: its gate columns and the matching ups
    assert torch.equal(shards[1], torch.cat([full[2:4], full[6:8]])) and torch.equal(mapping.unshard(shards), full)


# ---- the checkpoint: stacked tensors row by row ------------------------------------------------------------------


def test_checkpoint_reads_one_expert_row_and_the_writer_joins_rows(hf_checkpoint, tmp_path):
    checkpoint = HFCheckpoint(hf_checkpoint("tiny-gpt-oss"))
    whole_name = "model.layers.2.mlp.experts.gate_up_proj"
    whole = checkpoint.get(whole_name)
    before = checkpoint.bytes_read
    row = checkpoint.get(f"{whole_name}[5]")
    assert torch.equal(row, whole[5]) and checkpoint.bytes_read - before == row.nbytes  # that row's bytes only
    assert checkpoint.spec(f"{whole_name}[5]").shape == whole.shape[1:]
    assert f"{whole_name}[7]" in checkpoint and f"{whole_name}[8]" not in checkpoint  # 8 experts

    rows = [TensorSpec(f"a[{i}]", torch.float32, (2,)) for i in range(3)]
    specs = join_stacked_rows([rows[0], TensorSpec("b", torch.float32, (1,)), rows[1], rows[2]])
    assert specs == [TensorSpec("a", torch.float32, (3, 2)), TensorSpec("b", torch.float32, (1,))]
    writer = ShardedSafetensorsWriter(tmp_path, specs, max_shard_bytes=10**6)
    a = torch.randn(3, 2)
    writer.write_all([("a[2]", a[2]), ("a[0]", a[0]), ("a[1]", a[1]), ("b", torch.ones(1))])  # any row order
    writer.close()
    assert torch.equal(HFCheckpoint(tmp_path).get("a"), a)


def test_round_trip_is_bit_exact_at_tp2_ep2(ranks1, hf_checkpoint, tmp_path):
    src = hf_checkpoint("tiny-gpt-oss", torch.bfloat16, max_shard_size="100KB")  # the dtype it ships in
    mcore, back = round_trip(ranks1, src, tmp_path, P(tp=2, ep=2, etp=1), read_group_bytes=40_000)
    assert_same_checkpoint(src, back)
    assert json.loads((mcore / "megarl.json").read_text())["layout"] == {"tp": 2, "pp": 1, "vpp": 1, "ep": 2, "etp": 1}


@pytest.mark.parametrize("layout", [P(pp=2, ep=2), P(tp=2, pp=2, ep=2, etp=1), P(ep=4)], ids=layout_id)
def test_export_joins_each_stacked_tensor_from_every_expert_parallel_rank(ranks4, hf_checkpoint, layout):
    assert_export_is_the_checkpoint(ranks4, hf_checkpoint("tiny-gpt-oss", torch.bfloat16), layout)


def test_uneven_stages_give_the_hf_logits(ranks4, hf_reference):
    folder, ids, expected = hf_reference("tiny-gpt-oss")
    layout = P(pp=2, ep=2, pp_first_stage_layers=1)  # a sliding-window layer alone, then three
    logits = one_result(ranks4.run(megatron_logits, str(folder), layout, ids))
    assert (logits - expected).abs().max().item() < 1e-4


# ---- refusals ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"swiglu_alpha": 1.5}, "swiglu_alpha=1.5 is not supported for gpt_oss: Megatron-Core's clamped SwiGLU"),
        ({"quantization_config": {"quant_method": "mxfp4"}}, "experts in MXFP4, which megarl does not read"),
        ({"attention_bias": False}, "attention_bias=False with mlp_bias=True is not supported for gpt_oss"),
        ({"layer_types": ["sliding_attention"] * 3}, "must name each of the 4 layers"),
        ({"layer_types": ["sliding_attention", "chunked_attention"] * 2}, "'sliding_attention' or 'full_attention'"),
    ],
    ids=["alpha", "mxfp4", "no-attention-bias", "layer-count", "layer-type"],
)
def test_settings_megatron_would_compute_differently_are_refused(overrides, message):
    hf_config = gpt_oss_config()
    for key, value in overrides.items():
        setattr(hf_config, key, value)
    with pytest.raises(UserError, match=message):
        get_architecture("gpt_oss").check_supported(hf_config)


def test_expert_tensor_parallelism_is_refused_naming_the_fix():
    with pytest.raises(
        UserError, match=r"--etp=2 \(unset: the same as tp\) cannot split the experts of gpt_oss.*--etp=1"
    ):
        check_parallel_layout(get_architecture("gpt_oss"), gpt_oss_config(), P(tp=2), prefix="--")
    check_parallel_layout(get_architecture("gpt_oss"), gpt_oss_config(), P(tp=2, etp=1), prefix="--")
