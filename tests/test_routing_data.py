"""Routed experts from the engine to the trainer's micro-batches: the hf engine records what the HF model chooses,
the rollout batch carries it aligned with the tokens, bad records are named (or routed live and counted), and
micro-batching keeps each sample's routing with its tokens."""

from __future__ import annotations

import pytest
import torch
from helpers import hf_routing

from megarl.data.batch import Batch
from megarl.data.prompts import PromptSample
from megarl.errors import UserError
from megarl.models.registry import routing_layout
from megarl.rollout.config import HFEngineConfig, SamplingParams
from megarl.rollout.engine import Completion, GenerateRequest
from megarl.rollout.hf_engine import HFEngine
from megarl.trainer.rollout_side.rollout_step import collate_rollout
from megarl.trainer.rollout_side.routing import RoutingPlan
from megarl.workers.schedule import ScheduleShape, split_micro_batches


@pytest.mark.parametrize("name", ["tiny-mixtral", "tiny-qwen3-moe", "tiny-deepseek-v3"])
def test_hf_engine_records_the_experts_the_hf_model_chooses(hf_checkpoint, name):
    # rounds of 3 rows: contexts of different lengths (left padding), samples sharing a prefill, a resumed prefix
    folder = hf_checkpoint(name)
    engine = HFEngine(folder, HFEngineConfig(dtype="float32", max_batch_size=3), record_routing=True)
    layout = routing_layout(engine.model.config)
    requests = [
        GenerateRequest([5, 6, 7, 8, 9], seed=1),
        GenerateRequest([11, 12], seed=2),
        GenerateRequest(
            [13, 14, 15], seed=3, prefix_ids=[40, 41], prefix_logprobs=[-1.0, -1.0], prefix_versions=[0, 0]
        ),
    ]
    outputs = engine.generate(requests, SamplingParams(n=2, temperature=1.0, max_new_tokens=6))
    for request, completions in zip(requests, outputs):
        for completion in completions:
            ids = torch.tensor([request.prompt_ids + completion.token_ids])
            assert completion.routed_experts.shape == (ids.shape[1] - 1, len(layout.moe_layers), layout.topk)
            assert completion.routed_experts.dtype == torch.uint8
            expected = hf_routing(folder, ids)
            for index, layer in enumerate(layout.moe_layers):
                got = torch.zeros_like(expected[layer][:-1]).scatter_(1, completion.routed_experts[:, index].long(), 1)
                assert torch.equal(got, expected[layer][:-1]), f"layer {layer}"
    assert (
        HFEngine(folder, HFEngineConfig(dtype="float32")).generate(requests[:1], SamplingParams())[0][0].routed_experts
        is None
    )


def _samples(n: int) -> list[PromptSample]:
    return [PromptSample(index=10 + i, text=f"p{i}", prompt_ids=[1, 2, 3], label=None) for i in range(n)]


class _Tokenizer:
    pad_token_id, eos_token_id = 0, 2

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def _completion(num_response: int, routing: torch.Tensor | None) -> Completion:
    return Completion(list(range(20, 20 + num_response)), [-0.5] * num_response, "stop", 0, routed_experts=routing)


def _routing(num_tokens: int, layout, start: int = 0) -> torch.Tensor:
    ids = (torch.arange(num_tokens - 1)[:, None, None] + start + torch.arange(layout.topk)) % layout.num_experts
    return ids.expand(-1, len(layout.moe_layers), -1).sort(dim=-1).values.to(layout.dtype)


def test_rollout_batch_carries_each_samples_routing_aligned_with_its_tokens(hf_checkpoint):
    from megarl.models.hf_config import load_hf_config

    layout = routing_layout(load_hf_config(hf_checkpoint("tiny-deepseek-v3")))
    plan = RoutingPlan(layout, "rollout", "error")
    completions = [[_completion(4, _routing(7, layout)), _completion(2, _routing(5, layout, start=3))]]
    result = collate_rollout(_samples(1), completions, _Tokenizer(), plan)
    batch = result.batch
    assert batch["routed_experts"].shape == (2, 7, len(layout.moe_layers), layout.topk)
    assert batch["routing_mask"].tolist() == [[1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0, 0]]
    assert torch.equal(batch["routed_experts"][1, :4], _routing(5, layout, start=3))
    assert result.metrics == {"rollout/routing_fallback_samples": 0.0}

    # split by data-parallel rank, concatenated back, trimmed: the routing stays with its sample
    again = Batch.concat([part.trim() for part in batch.split(2)])
    assert torch.equal(again["routed_experts"], batch["routed_experts"])


