"""Routing replay (R3) in the Megatron roles: the replayed experts are the given ones at every TP/PP/EP layout
(DeepSeek's dense first layer and Qwen3-MoE's dense layer included), a record pass gives back the HF model's own
routing, replaying it changes nothing, and the router still gets gradients under replay."""

from __future__ import annotations

import pytest
import torch
from helpers import hf_routing, layout_id
from routing_ranks import recorded_mask, replay_gradients, routing_passes, trainer_logprobs_against_engine
from worker_ranks import random_batch

from megarl.models.hf_config import load_hf_config
from megarl.models.registry import routing_layout
from megarl.runtime.parallel import ParallelConfig as P

ARCHITECTURES = ["tiny-mixtral", "tiny-qwen3-moe", "tiny-deepseek-v3"]
# Sequence parallelism needs Transformer Engine's norms (Megatron's local spec refuses it): GPU only.
LAYOUTS = [P(), P(tp=2), P(pp=2, ep=2), P(tp=2, pp=2, ep=2, etp=1)]


def random_routing(batch, layout, seed: int = 0) -> torch.Tensor:
    """Distinct random experts for every token and MoE layer [B, S, L, k] (what an engine might have chosen)."""
    g = torch.Generator().manual_seed(seed)
    rows, width = batch["input_ids"].shape
    scores = torch.rand(rows, width, len(layout.moe_layers), layout.num_experts, generator=g)
    return scores.topk(layout.topk, dim=-1).indices.sort(dim=-1).values.to(layout.dtype)


def _gather_rows(results, name: str) -> torch.Tensor:
    parts = sorted((r["dp_rank"], r[name]) for r in results if "dp_rank" in r)
    return torch.cat([p for _, p in parts])


@pytest.mark.parametrize(
    "name, layout",
    [pytest.param(n, layout, id=f"{n}-{layout_id(layout)}") for n in ARCHITECTURES for layout in LAYOUTS]
    # GLM-4.5: DeepSeek-V3's router behind grouped-query attention, at one layout
    + [pytest.param("tiny-glm4-moe", P(pp=2, ep=2), id="tiny-glm4-moe-tp1-pp2-ep2")]
    # gpt-oss: a router with a bias, softmax over the top-k logits
    + [pytest.param("tiny-gpt-oss", P(pp=2, ep=2), id="tiny-gpt-oss-tp1-pp2-ep2")]
    + [pytest.param("tiny-qwen3-next", P(tp=2, ep=2), id="tiny-qwen3-next-tp2-pp1-ep2")],  # shared expert, GDN
)
def test_replay_forces_the_given_experts_and_record_gives_the_hf_routing(ranks4, hf_checkpoint, name, layout):
    folder = hf_checkpoint(name)
    routing = routing_layout(load_hf_config(folder))
    batch = random_batch(4, vocab_size=1000, seed=3)
    given = random_routing(batch, routing)
    results = ranks4.run(routing_passes, str(folder), layout, batch, given)

    # every replayed token went to exactly the given experts, on every rank and MoE layer
    checked = sum(r["map_check"]["checked"] for r in results)
    wrong = sum(r["map_check"]["wrong"] for r in results)
    assert wrong == 0 and checked > 0

    # the record pass gives the HF model's routing of every scored token, layer by layer
    recorded = _gather_rows(results, "recorded")
    hf = hf_routing(folder, batch["input_ids"])
    scored = recorded_mask(batch).bool()
    assert sorted(hf) == list(routing.moe_layers)
    for index, layer in enumerate(routing.moe_layers):
        want = hf[layer].view(*batch["input_ids"].shape, -1)[scored]
        got = torch.zeros_like(want).scatter_(1, recorded[..., index, :].long()[scored], True)
        assert (want != got).any(dim=1).sum().item() == 0, f"layer {layer}"

    # replaying the recorded routing changes no log-prob, and the live routing agrees with it everywhere
    assert torch.equal(_gather_rows(results, "replayed"), _gather_rows(results, "off"))
    agree, observed = _gather_rows(results, "agree"), _gather_rows(results, "observed")
    assert torch.equal(agree, observed)
    assert observed.sum(dim=1).tolist() == (scored.sum(dim=1) * len(routing.moe_layers)).tolist()


