"""The Gated DeltaNet families, Qwen3-Next (model_type qwen3_next) and Qwen3.5 MoE (qwen3_5_moe, its text part
qwen3_5_moe_text): their own pieces checked against transformers' modules, and the whole models at every parallel
layout. Both are built from the same Megatron modules; Qwen3.5 stores the GDN input projection as four tensors in
Megatron's own order, has no dense layers, and ships as a vision-language checkpoint (language model under
`model.language_model.`, vision tower and MTP block carried through unchanged).

- megarl's Gated DeltaNet (the PyTorch path Megatron-Core lacks: its own module needs FLA's Triton kernels) against
  each family's transformers layer on the same weights, mapped by the weight table's own rows; the chunked delta
  rule against the plain per-step recurrence in float64; packed samples (THD) exactly as each sample alone, shared
  prompts included; gradients, at TP=1 and TP=2 (Qwen3-Next: the layer is the same module in both families).
- The gated q_proj and both GDN in_proj layouts: mappings invert bit for bit and split by heads at TP=2.
- The whole Megatron model's logits against transformers' at TP=1, TP=2, PP=2 (even and uneven), EP=2, VPP=2;
  bit-exact hf -> mcore -> hf round trips and `megarl convert --verify` (Qwen3.5: from its vision-language
  checkpoint, back to it bit for bit); the training checkpoint resharded at another layout (Qwen3-Next).
- Settings Megatron would compute differently, and layouts the GDN cannot run, refused before any weight is read.

The shared checks (routing, routing replay, the hf engine's weight sync, SGLang's loader, a GRPO run; for Qwen3-Next
also packed micro-batches' log-probs and updates against padded ones and parameter counts) list the tiny models in
their own files.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from helpers import assert_export_is_the_checkpoint, layout_id, megatron_logits, one_result
from test_convert import assert_same_checkpoint, round_trip

from megarl.bridge.mappings import GatedDeltaNetInProj, GatedQKV, Sections, VocabInfo
from megarl.errors import UserError
from megarl.models.hf_config import config_from_dict
from megarl.models.layout import check_parallel_layout
from megarl.models.registry import get_architecture
from megarl.runtime.parallel import ParallelConfig as P
from megarl.testing.tiny_checkpoint import tiny_config

VOCAB = VocabInfo(1000, 1024)
NEXT, QWEN35 = "tiny-qwen3-next", "tiny-qwen3.5-moe"
FAMILIES = [NEXT, QWEN35]
GDN_CLASSES = {  # transformers' layer of each family: module, class
    NEXT: ("transformers.models.qwen3_next.modeling_qwen3_next", "Qwen3NextGatedDeltaNet"),
    QWEN35: ("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe", "Qwen3_5MoeGatedDeltaNet"),
}
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4)
"""A one-block vision tower for the tiny Qwen3.5 vision-language checkpoint (its tensors are only carried)."""


def family_config(name: str = NEXT, **overrides):
    return config_from_dict({**tiny_config(name), **overrides})


def architecture(name: str):
    return get_architecture(tiny_config(name)["model_type"])


def next_config(**overrides):
    return family_config(NEXT, **overrides)


@pytest.fixture(scope="module")
def vision_language_checkpoint(tmp_path_factory):
    """Qwen3.5 as published: transformers' vision-language class saved (language model under
    `model.language_model.`, a vision tower under `model.visual.`, config.json's text_config), each layer's experts
    fused as the published checkpoints store them (`mlp.experts.gate_up_proj` [experts, 2 x ffn, hidden], gate rows
    then up rows; `mlp.experts.down_proj` [experts, hidden, ffn]; transformers saves them one per expert), plus an
    MTP block tensor (`mtp.*`, which transformers' class does not build)."""
    from safetensors.torch import load_file, save_file

    from megarl.testing.tiny_checkpoint import make_hf_checkpoint

    raw = {"model_type": "qwen3_5_moe", "text_config": tiny_config(QWEN35), "vision_config": VISION}
    folder = make_hf_checkpoint(raw, tmp_path_factory.mktemp("qwen3.5-vl") / "src")
    tensors = fuse_experts(load_file(folder / "model.safetensors"))
    tensors["mtp.fc.weight"] = torch.randn(64, 128)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def fuse_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert tensors (what save_pretrained writes) as the published Qwen3.5 checkpoints store them."""
    per_expert = re.compile(r"(.*\.mlp\.experts\.)(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
    fused, experts = {}, {}
    for name, tensor in tensors.items():
        match = per_expert.fullmatch(name)
        if match is None:
            fused[name] = tensor
        else:
            experts.setdefault(match[1], {})[int(match[2]), match[3]] = tensor
    for prefix, parts in experts.items():
        count = 1 + max(expert for expert, _ in parts)
        gate_up = [torch.cat([parts[e, "gate_proj"], parts[e, "up_proj"]]) for e in range(count)]
        fused[prefix + "gate_up_proj"] = torch.stack(gate_up)
        fused[prefix + "down_proj"] = torch.stack([parts[e, "down_proj"] for e in range(count)])
    return fused


@pytest.fixture(scope="module")
def megatron_state():
    from megarl.runtime.distributed import single_process_megatron

    with single_process_megatron():
        yield


# ---- the Gated DeltaNet layer ------------------------------------------------------------------------------------


def recurrent_delta_rule(q, k, v, g, beta):
    """The gated delta rule one position at a time (the definition), [batch, seq, heads, dim] in and out."""
    state = q.new_zeros(q.shape[0], q.shape[2], k.shape[-1], v.shape[-1])
    outputs = []
    for t in range(q.shape[1]):
        state = state * g[:, t, :, None, None].exp()
        remembered = (state * k[:, t, :, :, None]).sum(-2)
        state = state + k[:, t, :, :, None] * ((v[:, t] - remembered) * beta[:, t, :, None])[:, :, None]
        outputs.append((state * q[:, t, :, :, None]).sum(-2) * q.shape[-1] ** -0.5)
    return torch.stack(outputs, dim=1)


def test_chunked_delta_rule_is_the_recurrence():
    from megarl.models.gated_delta_net import chunked_gated_delta_rule, l2_normalize

    gen = torch.Generator().manual_seed(0)
    batch, seq, heads = 2, 150, 3  # three chunks of 64, the last one partial
    q, k = (l2_normalize(torch.randn(batch, seq, heads, 8, generator=gen, dtype=torch.float64)) for _ in "qk")
    v = torch.randn(batch, seq, heads, 5, generator=gen, dtype=torch.float64)
    g = -torch.rand(batch, seq, heads, generator=gen, dtype=torch.float64) * 2
    beta = torch.rand(batch, seq, heads, generator=gen, dtype=torch.float64)
    expected = recurrent_delta_rule(q, k, v, g, beta)
    assert (chunked_gated_delta_rule(q, k, v, g, beta) - expected).abs().max().item() < 1e-12
    assert (chunked_gated_delta_rule(q, k, v, g, beta, chunk=7) - expected).abs().max().item() < 1e-12


def hf_and_megarl_gdn(hf_config, seed: int = 0, tp_rank: int = 0, tp_size: int = 1, family: str = NEXT):
    """transformers' GDN layer of `family` (random weights, 1-D ones moved off their init) and megarl's with the same
    weights, mapped by the weight table's rows (TP rank `tp_rank` of `tp_size`'s shard of them)."""
    import importlib

    from megatron.core.transformer.transformer_config import TransformerConfig

    from megarl.models.gated_delta_net import GatedDeltaNet, gated_delta_net_spec
    from megarl.models.linear_attention import hybrid_config

    module, cls = GDN_CLASSES[family]
    torch.manual_seed(seed)
    hf = getattr(importlib.import_module(module), cls)(hf_config, 0)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if param.dim() == 1:
                param.add_(torch.randn_like(param) * 0.2)
            elif "proj" in name:
                torch.nn.init.normal_(param, std=0.1)
    fields = {
        k: v for k, v in hybrid_config(hf_config).items() if k.startswith("linear_") and k != "linear_attention_freq"
    }
    config = TransformerConfig(
        num_layers=1,
        hidden_size=hf_config.hidden_size,
        num_attention_heads=4,
        tensor_model_parallel_size=tp_size,
        layernorm_epsilon=hf_config.rms_norm_eps,
        use_cpu_initialization=True,
        **fields,
    )
    ours = GatedDeltaNet(config, gated_delta_net_spec(use_te=False).submodules, layer_number=1)
    table = architecture(family).mappings(hf_config)
    rows = {m.mcore.split("self_attention.")[1]: m for m in table if "self_attention." in m.mcore}
    hf_params = dict(hf.named_parameters())
    with torch.no_grad():
        for name, param in ours.named_parameters():
            mapping = rows[name]
            tensors = [hf_params[h.split("linear_attn.")[1]] for h in mapping.hf]
            full = mapping.hf_to_mcore(tensors, VOCAB)
            assert all(torch.equal(a, b) for a, b in zip(mapping.mcore_to_hf(full, VOCAB), tensors)), name
            param.copy_(mapping.shard(full, tp_rank, tp_size))
    return hf.eval(), ours.eval()


@pytest.mark.parametrize("family", FAMILIES)
def test_gated_delta_net_equals_transformers(megatron_state, family):
    """Three chunks' worth of positions, two value heads per key head: transformers' layer (its own PyTorch
    fallbacks, computed in fp32) and megarl's, fp32, on the same weights (Qwen3.5's: its four input projections
    concatenated into Megatron's in_proj)."""
    hf, ours = hf_and_megarl_gdn(family_config(family), family=family)
    x = torch.randn(2, 150, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(x)
        out, bias = ours(x.transpose(0, 1).contiguous(), None)
    assert bias is None
    assert (out.transpose(0, 1) - expected).abs().max().item() < 2e-5 * expected.abs().max().item()


def test_gradients_equal_transformers(megatron_state):
    """Training's backward pass through the layer: the weights' and the input's gradients of a loss on the output."""
    hf, ours = hf_and_megarl_gdn(next_config(), seed=4)
    x = torch.randn(2, 70, 64, generator=torch.Generator().manual_seed(5))
    probe = torch.randn(2, 70, 64, generator=torch.Generator().manual_seed(6))
    x_hf, x_ours = x.clone().requires_grad_(), x.transpose(0, 1).contiguous().requires_grad_()
    (hf(x_hf) * probe).sum().backward()
    out, _ = ours(x_ours, None)
    (out.transpose(0, 1) * probe).sum().backward()
    assert (x_ours.grad.transpose(0, 1) - x_hf.grad).abs().max().item() < 1e-5 * x_hf.grad.abs().max().item()
    for theirs, mine in (("A_log", "A_log"), ("dt_bias", "dt_bias"), ("norm.weight", "out_norm.weight")):
        expected = dict(hf.named_parameters())[theirs].grad
        got = dict(ours.named_parameters())[mine].grad
        # sums over every position and head: fp32 rounding of both sides (transformers computes in fp32 too)
        assert (got - expected).abs().max().item() < 1e-4 * expected.abs().max().item(), theirs


def gdn_gradients(layout) -> dict[str, torch.Tensor] | None:
    """Rank side: megarl's GDN at `layout`'s TP size on the same weights and input as at TP=1; the gradients of a
    loss on its output (the replicated output norm's, the input's) from TP rank 0 of the first data-parallel rank."""
    from megatron.core import parallel_state as ps

    from megarl.runtime.distributed import init_model_parallel

    init_model_parallel(layout)
    rank, size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    _, ours = hf_and_megarl_gdn(next_config(), seed=4, tp_rank=rank, tp_size=size)
    gradients = _gradients(ours)  # every rank: the layer's collectives
    return gradients if rank == 0 and ps.get_data_parallel_rank() == 0 else None


def _gradients(gdn) -> dict[str, torch.Tensor]:
    x = torch.randn(70, 2, 64, generator=torch.Generator().manual_seed(5)).requires_grad_()
    probe = torch.randn(70, 2, 64, generator=torch.Generator().manual_seed(6))
    out, _ = gdn(x, None)
    (out * probe).sum().backward()
    return {"out_norm": gdn.out_norm.weight.grad, "input": x.grad}


def test_tensor_parallel_gradients_equal_one_rank(megatron_state, ranks4):
    """At TP=2 each rank holds half the heads: the output norm's weight (one for all heads) gets the gradient of every
    head, summed over the TP group, and the input's gradient is the whole layer's."""
    _, single = hf_and_megarl_gdn(next_config(), seed=4)
    expected = _gradients(single)
    got = one_result(ranks4.run(gdn_gradients, P(tp=2)))
    for name in expected:
        assert (got[name] - expected[name]).abs().max().item() < 1e-5 * expected[name].abs().max().item(), name


def test_packed_samples_each_run_as_alone(megatron_state):
    """Packed rows (THD, what training feeds): no state or convolution window crosses from one sample to the next;
    a sample that shares its root's first tokens reads them as if they were its own."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from megarl.data.packing import SharedPrefix

    hf, ours = hf_and_megarl_gdn(next_config(), seed=2)
    x = torch.randn(1, 40, 64, generator=torch.Generator().manual_seed(3))
    cu_seqlens = torch.tensor([0, 11, 29, 40], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens)
    with torch.no_grad():
        out, _ = ours(x.transpose(0, 1).contiguous(), None, packed_seq_params=params)
        for start, stop in ((0, 11), (11, 29), (29, 40)):
            alone = hf(x[:, start:stop])[0]
            assert (out[start:stop, 0] - alone).abs().max().item() < 1e-5

        # sample 2 (tokens 29..40) continues the first 5 tokens of sample 1 (tokens 11..16)
        sharing = SharedPrefix(torch.tensor([0, 0, 5]), torch.tensor([0, 1, 1]))
        params.shared_prefix = cu_seqlens.shared_prefix = sharing
        shared, _ = ours(x.transpose(0, 1).contiguous(), None, packed_seq_params=params)
        whole = hf(torch.cat([x[:, 11:16], x[:, 29:40]], dim=1))[0, 5:]
    assert (shared[29:40, 0] - whole).abs().max().item() < 1e-5
    assert torch.equal(shared[:29], out[:29])


# ---- the weight table's layouts ----------------------------------------------------------------------------------


def test_gated_q_proj_splits_query_and_gate_per_head():
    heads, kv_heads, dim, hidden = 4, 2, 3, 5
    q_proj = torch.arange(heads * 2 * dim * hidden, dtype=torch.float32).view(heads * 2 * dim, hidden)
    k_proj, v_proj = torch.randn(kv_heads * dim, hidden), torch.randn(kv_heads * dim, hidden)
    mapping = GatedQKV("", (), num_heads=heads, num_kv_heads=kv_heads, head_dim=dim)
    full = mapping.hf_to_mcore([q_proj, k_proj, v_proj], VOCAB)
    per_head = q_proj.view(heads, 2, dim, hidden)
    # group 0: query heads 0 and 1, their gates, key 0, value 0
    group0 = torch.cat(
        [per_head[:2, 0].reshape(-1, hidden), per_head[:2, 1].reshape(-1, hidden), k_proj[:dim], v_proj[:dim]]
    )
    assert torch.equal(full[: len(group0)], group0)
    assert all(torch.equal(a, b) for a, b in zip(mapping.mcore_to_hf(full, VOCAB), [q_proj, k_proj, v_proj]))
    # TP rank 1 reads only its rows of each HF tensor: the same as cutting the full tensor
    slices = mapping.hf_slices(1, 2, [t.shape for t in (q_proj, k_proj, v_proj)])
    parts = [t[start:stop] for t, (_, start, stop) in zip((q_proj, k_proj, v_proj), slices)]
    assert torch.equal(mapping.hf_to_mcore(parts, VOCAB), mapping.shard(full, 1, 2))


def test_gdn_projections_group_by_kind_and_split_by_key_heads():
    hf_config = next_config()
    rows = {m.mcore.split("self_attention.")[-1]: m for m in get_architecture("qwen3_next").mappings(hf_config)}
    in_proj, conv = rows["in_proj.weight"], rows["conv1d.weight"]
    assert isinstance(in_proj, GatedDeltaNetInProj) and isinstance(conv, Sections)
    qkvz, ba = torch.randn(2 * (2 * 16 + 2 * 2 * 16), 64), torch.randn(2 * 4, 64)
    full = in_proj.hf_to_mcore([qkvz, ba], VOCAB)
    per_key = qkvz.view(2, -1, 64)  # key head 1: [q (16), k (16), v (2 x 16), z (2 x 16)]
    assert torch.equal(full[16:32], per_key[1, :16])  # q of key head 1
    assert torch.equal(full[32 + 16 : 32 + 32], per_key[1, 16:32])  # k of key head 1
    assert torch.equal(full[-4:], ba.view(2, 4, 64)[:, 2:].reshape(4, 64))  # a: the last two of each key head's b, a
    assert all(torch.equal(a, b) for a, b in zip(in_proj.mcore_to_hf(full, VOCAB), [qkvz, ba]))
    slices = in_proj.hf_slices(1, 2, [qkvz.shape, ba.shape])
    parts = [t[start:stop] for t, (_, start, stop) in zip((qkvz, ba), slices)]
    shard = in_proj.shard(full, 1, 2)
    assert torch.equal(in_proj.hf_to_mcore(parts, VOCAB), shard)
    assert torch.equal(in_proj.unshard([in_proj.shard(full, r, 2) for r in range(2)]), full)
    weight = torch.randn(2 * 32 + 64, 1, 4)
    assert torch.equal(conv.shard(weight, 1, 2), torch.cat([weight[16:32], weight[48:64], weight[96:128]]))
    assert torch.equal(conv.unshard([conv.shard(weight, r, 2) for r in range(2)]), weight)


def test_split_gdn_projections_concatenate_and_split_by_kind():
    """Qwen3.5: in_proj_qkv [q; k; v], in_proj_z, in_proj_b and in_proj_a are Megatron's in_proj in its own order;
    TP rank r holds the r-th part of each kind (q, k, v, z, b, a), so its heads' rows of all four tensors."""
    hf_config = family_config(QWEN35)
    rows = {m.mcore.split("self_attention.")[-1]: m for m in architecture(QWEN35).mappings(hf_config)}
    in_proj = rows["in_proj.weight"]
    assert [h.split("linear_attn.")[1] for h in in_proj.hf] == [
        f"in_proj_{kinds}.weight" for kinds in ("qkv", "z", "b", "a")
    ]
    qkv, z, b, a = torch.randn(2 * 32 + 64, 64), torch.randn(64, 64), torch.randn(4, 64), torch.randn(4, 64)
    full = in_proj.hf_to_mcore([qkv, z, b, a], VOCAB)
    assert torch.equal(full, torch.cat([qkv, z, b, a]))
    assert all(torch.equal(x, y) for x, y in zip(in_proj.mcore_to_hf(full, VOCAB), [qkv, z, b, a]))
    # rank 1 of 2: key head 1's q and k rows, value heads 2 and 3's v and z rows, their b and a
    q, k, v = qkv.split([32, 32, 64])
    expected = torch.cat([q[16:], k[16:], v[32:], z[32:], b[2:], a[2:]])
    assert torch.equal(in_proj.shard(full, 1, 2), expected)
    assert torch.equal(in_proj.unshard([in_proj.shard(full, r, 2) for r in range(2)]), full)


# ---- the whole model ---------------------------------------------------------------------------------------------

LAYOUTS = [
    pytest.param(P(), id="tp1"),
    pytest.param(P(tp=2), id="tp2"),
    pytest.param(P(pp=2), id="pp2"),
    pytest.param(P(pp=2, pp_first_stage_layers=1), id="pp2-uneven"),  # a GDN layer alone, then three
    pytest.param(P(ep=2), id="ep2"),
    pytest.param(P(tp=2, ep=2), id="tp2-ep2"),  # experts split by tensor parallelism too (etp = tp)
    pytest.param(P(tp=2, pp=2, ep=2, etp=1), id="tp2-pp2-ep2-etp1"),
    pytest.param(P(tp=2, sequence_parallel=True), id="tp2-sp"),  # the GDN's in_proj gathers the sequence
    pytest.param(P(pp=2, vpp=2), id="pp2-vpp2"),  # one layer per virtual stage
]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", FAMILIES)
def test_logits_match_hf(ranks4, hf_reference, name, layout):
    """Qwen3.5's RoPE is mRoPE (config.json `mrope_section`, set in the tiny config): text positions are the same on
    its three axes, where it is 1-D RoPE over the rotated part of each head, as Megatron computes it."""
    folder, ids, expected = hf_reference(name, batch=4)  # 192 tokens: every expert gets some
    logits = one_result(ranks4.run(megatron_logits, str(folder), layout, ids))
    diff = (logits - expected).abs().max().item()
    print(f"largest logit difference at {layout_id(layout)}: {diff:.2e}")
    assert diff < 1e-4


@pytest.mark.parametrize("layout", [P(tp=2, pp=2), P(tp=2, ep=2, etp=1), P(tp=2, pp=2, ep=2, etp=1)], ids=layout_id)
@pytest.mark.parametrize("name", FAMILIES)
def test_round_trip_is_bit_exact(ranks1, hf_checkpoint, tmp_path, name, layout):
    src = hf_checkpoint(name, torch.bfloat16, max_shard_size="100KB")
    mcore, back = round_trip(ranks1, src, tmp_path, layout, read_group_bytes=40_000)
    assert_same_checkpoint(src, back)
    assert json.loads((mcore / "megarl.json").read_text())["layout"]["tp"] == 2


@pytest.mark.parametrize("layout", [P(tp=2, pp=2, ep=2, etp=1), P(tp=2, ep=2), P(ep=4)], ids=layout_id)
@pytest.mark.parametrize("name", FAMILIES)
def test_export_from_the_live_model_equals_the_checkpoint(ranks4, hf_checkpoint, name, layout):
    """What a weight sync sends: each HF tensor once, rebuilt from every TP rank's share of the GDN projections (cut
    per kind: q, k, v, z, b, a) and the gated q_proj, equal to the checkpoint's."""
    assert_export_is_the_checkpoint(ranks4, hf_checkpoint(name, torch.bfloat16), layout)


@pytest.mark.parametrize("resumed_at", [P(pp=2, ep=2), P(ep=4)], ids=layout_id)
def test_training_checkpoint_resumes_at_another_layout(ranks4, hf_checkpoint, tmp_path, resumed_at):
    """The actor's role checkpoint (Megatron's distributed format, the GDN's in_proj and conv1d saved per kind, Adam
    states included) saved at EP=2 after two steps and resumed at PP=2 x EP=2 or EP=4: the third step's loss is the
    uninterrupted run's. (Tensor-parallel resharding of the same format: the round trips and `--verify` above.)"""
    from worker_ranks import random_batch, resume_and_train, train_and_save

    from megarl.algorithms.aggregation import loss_weights

    folder = str(hf_checkpoint(NEXT))
    batch = random_batch(8, vocab_size=1000, seed=5)
    weights = loss_weights("token-mean", batch["response_mask"])
    saved_at = P(ep=2)
    straight, _ = ranks4.run(train_and_save, folder, saved_at, batch, weights, str(tmp_path / "straight"), 3)[0]
    first, _ = ranks4.run(train_and_save, folder, saved_at, batch, weights, str(tmp_path / "saved"), 2)[0]
    loss, _, steps = ranks4.run(resume_and_train, folder, resumed_at, batch, weights, str(tmp_path / "saved"))[0]
    assert first == pytest.approx(straight[:2], abs=1e-7)
    assert loss == pytest.approx(straight[2], abs=1e-6) and steps == 3


def test_convert_verify_passes(hf_checkpoint, tmp_path):
    """`megarl convert --from hf --to mcore --verify`: the written checkpoint, loaded at its layout, against
    transformers' logits. One layout splits every way at once (GDN heads over TP, uneven stages, experts over EP:
    one CLI run of 4 ranks instead of three of 2; each split alone passes too: 2.09e-7 to 2.38e-7 on 2026-11-28)."""
    from test_cli import megarl, verified

    src, dst = hf_checkpoint(NEXT), tmp_path / "mcore"
    layout = ["--tp", "2", "--pp", "2", "--pp-first-stage-layers", "3", "--ep", "2", "--etp", "1"]
    out = megarl("convert", "--from", "hf", "--to", "mcore", str(src), str(dst), *layout, "--no-progress", "--verify")
    diff, top1 = verified(out.stdout)
    assert diff < 1e-4 and top1 == 100.0
    assert "tp=2 pp=2 vpp=1 pp_first_stage_layers=3 ep=2 etp=1 on 4 ranks" in out.stdout


def test_published_fused_experts_read_as_one_tensor_per_expert(vision_language_checkpoint):
    """Each expert's gate, up and down projections are its rows of the fused tensors, read whole or in slices (rows,
    columns: what a tensor-parallel import reads) from their own bytes, under the weight table's names."""
    from safetensors.torch import load_file

    from megarl.models.hf_config import read_hf_weights

    stored = load_file(vision_language_checkpoint / "model.safetensors")
    gate_up = stored["model.language_model.layers.0.mlp.experts.gate_up_proj"]
    down = stored["model.language_model.layers.0.mlp.experts.down_proj"]
    checkpoint, prefix, ffn = read_hf_weights(vision_language_checkpoint), "model.layers.0.mlp.experts.", 32
    assert gate_up.shape == (8, 2 * ffn, 64) and down.shape == (8, 64, ffn)  # 8 experts of width 32, hidden 64
    assert sorted(n for n in checkpoint.names if n.startswith(prefix)) == sorted(
        f"{prefix}{e}.{p}.weight" for e in range(8) for p in ("gate_proj", "up_proj", "down_proj")
    )
    for e in range(8):
        assert torch.equal(checkpoint.get(f"{prefix}{e}.gate_proj.weight"), gate_up[e, :ffn])
        assert torch.equal(checkpoint.get(f"{prefix}{e}.up_proj.weight"), gate_up[e, ffn:])
        assert torch.equal(checkpoint.get(f"{prefix}{e}.down_proj.weight"), down[e])
    assert torch.equal(checkpoint.get_slice(f"{prefix}1.up_proj.weight", 0, 2, 5), gate_up[1, ffn + 2 : ffn + 5])
    assert torch.equal(checkpoint.get_slice(f"{prefix}3.down_proj.weight", 1, 3, 7), down[3, :, 3:7])


def test_vision_language_checkpoint_converts_and_comes_back_bit_for_bit(ranks1, vision_language_checkpoint, tmp_path):
    """Qwen3.5 as published: `megarl convert --verify` reads the language model (config.json's text_config, tensors
    under `model.language_model.`) and compares it with transformers' Qwen3_5MoeForCausalLM loading the same folder;
    the vision tower and the MTP block are carried, and converting back gives the folder again, bit for bit."""
    from test_cli import megarl, verified

    from megarl.conversion.mcore_to_hf import convert_mcore_to_hf

    src, mcore, back = vision_language_checkpoint, tmp_path / "mcore", tmp_path / "back"
    layout = ["--tp", "2", "--pp", "2", "--pp-first-stage-layers", "3", "--ep", "2", "--etp", "1"]  # every split
    out = megarl("convert", "--from", "hf", "--to", "mcore", str(src), str(mcore), *layout, "--no-progress", "--verify")
    diff, top1 = verified(out.stdout)
    assert diff < 1e-4 and top1 == 100.0
    assert "tp=2 pp=2 vpp=1 pp_first_stage_layers=3 ep=2 etp=1 on 4 ranks" in out.stdout
    assert (
        "note: carried 22 tensors the Megatron model does not use through unchanged (the vision tower: model.visual.*; "
        "multi-token prediction: mtp.fc.*): converting back restores them"
    ) in out.stdout
    ranks1.run(convert_mcore_to_hf, str(mcore), str(back), read_group_bytes=40_000, show_progress=False)
    assert_same_checkpoint(src, back)
    assert json.loads((back / "config.json").read_text()) == json.loads((src / "config.json").read_text())


def test_weight_sync_from_the_vision_language_checkpoint_sends_text_names(ranks4, vision_language_checkpoint):
    """Trained from the published folder, the model syncs under the text model's names (`model.layers.*`), which
    both SGLang classes load (its Qwen3_5MoeForCausalLM only these; the vision-language class maps
    `model.language_model.` onto them) and the hf engine's Qwen3_5MoeForCausalLM holds; nothing of the vision tower
    or the MTP block travels."""
    from helpers import exported_weights

    from megarl.bridge.safetensors_io import HFCheckpoint

    results = ranks4.run(exported_weights, str(vision_language_checkpoint), P(tp=2, ep=2), 64 * 1024)
    sent = dict(item for tensors, _ in results for item in tensors)
    stored = HFCheckpoint(vision_language_checkpoint, split_fused_experts=True)  # experts one tensor each
    language = [n for n in stored.names if not n.startswith(("model.visual.", "mtp."))]
    assert sorted(sent) == sorted(n.replace("model.language_model.", "model.") for n in language)
    assert all(torch.equal(sent[n.replace("model.language_model.", "model.")], stored.get(n)) for n in language)


# ---- refusals ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"layer_types": ["linear_attention"] * 3}, "must name each of the 4 layers"),
        ({"layer_types": ["linear_attention", "sliding_attention"] * 2}, "'linear_attention' or 'full_attention'"),
        ({"linear_num_value_heads": 3}, "linear_num_value_heads=3 must be a multiple of linear_num_key_heads=2"),
        ({"attention_bias": True}, "attention_bias=True is not supported for {arch}: the published checkpoints"),
    ],
    ids=["layer-count", "layer-type", "value-heads", "attention-bias"],
)
@pytest.mark.parametrize("name", FAMILIES)
def test_settings_megatron_would_compute_differently_are_refused(name, overrides, message):
    hf_config = family_config(name)
    for key, value in overrides.items():
        setattr(hf_config, key, value)
    with pytest.raises(UserError, match=message.format(arch=architecture(name).name)):
        architecture(name).check_supported(hf_config)


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        (P(tp=4), r"--tp=4 does not divide .*linear_num_key_heads=2"),
        (P(cp=2), r"--cp=2 is not supported for qwen3_next: its Gated DeltaNet layers"),
    ],
    ids=["tp-key-heads", "cp"],
)
@pytest.mark.parametrize("name", FAMILIES)
def test_layouts_the_gdn_cannot_run_are_refused(name, layout, message):
    with pytest.raises(UserError, match=message.replace("qwen3_next", architecture(name).name)):
        check_parallel_layout(architecture(name), family_config(name), layout, prefix="--")


@pytest.mark.parametrize(
    ("overrides", "served"),
    [
        (
            {},
            True,
        ),  # layer_types and full_attention_interval 4 (tiny_checkpoint.py keeps it, as the hub's copies have it)
        ({"full_attention_interval": None}, True),  # as transformers reads the published config.json
        ({"full_attention_interval": 2}, False),  # SGLang would build layer 1 as full attention
        ({"full_attention_interval": 0}, False),
    ],
    ids=["tiny", "published", "other-interval", "zero-interval"],
)
@pytest.mark.parametrize("name", FAMILIES)
def test_sglang_serves_only_the_layer_kinds_it_derives(name, overrides, served):
    """SGLang 0.5.23 derives both families' layer kinds from full_attention_interval (its Qwen3_5TextConfig is its
    Qwen3NextConfig)."""
    hf_config = family_config(name)
    for key, value in overrides.items():
        setattr(hf_config, key, value)
    if served:
        architecture(name).check_sglang_supported(hf_config)
    else:
        with pytest.raises(UserError, match=r"model.path: config.json full_attention_interval=.* cannot be served"):
            architecture(name).check_sglang_supported(hf_config)