def test_invalid_routing_is_named_or_routed_live(hf_checkpoint):
    from megarl.models.hf_config import load_hf_config

    layout = routing_layout(load_hf_config(hf_checkpoint("tiny-qwen3-moe")))  # MoE layers 0, 2, 3 of 8 experts
    bad_id = _routing(7, layout)
    bad_id[2, 1, 0] = 8
    cases = [
        (None, r"\(prompt 10, completion 1\) \(row 1\): no routing was recorded"),
        (_routing(6, layout), r"routing of shape \(5, 3, 2\); expected \(6, 3, 2\)"),
        (bad_id, r"expert id 8 at position 2 of MoE layer 2, outside \[0, 8\)"),
    ]
    for routing, message in cases:
        completions = [[_completion(4, _routing(7, layout)), _completion(4, routing)]]
        with pytest.raises(UserError, match=message):
            collate_rollout(_samples(1), completions, _Tokenizer(), RoutingPlan(layout, "rollout", "error"))
        result = collate_rollout(_samples(1), completions, _Tokenizer(), RoutingPlan(layout, "rollout", "live"))
        assert result.metrics == {"rollout/routing_fallback_samples": 1.0}
        assert result.batch["routing_mask"][1].sum() == 0 and result.batch["routing_mask"][0].sum() == 6


def test_micro_batches_keep_routing_with_tokens_and_padding_rows_replay_nothing(hf_checkpoint):
    from megarl.models.hf_config import load_hf_config

    layout = routing_layout(load_hf_config(hf_checkpoint("tiny-qwen3-moe")))
    completions = [[_completion(n, _routing(3 + n, layout, start=n)) for n in (5, 1, 3)]]
    batch = collate_rollout(_samples(1), completions, _Tokenizer(), RoutingPlan(layout, "rollout", "error")).batch
    for shape in (ScheduleShape(), ScheduleShape(fixed_shape=True, multiple_of=2)):
        micro_batches = split_micro_batches(batch, max_tokens=12, shape=shape)
        for micro in micro_batches:
            routed, mask = micro.tensors["routed_experts"], micro.tensors["routing_mask"]
            assert routed.shape[:2] == mask.shape == micro.tensors["input_ids"].shape
            for k, row in enumerate(micro.rows):
                width = routed.shape[1]
                assert torch.equal(routed[k], batch["routed_experts"][row, :width])
                assert torch.equal(mask[k], batch["routing_mask"][row, :width])
            assert mask[len(micro.rows) :].sum() == 0  # padding rows and fillers replay nothing
        assert sorted(r for m in micro_batches for r in m.rows) == [0, 1, 2]


def test_agreement_metrics_and_the_stop_threshold():
    from megarl.trainer.rollout_side.routing import agreement_metrics, check_agreement

    agree = torch.tensor([[3, 4], [1, 0]])  # per sample and MoE layer: tokens whose top-k set matched
    observed = torch.tensor([[4, 4], [2, 0]])  # tokens compared
    metrics = agreement_metrics(agree, observed)
    assert metrics == {"rollout/routing_agreement": 0.8, "rollout/routing_agreement_min_layer": pytest.approx(4 / 6)}
    check_agreement(metrics, RoutingPlan(None, "rollout", "error", min_agreement=0.8))
    with pytest.raises(UserError, match=r"rollout/routing_agreement=0\.8000 is below algorithm\.min_routing_agree"):
        check_agreement(metrics, RoutingPlan(None, "rollout", "error", min_agreement=0.9))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["algorithm.routing_replay=r3"], r"algorithm\.routing_replay='r3': valid are off, rollout, old_logprob"),
        (["algorithm.routing_invalid=skip"], r"algorithm\.routing_invalid='skip': valid are error, live"),
        (["algorithm.min_routing_agreement=1.5"], r"algorithm\.min_routing_agreement=1\.5 must be in \[0, 1\]"),
        (["rollout.routed_experts=off"], r"algorithm\.routing_replay=rollout replays .* rollout\.routed_experts=off"),
    ],
)
def test_routing_settings_are_checked_with_the_config(overrides, message):
    from pathlib import Path

    from megarl.config import load_config
    from megarl.job import JobConfig

    with pytest.raises(UserError, match=message):
        load_config(JobConfig, Path(__file__).parents[1] / "configs/quickstart_moe.yaml", overrides)