@pytest.mark.parametrize("layout", [P(), P(pp=2, ep=2)], ids=layout_id)
def test_router_learns_under_replay(ranks4, hf_checkpoint, layout):
    folder = hf_checkpoint("tiny-deepseek-v3")
    routing = routing_layout(load_hf_config(folder))
    batch = random_batch(4, vocab_size=1000, seed=5)
    batch = batch.with_tensors(routed_experts=random_routing(batch, routing), routing_mask=recorded_mask(batch))
    weights = batch["response_mask"] / batch["response_mask"].sum()
    results = ranks4.run(replay_gradients, str(folder), layout, batch, weights)
    metrics = [m for m, _ in results]
    assert all(m["routing_replayed"] == 1.0 for m in metrics)
    router_grads = [g for _, g in results if g is not None]
    assert router_grads and all(g > 0 for g in router_grads)


class _NoTextTokenizer:
    pad_token_id, eos_token_id = 0, 2

    def decode(self, ids, skip_special_tokens=True):
        return ""


@pytest.mark.parametrize("name", ["tiny-qwen3-moe", "tiny-deepseek-v3"])
def test_replay_brings_bf16_trainer_logprobs_closer_to_the_engines(ranks4, hf_checkpoint, name):
    # bf16 rollout (the hf engine) and bf16 trainer (Megatron) round differently: some near-tied router choices
    # flip. Replaying the engine's choice removes that part of the mismatch.
    from megarl.data.prompts import PromptSample
    from megarl.rollout.config import HFEngineConfig, SamplingParams
    from megarl.rollout.engine import GenerateRequest
    from megarl.rollout.hf_engine import HFEngine
    from megarl.trainer.rollout_side.rollout_step import collate_rollout
    from megarl.trainer.rollout_side.routing import RoutingPlan

    folder = hf_checkpoint(name, torch.bfloat16)
    engine = HFEngine(folder, HFEngineConfig(dtype="bfloat16"), record_routing=True)
    g = torch.Generator().manual_seed(0)
    samples = [PromptSample(i, "", torch.randint(3, 900, (12,), generator=g).tolist(), None) for i in range(8)]
    requests = [GenerateRequest(s.prompt_ids, seed=i) for i, s in enumerate(samples)]
    completions = engine.generate(requests, SamplingParams(n=2, temperature=1.0, max_new_tokens=24))
    plan = RoutingPlan(routing_layout(engine.model.config), "rollout", "error")
    batch = collate_rollout(samples, completions, _NoTextTokenizer(), plan).batch

    results = sorted(r for r in ranks4.run(trainer_logprobs_against_engine, str(folder), P(), batch) if r)
    live, replayed = torch.cat([r[1] for r in results]), torch.cat([r[2] for r in results])
    agreement = sum(r[3].sum() for r in results) / sum(r[4].sum() for r in results)
    response = batch["response_mask"].bool()
    live_gap = (live - batch["rollout_logprobs"])[response].abs().mean()
    replayed_gap = (replayed - batch["rollout_logprobs"])[response].abs().mean()
    assert 0.95 < agreement < 1.0, "the engine and the trainer should disagree on a few routings"
    assert replayed_gap < 0.95 * live_gap


@pytest.mark.parametrize("layout", [P(), P(pp=2, ep=2)], ids=layout_id)
def test_backward_recompute_replays_the_same_experts(ranks4, hf_checkpoint, layout):
    # activation recomputation runs each layer's forward again inside backward; with several micro-batches in flight
    # (1F1B) each router must take that micro-batch's targets again, or the gradients change
    folder = hf_checkpoint("tiny-qwen3-moe")
    routing = routing_layout(load_hf_config(folder))
    batch = random_batch(8, vocab_size=1000, seed=7)
    batch = batch.with_tensors(routed_experts=random_routing(batch, routing), routing_mask=recorded_mask(batch))
    weights = batch["response_mask"] / batch["response_mask"].sum()
    plain = ranks4.run(replay_gradients, str(folder), layout, batch, weights, 48)
    recomputed = ranks4.run(replay_gradients, str(folder), layout, batch, weights, 48, True)
    for (a, grad_a), (b, grad_b) in zip(plain, recomputed):
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-6) and a["loss"] == pytest.approx(b["loss"])
        assert grad_a == pytest.approx(grad_b, rel=1e-6)
