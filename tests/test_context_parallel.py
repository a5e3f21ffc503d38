"""Context parallelism (megarl/models/context_parallel.py): every number at cp = 2 equals cp = 1.

Real Megatron-Core models on gloo ranks (tests/conftest.py's four-rank pool): megarl's SDPA core attention
all-gathers keys and values over the CP group (Transformer Engine's CP attention, the GPU path, cannot run here).
The same batch goes through cp = 1 and cp = 2 on the same four ranks (so the data-parallel size differs: the
gradient sums over data- and context-parallel ranks are what is checked too).
"""

from __future__ import annotations

import pytest
import torch
from helpers import layout_id, megatron_logits, one_result, sample_ids
from worker_ranks import (
    _dp_part,
    _init,
    critic_values,
    random_batch,
    resume_and_train,
    reward_model_step,
    settings_for,
    train_and_save,
)

from megarl.algorithms.aggregation import loss_weights
from megarl.data.batch import Batch
from megarl.runtime.parallel import ParallelConfig
from megarl.workers.schedule import split_micro_batches

CP1, CP2 = ParallelConfig(), ParallelConfig(cp=2)
TP2_CP2, VPP2_CP2 = ParallelConfig(tp=2, cp=2), ParallelConfig(pp=2, vpp=2, cp=2)
PP2_CP2 = ParallelConfig(pp=2, cp=2, pp_first_stage_layers=1)  # uneven: 1 and 3 of the 4 layers


# ---- rank side ---------------------------------------------------------------------------------------------------


def _replica_result(dp_rank: int, result: Batch | None) -> Batch:
    """The result the output rank of this rank's DP replica computed, on every rank of the replica."""
    import torch.distributed as dist

    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (dp_rank, result))
    return next(out for rank, out in everyone if rank == dp_rank and out is not None)


def logprobs_and_updates(path: str, layout, batch: Batch, weights: torch.Tensor, steps: int, chunk_tokens: int = 0):
    """Log-probs (with entropy) of a trainable actor, then `steps` PPO updates against them shifted off-policy:
    ((dp rank, log-prob Batch) or None, metrics per step, exported HF weights of the sending ranks)."""
    from megarl.algorithms.config import PolicyLossConfig
    from megarl.algorithms.losses import PolicyLoss
    from megarl.bridge.exporter import export_hf_weights
    from megarl.workers.policy import compute_logprobs, update_policy
    from megarl.workers.role_model import build_role_model

    _init(layout)
    model_settings, optim = settings_for(path, layout)
    model = build_role_model(model_settings, optimizer=optim, total_steps=10)
    dp_rank, part = _dp_part(batch.with_tensors(loss_weights=weights))
    out = compute_logprobs(model, part, 0.7, 64, with_entropy=True, packing=True, chunk_tokens=chunk_tokens)
    old = _replica_result(dp_rank, out)["logprobs"] + 0.05  # ratios away from 1: the clip and its gradient matter
    loss_fn = PolicyLoss(PolicyLossConfig(entropy_coef=0.01))
    history = [
        update_policy(model, part.with_tensors(old_logprobs=old), loss_fn, 0.7, 64, True, chunk_tokens)
        for _ in range(steps)
    ]
    sent = [(n, t.clone()) for bucket in export_hf_weights(model.loaded.bridge, torch.float32) for n, t in bucket]
    return (None if out is None else (dp_rank, out)), history, sent


# ---- test side ---------------------------------------------------------------------------------------------------


def _collect(results) -> tuple[Batch, list[dict], dict[str, torch.Tensor]]:
    """(the batch's log-probs in DP order, the metrics per step, the exported weights by name)."""
    parts = sorted(r[0] for r in results if r[0] is not None)
    assert [dp_rank for dp_rank, _ in parts] == list(range(len(parts))), "one output rank per DP replica"
    sent = {name: tensor for _, _, rank_sent in results for name, tensor in rank_sent}
    return Batch.concat([out for _, out in parts]), results[0][1], sent


