"""SFT examples and preference pairs: rendering prompt + response, the response mask, length filtering, batches."""

from __future__ import annotations

import json

import pytest

from megarl.data import PairDataConfig, PairDataset, SFTDataConfig, SFTDataset, prompt_tokens, response_tokens
from megarl.data.char_tokenizer import build_char_tokenizer
from megarl.errors import UserError

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def chat_tok():
    tok = build_char_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    return tok


def ids(tok, text: str) -> list[int]:
    return [tok.convert_tokens_to_ids(c) for c in text]


def write_rows(tmp_path, rows) -> str:
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_plain_sft_ends_responses_with_eos_and_masks_only_the_response(tmp_path, tok):
    rows = [{"prompt": "Q: 1+1", "response": " 2"}, {"prompt": "Q: 2+3", "response": " 5</s>"}]
    config = SFTDataConfig(train_files=[write_rows(tmp_path, rows)], template="{prompt}\nA:")
    data = SFTDataset(config, tok)
    assert data[0].prompt_ids == ids(tok, "Q: 1+1\nA:")
    assert data[0].response_ids == [*ids(tok, " 2"), tok.eos_token_id]
    assert data[1].response_ids == [*ids(tok, " 5"), tok.eos_token_id]  # EOS not added twice

    batch = data.collate([data[1], data[0]])
    assert batch.meta["index"] == [1, 0]
    assert response_tokens(batch, 1) == data[0].response_ids
    assert prompt_tokens(batch, 1) == data[0].prompt_ids
    assert batch["response_mask"][1].tolist() == [0] * 9 + [1] * 3
    assert batch["input_ids"][1].tolist() == data[0].prompt_ids + data[0].response_ids


def test_chat_sft_splits_the_rendered_conversation_at_the_assistant_turn(tmp_path, chat_tok):
    rows = [{"prompt": "hi", "response": "hello"}]
    config = SFTDataConfig(train_files=[write_rows(tmp_path, rows)], apply_chat_template=True)
    example = SFTDataset(config, chat_tok)[0]
    assert example.prompt_ids == [chat_tok.bos_token_id, *ids(chat_tok, "<|user|>hi\n<|assistant|>")]
    # the template closes the turn (EOS, newline); no EOS is appended after it
    assert example.response_ids == [*ids(chat_tok, "hello"), chat_tok.eos_token_id, *ids(chat_tok, "\n")]


def test_chat_template_that_rewrites_the_prompt_is_a_row_error(tmp_path):
    tok = build_char_tokenizer()
    tok.chat_template = "{{ messages[-1]['content'] }}"  # renders only the last turn
    config = SFTDataConfig(train_files=[write_rows(tmp_path, [{"prompt": "hi", "response": "yo"}])])
    config.apply_chat_template = True
    with pytest.raises(UserError, match="d.jsonl:1: the chat template renders the conversation with a different"):
        SFTDataset(config, tok)


def test_sft_length_filter_and_missing_response(tmp_path, tok):
    rows = [
        {"prompt": "abc", "response": "de"},
        {"prompt": "abc", "response": "defgh"},
        {"prompt": "a", "response": "b"},
    ]
    data = SFTDataset(SFTDataConfig(train_files=[write_rows(tmp_path, rows)], max_tokens=6), tok)
    assert [len(e.prompt_ids) + len(e.response_ids) for e in data] == [6, 3]  # responses end with EOS
    assert (data.num_rows, data.num_too_long) == (3, 1)
    bad = [{"prompt": "a", "response": ""}, {"prompt": "a"}]
    with pytest.raises(UserError) as error:
        SFTDataset(SFTDataConfig(train_files=[write_rows(tmp_path, bad)]), tok)
    assert "d.jsonl:1: 'response' is empty text; expected non-empty text" in str(error.value)
    assert "d.jsonl:2: no key 'response'" in str(error.value)


def test_pairs_interleave_chosen_and_rejected_with_group_ids(tmp_path, tok):
    rows = [
        {"prompt": "p0", "chosen": "good", "rejected": "bad"},
        {"prompt": "p1", "chosen": "yes", "rejected": "no!!!!!!!!!!!"},  # too long on the rejected side
        {"prompt": "p2", "chosen": "fine", "rejected": "meh"},
    ]
    data = PairDataset(PairDataConfig(train_files=[write_rows(tmp_path, rows)], max_tokens=8), tok)
    assert (len(data), data.num_too_long) == (2, 1)
    batch = data.collate(list(data))
    assert batch["group_ids"].tolist() == [0, 0, 1, 1]
    assert batch["is_chosen"].tolist() == [1, 0, 1, 0]
    eos = tok.eos_token_id
    assert [response_tokens(batch, i) for i in range(4)] == [
        [*ids(tok, text), eos] for text in ("good", "bad", "fine", "meh")
    ]
    assert [prompt_tokens(batch, i) for i in range(4)] == [ids(tok, p) for p in ("p0", "p0", "p2", "p2")]
    assert batch.meta["source"] == [f"{tmp_path / 'd.jsonl'}:{line}" for line in (1, 1, 3, 3)]


def test_pair_sampler_resumes_like_the_prompt_sampler(tmp_path, tok):
    rows = [{"prompt": f"p{i}", "chosen": "a", "rejected": "b"} for i in range(7)]
    data = PairDataset(PairDataConfig(train_files=[write_rows(tmp_path, rows)], seed=5), tok)
    full = data.sampler(batch_size=2)
    expected = [[pair.index for pair in next(full)] for _ in range(8)]
    partial = data.sampler(batch_size=2)
    for _ in range(4):
        next(partial)
    resumed = data.sampler(batch_size=2)
    resumed.load_state_dict(partial.state_dict())
    assert [[pair.index for pair in next(resumed)] for _ in range(4)] == expected[4:]
