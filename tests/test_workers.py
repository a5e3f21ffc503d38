"""Role compute on Megatron-Core (actor, ref, critic, reward model) at several parallel layouts, on gloo ranks.

The single-process references: transformers' own forward (log-probs), and the same role at TP=PP=1 (updates).
"""

from __future__ import annotations

import pytest
import torch
from helpers import layout_id
from worker_ranks import (
    critic_update,
    critic_values,
    one_update,
    optimizer_state,
    poisoned_updates,
    policy_logprobs,
    random_batch,
    resume_and_train,
    reward_model_step,
    train_and_save,
)

from megarl.algorithms.aggregation import loss_weights
from megarl.data.batch import Batch
from megarl.runtime.parallel import ParallelConfig
from megarl.workers.schedule import split_micro_batches

DENSE_LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 2, 1), (1, 2, 2), (2, 2, 2)]
MOE_LAYOUTS = [ParallelConfig(ep=2), ParallelConfig(tp=2, ep=2), ParallelConfig(pp=2, ep=2)]


def hf_token_logprobs(folder, batch: Batch, temperature: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """log p(token t | < t), the entropy and sum_v p_v^2 of each prediction, from transformers, aligned like
    megarl's."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        logp = torch.log_softmax(model(batch["input_ids"]).logits / temperature, dim=-1)
    token = logp[:, :-1].gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)[:, :-1]
    sum_pi_squared = logp.exp().square().sum(-1)[:, :-1]
    pad = torch.nn.functional.pad
    return pad(token, (1, 0)), pad(entropy, (1, 0)), pad(sum_pi_squared, (1, 0))


def collect(results) -> Batch | torch.Tensor:
    """Results of the DP leaders, in DP order, concatenated."""
    parts = sorted((r for r in results if r is not None), key=lambda r: r[0])
    values = [p[1] for p in parts]
    return Batch.concat(values) if isinstance(values[0], Batch) else torch.cat(values)


def real_positions(batch: Batch) -> torch.Tensor:
    mask = batch["attention_mask"].bool().clone()
    mask[:, 0] = False  # no prediction for the first token
    return mask


@pytest.mark.parametrize(
    "name,layout",
    [("tiny-qwen3", layout) for layout in DENSE_LAYOUTS] + [("tiny-qwen3-moe", layout) for layout in MOE_LAYOUTS],
    ids=lambda v: layout_id(v) if not isinstance(v, str) else v,
)
def test_logprobs_and_entropy_match_transformers(ranks4, hf_checkpoint, name, layout):
    folder = hf_checkpoint(name)
    batch = random_batch(6, vocab_size=1000, seed=1)
    ref_logprobs, ref_entropy, ref_sum_pi_squared = hf_token_logprobs(folder, batch, temperature=0.7)
    out = collect(ranks4.run(policy_logprobs, str(folder), layout, batch, 0.7, 64))
    where = real_positions(batch)
    assert (out["logprobs"] - ref_logprobs)[where].abs().max() < 1e-5
    assert (out["entropy"] - ref_entropy)[where].abs().max() < 1e-5
    assert (out["sum_pi_squared"] - ref_sum_pi_squared)[where].abs().max() < 1e-6  # optimal_token_baseline's input


@pytest.fixture(scope="module")
def update_reference(ranks4, hf_checkpoint):
    """Two PPO steps at TP=PP=1 (four data-parallel ranks): the weights every other layout must reach."""
    folder = str(hf_checkpoint("tiny-qwen3"))
    batch = random_batch(8, vocab_size=1000, seed=2)
    weights = loss_weights("token-mean", batch["response_mask"])
    history, sent = _run_update(ranks4, folder, (1, 1, 1), batch, weights)
    return folder, batch, weights, history, sent


def _run_update(pool, folder, layout, batch, weights):
    results = pool.run(one_update, folder, layout, batch, weights, 64, 2)
    history = results[0][0]
    sent = {name: tensor for _, rank_sent in results for name, tensor in rank_sent}
    return history, sent


@pytest.mark.parametrize("layout", [(2, 1, 1), (1, 2, 1), (2, 2, 1), (1, 2, 2), (2, 2, 2)], ids=layout_id)
def test_update_gives_the_same_weights_at_every_layout(ranks4, update_reference, layout):
    folder, batch, weights, ref_history, ref_sent = update_reference
    history, sent = _run_update(ranks4, folder, layout, batch, weights)
    assert sent.keys() == ref_sent.keys()
    worst = max((sent[name] - ref_sent[name]).abs().max().item() for name in ref_sent)
    assert worst < 1e-5, f"largest weight difference {worst:.2e}"
    for mine, ref in zip(history, ref_history):
        assert mine["loss"] == pytest.approx(ref["loss"], abs=1e-6)
        assert mine["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
    assert not any(h["skipped"] for h in history)


@pytest.mark.parametrize("layout", [(2, 1, 1), (1, 2, 1)], ids=layout_id)
def test_a_non_finite_gradient_on_one_rank_skips_the_step_on_every_rank(ranks4, hf_checkpoint, layout):
    """One NaN in one gradient of one rank: every rank of the role skips that step (weights untouched) and steps
    normally afterwards; two in a row with max_consecutive_skips=2 stop with the parameter's name."""
    folder = str(hf_checkpoint("tiny-qwen3"))
    batch = random_batch(8, vocab_size=1000, seed=2)
    weights = loss_weights("token-mean", batch["response_mask"])
    results = ranks4.run(poisoned_updates, folder, layout, batch, weights, [1], 3)
    for history, error in results:
        assert history == [(False, True), (True, False), (False, True)] and error == ""
    results = ranks4.run(poisoned_updates, folder, layout, batch, weights, [1, 2], 2)
    for rank, (history, error) in enumerate(results):
        assert history == [(False, True), (True, False)]
        assert "2 optimizer steps in a row had a non-finite gradient norm (the last: optimizer step 3" in error
        assert "(optim.max_consecutive_skips=2)" in error
        if rank == 1:
            assert "first non-finite gradient: module." in error
        else:
            assert "this rank's gradients are finite" in error


def test_update_moves_the_weights(update_reference, hf_checkpoint):
    from megarl.bridge.safetensors_io import HFCheckpoint

    folder, _, _, history, sent = update_reference
    original = HFCheckpoint(folder)
    moved = max((sent[name] - original.get(name)).abs().max().item() for name in sent)
    assert moved > 1e-4
    assert history[1]["loss"] < history[0]["loss"]  # the same batch twice: the surrogate improves


@pytest.mark.parametrize("layout", [(2, 1, 1), (1, 2, 1)], ids=layout_id)
def test_critic_values_and_update_are_layout_independent(ranks4, hf_checkpoint, layout):
    folder = str(hf_checkpoint("tiny-qwen3"))
    batch = random_batch(6, vocab_size=1000, seed=3)
    ref = collect(ranks4.run(critic_values, folder, (1, 1, 1), batch))
    values = collect(ranks4.run(critic_values, folder, layout, batch))
    where = real_positions(batch)
    assert (values - ref)[where].abs().max() < 1e-5
    assert values[:, 0].abs().max() == 0  # no estimate before the first token
    weights = loss_weights("token-mean", batch["response_mask"])
    ref_metrics, ref_head = _first_head(ranks4.run(critic_update, folder, (1, 1, 1), batch, weights))
    metrics, head = _first_head(ranks4.run(critic_update, folder, layout, batch, weights))
    assert metrics["loss"] == pytest.approx(ref_metrics["loss"], rel=1e-5)
    assert (head - ref_head).abs().max() < 1e-5


def _first_head(results):
    metrics = results[0][0]
    heads = [head for _, head in results if head is not None]
    assert all(torch.equal(h, heads[0]) for h in heads), "the value head must stay identical on every rank"
    return metrics, heads[0]


def test_reward_model_learns_a_preference_and_keeps_pairs_together(ranks4, hf_checkpoint):
    folder = str(hf_checkpoint("tiny-qwen3"))
    batch = random_batch(8, vocab_size=1000, seed=4)
    pair_weights = torch.tensor([0.25, 0.0] * 4)
    results = [r for r in ranks4.run(reward_model_step, folder, (2, 1, 1), batch, pair_weights, 40) if r]
    results.sort(key=lambda r: r[0])
    before = torch.cat([r[1] for r in results])
    after = torch.cat([r[2] for r in results])
    margin_before = (before[0::2] - before[1::2]).mean()
    margin_after = (after[0::2] - after[1::2]).mean()
    assert margin_after > margin_before
    assert 0 <= results[0][3]["accuracy"] <= 1


@pytest.mark.parametrize("resumed_at", [(1, 2, 1), ParallelConfig(pp=2, pp_first_stage_layers=1)], ids=layout_id)
def test_checkpoint_saved_at_tp2_resumes_at_pp2(ranks4, ranks1, hf_checkpoint, tmp_path, resumed_at):
    """Resumed at another layout (even or uneven pipeline stages), the run continues with the same numbers."""
    folder = str(hf_checkpoint("tiny-qwen3"))
    batch = random_batch(8, vocab_size=1000, seed=5)
    weights = loss_weights("token-mean", batch["response_mask"])
    saved, resaved = tmp_path / "step1", tmp_path / "step1-again"
    # uninterrupted: three steps at TP=2
    straight, helpers = ranks4.run(train_and_save, folder, (2, 1, 1), batch, weights, str(tmp_path / "straight"), 3)[0]
    # a save leaves no helper process behind (Megatron's writer would start a multiprocessing Manager, seconds each)
    assert helpers == []
    # interrupted after two steps, resumed at PP=2 (and saved again there)
    first, _ = ranks4.run(train_and_save, folder, (2, 1, 1), batch, weights, str(saved), 2)[0]
    loss, _, num_steps = ranks4.run(resume_and_train, folder, resumed_at, batch, weights, str(saved), str(resaved))[0]
    assert first == pytest.approx(straight[:2], abs=1e-7)
    assert loss == pytest.approx(straight[2], abs=1e-6)
    assert num_steps == 3
    # what TP=2 saved and what PP=2 saved again hold the same parameters and Adam states
    (state_a, steps_a), (state_b, steps_b) = (
        ranks1.run(optimizer_state, folder, str(saved))[0],
        ranks1.run(optimizer_state, folder, str(resaved))[0],
    )
    assert steps_a == steps_b == 2 and state_a.keys() == state_b.keys()
    for name, (param, avg, avg_sq) in state_a.items():
        other = state_b[name]
        assert torch.equal(param, other[0]) and torch.equal(avg, other[1]) and torch.equal(avg_sq, other[2]), name


@pytest.mark.parametrize("layout", [ParallelConfig(ep=2), ParallelConfig(pp=2, ep=2)], ids=layout_id)
def test_moe_update_gives_the_same_weights_with_expert_parallelism(ranks4, hf_checkpoint, layout):
    folder = str(hf_checkpoint("tiny-qwen3-moe"))
    batch = random_batch(8, vocab_size=1000, seed=6)
    weights = loss_weights("token-mean", batch["response_mask"])
    ref_history, ref_sent = _run_update(ranks4, folder, (1, 1, 1), batch, weights)
    history, sent = _run_update(ranks4, folder, layout, batch, weights)
    assert sent.keys() == ref_sent.keys()
    worst = max((sent[name] - ref_sent[name]).abs().max().item() for name in ref_sent)
    assert worst < 1e-5, f"largest weight difference {worst:.2e}"
    assert history[-1]["loss"] == pytest.approx(ref_history[-1]["loss"], abs=1e-6)


# ---- packing: the same numbers as padded rows (the tests above run packed, the product default) ----------------


@pytest.mark.parametrize(
    ("name", "layout"),
    [
        ("tiny-qwen3", (1, 1, 1)),
        ("tiny-qwen3", (2, 2, 1)),
        ("tiny-qwen3", (1, 2, 2)),
        ("tiny-qwen3-moe", MOE_LAYOUTS[2]),
        ("tiny-deepseek-v3", ParallelConfig(ep=2)),  # MLA, YaRN, group-limited routing
        ("tiny-qwen3-next", MOE_LAYOUTS[2]),  # Gated DeltaNet: no state crosses packed samples
    ],
    ids=lambda v: v if isinstance(v, str) else layout_id(v),
)
def test_packed_logprobs_and_updates_equal_padded_ones(ranks4, hf_checkpoint, name, layout):
    folder = str(hf_checkpoint(name))
    batch = random_batch(8, vocab_size=1000, seed=7)
    packed = collect(ranks4.run(policy_logprobs, folder, layout, batch, 1.0, 64, True))
    padded = collect(ranks4.run(policy_logprobs, folder, layout, batch, 1.0, 64, False))
    where = real_positions(batch)
    assert (packed["logprobs"] - padded["logprobs"])[where].abs().max() < 1e-5
    assert (packed["entropy"] - padded["entropy"])[where].abs().max() < 1e-5
    assert packed["logprobs"][~where].abs().max() == 0  # first tokens and padding: 0, as padded rows give
    weights = loss_weights("token-mean", batch["response_mask"])
    history, sent = (ranks4.run(one_update, folder, layout, batch, weights, 64, 2, p) for p in (True, False))
    sent_packed = {n: t for _, rank_sent in history for n, t in rank_sent}
    sent_padded = {n: t for _, rank_sent in sent for n, t in rank_sent}
    worst = max((sent_packed[n] - sent_padded[n]).abs().max().item() for n in sent_padded)
    assert worst < 1e-5, f"largest weight difference {worst:.2e}"
    for mine, ref in zip(history[0][0], sent[0][0]):
        assert mine["loss"] == pytest.approx(ref["loss"], abs=1e-6)
        assert mine["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)


@pytest.mark.parametrize(
    ("name", "layout"),
    [
        ("tiny-qwen3", (1, 1, 1)),
        ("tiny-qwen3", (2, 1, 1)),
        ("tiny-qwen3-moe", (1, 1, 1)),
        ("tiny-qwen3-next", (1, 1, 1)),  # the GDN reads the root's prompt tokens as its own
    ],
    ids=lambda v: v if isinstance(v, str) else layout_id(v),
)
def test_shared_prompts_give_the_numbers_of_padded_rows(ranks4, hf_checkpoint, name, layout):
    """GRPO's groups (4 samples per prompt): packed rows lay each prompt once (megarl/data/packing.py); log-probs,
    entropies, the loss, the gradient norm and the weights after two updates are those of padded rows."""
    folder = str(hf_checkpoint(name))
    batch = random_batch(16, vocab_size=1000, seed=11, samples_per_prompt=4)
    micro_batches = split_micro_batches(batch, 64, packing=True, share_prompts=True)
    assert any(mb.shared and sum(mb.shared) > 0 for mb in micro_batches)  # the batch does share
    packed = collect(ranks4.run(policy_logprobs, folder, layout, batch, 1.0, 64, True))
    padded = collect(ranks4.run(policy_logprobs, folder, layout, batch, 1.0, 64, False))
    where = real_positions(batch)
    assert (packed["logprobs"] - padded["logprobs"])[where].abs().max() < 1e-5
    assert (packed["entropy"] - padded["entropy"])[where].abs().max() < 1e-5
    assert packed["logprobs"][~where].abs().max() == 0
    weights = loss_weights("token-mean", batch["response_mask"])
    history, sent = (ranks4.run(one_update, folder, layout, batch, weights, 64, 2, p) for p in (True, False))
    sent_packed = {n: t for _, rank_sent in history for n, t in rank_sent}
    sent_padded = {n: t for _, rank_sent in sent for n, t in rank_sent}
    worst = max((sent_packed[n] - sent_padded[n]).abs().max().item() for n in sent_padded)
    assert worst < 1e-5, f"largest weight difference {worst:.2e}"
    for mine, ref in zip(history[0][0], sent[0][0]):
        assert mine["loss"] == pytest.approx(ref["loss"], abs=1e-6)
        assert mine["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)


@pytest.mark.parametrize("samples_per_prompt", [1, 3], ids=["own-prompts", "shared-prompts"])
def test_packed_critic_equals_padded(ranks4, hf_checkpoint, samples_per_prompt):
    folder = str(hf_checkpoint("tiny-qwen3"))
    batch = random_batch(6, vocab_size=1000, seed=8, samples_per_prompt=samples_per_prompt)
    packed = collect(ranks4.run(critic_values, folder, (1, 2, 1), batch, 64, True))
    padded = collect(ranks4.run(critic_values, folder, (1, 2, 1), batch, 64, False))
    assert (packed - padded)[batch["attention_mask"].bool()].abs().max() < 1e-5
    weights = loss_weights("token-mean", batch["response_mask"])
    packed_metrics, packed_head = _first_head(ranks4.run(critic_update, folder, (2, 1, 1), batch, weights, 64, True))
    metrics, head = _first_head(ranks4.run(critic_update, folder, (2, 1, 1), batch, weights, 64, False))
    assert packed_metrics["loss"] == pytest.approx(metrics["loss"], rel=1e-5)
    assert (packed_head - head).abs().max() < 1e-5


def test_packed_reward_model_equals_padded(ranks4, hf_checkpoint):
    folder = str(hf_checkpoint("tiny-qwen3"))
    batch = random_batch(8, vocab_size=1000, seed=9)
    pair_weights = torch.tensor([0.25, 0.0] * 4)
    packed, padded = (
        sorted(
            (r for r in ranks4.run(reward_model_step, folder, (1, 2, 1), batch, pair_weights, 40, p) if r),
            key=lambda r: r[0],
        )
        for p in (True, False)
    )
    for index in (1, 2):  # scores before and after one Bradley-Terry step, pairs kept together
        mine, ref = torch.cat([r[index] for r in packed]), torch.cat([r[index] for r in padded])
        assert (mine - ref).abs().max() < 1e-5
    assert packed[0][3]["loss"] == pytest.approx(padded[0][3]["loss"], abs=1e-6)
    assert packed[0][3]["accuracy"] == padded[0][3]["accuracy"]