def _assert_same_run(run, reference) -> dict[str, float]:
    """Log-probs, entropy, loss, gradient norm and the weights after the updates agree; the largest differences."""
    (out, history, sent), (ref_out, ref_history, ref_sent) = run, reference
    gaps = {
        "logprobs": (out["logprobs"] - ref_out["logprobs"]).abs().max().item(),
        "entropy": (out["entropy"] - ref_out["entropy"]).abs().max().item(),
        "weights": max((sent[name] - ref_sent[name]).abs().max().item() for name in ref_sent),
    }
    assert sent.keys() == ref_sent.keys()
    assert gaps["logprobs"] < 1e-5 and gaps["entropy"] < 1e-5 and gaps["weights"] < 1e-5, gaps
    for mine, ref in zip(history, ref_history, strict=True):
        assert mine["loss"] == pytest.approx(ref["loss"], abs=1e-6)
        assert mine["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
        assert mine["entropy"] == pytest.approx(ref["entropy"], rel=1e-5)
        assert not mine["skipped"]
    return gaps


@pytest.fixture(scope="module")
def reference(ranks4, hf_checkpoint):
    """GRPO-like groups (2 samples per prompt: packed rows share prompts) at cp = 1, tp = 1 (four DP ranks)."""
    folder = str(hf_checkpoint("tiny-qwen2"))
    batch = random_batch(8, vocab_size=1000, seed=21, samples_per_prompt=2)
    micro_batches = split_micro_batches(batch.split(4)[0], 64, packing=True, share_prompts=True)
    assert any(mb.shared and sum(mb.shared) > 0 for mb in micro_batches)  # the batch does share
    weights = loss_weights("token-mean", batch["response_mask"])
    return folder, batch, weights, _collect(ranks4.run(logprobs_and_updates, folder, CP1, batch, weights, 2))


@pytest.mark.parametrize(
    ("layout", "chunk_tokens"),
    [(CP2, 0), (TP2_CP2, 13), (PP2_CP2, 0), (VPP2_CP2, 0)],
    ids=lambda v: f"chunk{v}" if isinstance(v, int) else _id(v),
)
def test_logprobs_entropy_and_two_updates_equal_cp1(ranks4, reference, layout, chunk_tokens):
    """Packed rows with shared prompts (not under pipeline parallelism); at tp = 2 x cp = 2 the chunked LM head
    (workers/chunked_logprobs.py) too; the interleaved pipeline schedule's fixed shapes (every split padded to one
    token count)."""
    folder, batch, weights, ref = reference
    run = _collect(ranks4.run(logprobs_and_updates, folder, layout, batch, weights, 2, chunk_tokens))
    print(_id(layout), _assert_same_run(run, ref))


def _id(layout: ParallelConfig) -> str:
    return layout_id(layout) + f"-cp{layout.cp}"


@pytest.mark.parametrize("name", ["tiny-qwen3-moe", "tiny-deepseek-v3", "tiny-gpt-oss"])  # gpt-oss: windows, sinks
def test_moe_and_mla_equal_cp1(ranks4, hf_checkpoint, name):
    """A mixture-of-experts model, also with expert parallelism (CPU: the allgather dispatcher, fixed shapes agreed
    over the ranks), and DeepSeek's Multi-head Latent Attention (with YaRN RoPE and MoE layers)."""
    folder = str(hf_checkpoint(name))
    batch = random_batch(8, vocab_size=1000, seed=23, samples_per_prompt=2)
    weights = loss_weights("token-mean", batch["response_mask"])
    ref = _collect(ranks4.run(logprobs_and_updates, folder, CP1, batch, weights, 2))
    layouts = [CP2, ParallelConfig(ep=2, cp=2)] if name == "tiny-qwen3-moe" else [CP2]
    for layout in layouts:
        run = _collect(ranks4.run(logprobs_and_updates, folder, layout, batch, weights, 2))
        print(name, _id(layout), _assert_same_run(run, ref))


def _in_dp_order(results) -> list:
    return sorted((r for r in results if r is not None), key=lambda r: r[0])


def test_values_and_reward_model_equal_cp1(ranks4, reference):
    """A critic's values (packed rows, and padded rows: each row split as one sample) and a reward model's
    Bradley-Terry step (scores at each sample's last token, before and after: the value head's backward) at cp = 2
    equal cp = 1."""
    folder, batch, _, _ = reference
    ref, packed, padded = (
        torch.cat([v for _, v in _in_dp_order(ranks4.run(critic_values, folder, lay, batch, 64, packing))])
        for lay, packing in ((CP1, True), (CP2, True), (CP2, False))
    )
    for run in (packed, padded):
        assert (run - ref)[batch["attention_mask"].bool()].abs().max() < 1e-5
    pair_weights = torch.tensor([0.25, 0.0] * 4)
    ref, run = (_in_dp_order(ranks4.run(reward_model_step, folder, lay, batch, pair_weights)) for lay in (CP1, CP2))
    for index in (1, 2):  # scores before and after the step
        assert (torch.cat([r[index] for r in run]) - torch.cat([r[index] for r in ref])).abs().max() < 1e-5
    assert run[0][3]["loss"] == pytest.approx(ref[0][3]["loss"], abs=1e-6)
    assert run[0][3]["grad_norm"] == pytest.approx(ref[0][3]["grad_norm"], rel=1e-5)


def test_full_logits_and_a_checkpoint_equal_cp1(ranks4, reference, tmp_path):
    """Full logits through the pipeline schedule (what the sync probe's greedy decode and `convert --verify` read),
    and a role checkpoint saved at cp = 2 (optimizer and RNG states too) resumed at cp = 2 and at cp = 1."""
    folder, batch, weights, _ = reference
    ids = sample_ids(1000, batch=2, seq=37)  # 37 tokens: padded to 40 for the split
    ref = one_result(ranks4.run(megatron_logits, folder, CP1, ids))
    for layout in (CP2, ParallelConfig(pp=2, cp=2)):
        logits = [r for r in ranks4.run(megatron_logits, folder, layout, ids) if r is not None]
        assert len(logits) == 2 and (logits[0] - ref).abs().max() < 1e-5  # both CP ranks of the last stage hold them
    ranks4.run(train_and_save, folder, CP2, batch, weights, str(tmp_path / "cp2"))
    (loss, grad_norm, steps), (ref_loss, ref_grad_norm, ref_steps) = (
        ranks4.run(resume_and_train, folder, layout, batch, weights, str(tmp_path / "cp2"))[0] for layout in (CP2, CP1)
    )
    assert steps == ref_steps == 2
    assert loss == pytest.approx(ref_loss, abs=1e-6) and grad_norm == pytest.approx(ref_grad_norm, rel=1e-5)


# ---- bad input, refused before any process starts ----------------------------------------------------------------


BAD_CASES = [
    (
        "cp does not divide the gpus",
        ["actor.model.parallel.cp=2"],  # tp 2 x cp 2 on the base config's 2 GPUs
        ["actor.model.parallel: tp*pp*cp=4 does not divide placement.train_gpus=2", "valid train_gpus: 4, 8"],
        "tiny-qwen3",
    ),
]


@pytest.mark.parametrize(("name", "overrides", "expect", "model"), BAD_CASES, ids=[c[0] for c in BAD_CASES])
def test_bad_context_parallel_input_is_refused(name, overrides, expect, model, tmp_path, hf_checkpoint, capsys):
    """Through the real command line, as tests/test_bad_inputs.py's catalogue: exit 2, one message naming the key
    and what would work, nothing written."""
    import test_bad_inputs

    case = test_bad_inputs.Case(name, [*test_bad_inputs.TRAIN, *overrides], expect, model=model)
    test_bad_inputs.test_bad_input_is_refused_clearly(case, tmp_path, hf_checkpoint, capsys)


def test_bad_cp_settings_are_refused_naming_the_key(hf_checkpoint):
    from megarl.errors import UserError
    from megarl.models.hf_config import load_hf_config
    from megarl.models.layout import check_parallel_layout
    from megarl.models.registry import get_architecture

    with pytest.raises(UserError, match=r"actor.model.parallel.cp_comm_type='ring' is not one of p2p, all_gather, a2a"):
        ParallelConfig(cp=2, cp_comm_type="ring").check("actor.model.parallel")
    hf_config = load_hf_config(hf_checkpoint("tiny-qwen2"))  # 4 heads, 2 key/value heads
    arch = get_architecture(hf_config.model_type)
    check_parallel_layout(arch, hf_config, ParallelConfig(cp=2, cp_comm_type="a2a"), "actor.model.parallel.")
    with pytest.raises(UserError) as error:  # Ulysses scatters each TP rank's heads over the CP ranks
        check_parallel_layout(arch, hf_config, ParallelConfig(tp=2, cp=2, cp_comm_type="a2a"), "actor.model.parallel.")
    assert str(error.value) == (
        "actor.model.parallel.cp (with cp_comm_type=a2a)=2 does not divide num_attention_heads / tp=2, "
        "num_key_value_heads / tp=1; valid: 1"
    )


def routing_passes_cp(path: str, layout, batch: Batch, random_routing: torch.Tensor):
    """tests/routing_ranks.py's passes (live, record, replay of the record, replay of `random_routing`), the
    record handed to every rank of the replica over the whole replica (its CP ranks included)."""
    import routing_ranks

    def share(result: Batch | None, part: Batch, layout) -> dict[str, torch.Tensor]:
        from megatron.core import parallel_state as ps

        found = _replica_result(ps.get_data_parallel_rank(), result)
        return {"routed_experts": found["routed_experts"], "routing_mask": found["routing_mask"]}

    original, routing_ranks._share = routing_ranks._share, share
    try:
        return routing_ranks.routing_passes(path, layout, batch, random_routing)
    finally:
        routing_ranks._share = original


def test_routing_record_and_replay_at_cp2(ranks4, hf_checkpoint):
    """R3 at cp = 2 (also with ep = 2): each CP rank's routers get their tokens' targets, replay forces exactly the
    given experts, the recorded routing and the agreement counts are gathered to cp = 1's."""
    from routing_ranks import recorded_mask
    from test_routing_replay import _gather_rows, random_routing

    from megarl.models.hf_config import load_hf_config
    from megarl.models.registry import routing_layout

    folder = hf_checkpoint("tiny-qwen3-moe")
    batch = random_batch(4, vocab_size=1000, seed=3)
    given = random_routing(batch, routing_layout(load_hf_config(folder)))
    ref = ranks4.run(routing_passes_cp, str(folder), CP1, batch, given)
    for layout in (CP2, ParallelConfig(ep=2, cp=2)):
        results = ranks4.run(routing_passes_cp, str(folder), layout, batch, given)
        assert sum(r["map_check"]["wrong"] for r in results) == 0
        assert sum(r["map_check"]["checked"] for r in results) == sum(r["map_check"]["checked"] for r in ref)
        scored = recorded_mask(batch).bool()  # (past a row's tokens the record holds its micro-batch's padding)
        assert torch.equal(_gather_rows(results, "recorded")[scored], _gather_rows(ref, "recorded")[scored])
        for name in ("agree", "observed"):
            assert torch.equal(_gather_rows(results, name), _gather_rows(ref, name)), name
        replayed, off = _gather_rows(results, "replayed"), _gather_rows(ref, "off")
        assert (replayed - off)[batch["attention_mask"].bool()].abs().max() < 1e-5
