"""Collation: token lists to a right-padded Batch with per-token values in their tokens' columns, and back."""

from __future__ import annotations

import pytest
import torch

from megarl.data import Batch, make_rl_batch, prompt_tokens, response_tokens, response_values

PAD = 0


def hand_built_example() -> Batch:
    return make_rl_batch(
        prompt_ids=[[11, 12, 13], [21], [31, 32]],
        response_ids=[[14, 15], [22, 23, 24, 25], []],
        pad_id=PAD,
        rollout_logprobs=[[-0.5, -0.25], [-1.0, -2.0, -3.0, -4.0], []],
        token_versions=[torch.tensor([3, 4]), torch.tensor([5, 5, 6, 6]), torch.tensor([], dtype=torch.long)],
        meta={"uid": ["a", "b", "c"]},
    )


def test_collation_matches_the_hand_built_layout_element_by_element():
    batch = hand_built_example()
    # columns:        0   1   2   3   4
    input_ids = [
        [11, 12, 13, 14, 15],
        [21, 22, 23, 24, 25],
        [31, 32, PAD, PAD, PAD],
    ]
    attention_mask = [[1, 1, 1, 1, 1], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    response_mask = [[0, 0, 0, 1, 1], [0, 1, 1, 1, 1], [0, 0, 0, 0, 0]]
    # log-prob of response token j sits in column len(prompt) + j; column 0, prompt and padding hold 0
    rollout_logprobs = [[0, 0, 0, -0.5, -0.25], [0, -1.0, -2.0, -3.0, -4.0], [0, 0, 0, 0, 0]]
    token_versions = [[0, 0, 0, 3, 4], [0, 5, 5, 6, 6], [0, 0, 0, 0, 0]]
    expected = {
        "input_ids": (input_ids, torch.long),
        "attention_mask": (attention_mask, torch.long),
        "response_mask": (response_mask, torch.long),
        "rollout_logprobs": (rollout_logprobs, torch.float32),
        "token_versions": (token_versions, torch.long),  # tensors keep their dtype
    }
    assert set(batch.tensors) == set(expected)
    for name, (values, dtype) in expected.items():
        tensor = batch[name]
        assert tensor.dtype == dtype, name
        assert tensor.shape == (3, 5), name
        for i in range(3):
            for t in range(5):
                assert tensor[i, t].item() == values[i][t], (name, i, t)
    assert batch.meta == {"uid": ["a", "b", "c"]}
    assert batch.lengths.tolist() == [5, 5, 2]


def test_inverse_gives_back_the_token_lists_and_values():
    batch = hand_built_example()
    assert [prompt_tokens(batch, i) for i in range(3)] == [[11, 12, 13], [21], [31, 32]]
    assert [response_tokens(batch, i) for i in range(3)] == [[14, 15], [22, 23, 24, 25], []]
    assert response_values(batch, "rollout_logprobs", 1).tolist() == [-1.0, -2.0, -3.0, -4.0]
    # still right after a round trip through the Batch operations the workers use
    merged = Batch.concat(batch.split(2))
    assert [response_tokens(merged, i) for i in range(3)] == [[14, 15], [22, 23, 24, 25], []]
    trimmed = batch.select([2]).trim()
    assert trimmed["input_ids"].tolist() == [[31, 32]]


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="2 prompts but 1 responses"):
        make_rl_batch([[1], [2]], [[3]], PAD)
    with pytest.raises(ValueError, match="at least one prompt token"):
        make_rl_batch([[]], [[3]], PAD)
    with pytest.raises(ValueError, match=r"rollout_logprobs\[0\] has shape \(1,\); expected one value per response"):
        make_rl_batch([[1]], [[3, 4]], PAD, rollout_logprobs=[[-1.0]])
    with pytest.raises(ValueError, match="may not be named"):
        make_rl_batch([[1]], [[3]], PAD, response_mask=[[1.0]])
