"""Prompt datasets: template and chat-template rendering, tokenization without doubled BOS, length filtering, and
the sampler's epochs and exact resume."""

from __future__ import annotations

import json
import logging

import pytest
from tokenizers import processors

from megarl.data.char_tokenizer import build_char_tokenizer
from megarl.data.config import PromptDataConfig
from megarl.data.prompts import PromptDataset, PromptSampler
from megarl.data.sampler import EpochSampler, epoch_order
from megarl.errors import UserError

# <s> is the char tokenizer's BOS (id 1), </s> its EOS (id 2); every other character is one token.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def tokenizer(chat: bool = False, adds_bos: bool = False):
    """The char tokenizer, optionally with a chat template and a BOS added to plain text (as Llama's does)."""
    tok = build_char_tokenizer()
    if chat:
        tok.chat_template = CHAT_TEMPLATE
    if adds_bos:
        tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", tok.bos_token_id)]
        )
    return tok


def char_ids(tok, text: str) -> list[int]:
    return [tok.convert_tokens_to_ids(c) for c in text]


def write_rows(tmp_path, rows, name="p.jsonl") -> str:
    path = tmp_path / name
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def dataset(tmp_path, rows, tok=None, split="train", **config) -> PromptDataset:
    path = write_rows(tmp_path, rows)
    files = {"train_files": [path]} if split == "train" else {"eval_files": [path]}
    config = PromptDataConfig(**files, **config)
    config.check("data")
    return PromptDataset(config, tok or tokenizer(), split=split)


# -- rendering ---------------------------------------------------------------------------------------------------


def test_plain_prompt_is_tokenized_as_is(tmp_path):
    tok = tokenizer()
    data = dataset(tmp_path, [{"prompt": "2+2?", "label": 4}])
    assert data[0].text == "2+2?"
    assert data[0].prompt_ids == char_ids(tok, "2+2?")
    assert data[0].label == 4


def test_template_formats_the_row_columns(tmp_path):
    rows = [{"question": "2+2?", "level": 1, "label": "4"}, {"question": "{x}", "level": 3, "label": "x"}]
    data = dataset(tmp_path, rows, template="Level {level}. Question: {question}\nAnswer in \\boxed{{}}:")
    assert [s.text for s in data] == [
        "Level 1. Question: 2+2?\nAnswer in \\boxed{}:",
        "Level 3. Question: {x}\nAnswer in \\boxed{}:",  # braces inside values are not formatted again
    ]


def test_template_errors_are_row_errors(tmp_path):
    rows = [{"question": "a", "label": 1}, {"label": 1}, {"question": ["x"], "label": 1}]
    with pytest.raises(UserError) as error:
        dataset(tmp_path, rows, template="Q: {question}")
    assert "2 problem(s)" in str(error.value)
    assert "p.jsonl:2: no key 'question'" in str(error.value)
    assert "p.jsonl:3: 'question' is a list; the template needs text or a number" in str(error.value)


def test_chat_template_wraps_text_as_a_user_message_and_keeps_one_bos(tmp_path):
    for adds_bos in (False, True):  # whether or not plain tokenization adds BOS, chat text carries exactly one
        tok = tokenizer(chat=True, adds_bos=adds_bos)
        data = dataset(tmp_path, [{"prompt": "hi", "label": 1}], tok, apply_chat_template=True)
        assert data[0].text == "<s><|user|>hi\n<|assistant|>"
        assert data[0].prompt_ids == [tok.bos_token_id, *char_ids(tok, "<|user|>hi\n<|assistant|>")]


def test_chat_template_with_template_and_system_prompt(tmp_path):
    tok = tokenizer(chat=True)
    data = dataset(
        tmp_path,
        [{"prompt": "2+2?", "label": 4}],
        tok,
        template="{prompt} Think step by step.",
        apply_chat_template=True,
        system_prompt="Be brief.",
    )
    assert data[0].text == "<s><|system|>Be brief.\n<|user|>2+2? Think step by step.\n<|assistant|>"


def test_chat_messages_are_used_as_given_and_their_system_message_wins(tmp_path):
    tok = tokenizer(chat=True)

    def chat(*turns):
        return [{"role": role, "content": content} for role, content in turns]

    rows = [
        {"prompt": chat(("user", "a"), ("assistant", "b"), ("user", "c")), "label": 1},
        {"prompt": chat(("system", "own"), ("user", "d")), "label": 2},
    ]
    data = dataset(tmp_path, rows, tok, apply_chat_template=True, system_prompt="default")
    assert data[0].text == "<s><|system|>default\n<|user|>a\n<|assistant|>b</s>\n<|user|>c\n<|assistant|>"
    assert data[1].text == "<s><|system|>own\n<|user|>d\n<|assistant|>"


def test_plain_bos_is_added_by_the_tokenizer_and_never_doubled(tmp_path):
    tok = tokenizer(adds_bos=True)
    data = dataset(tmp_path, [{"prompt": "hi", "label": 1}, {"prompt": "<s>hi", "label": 1}], tok)
    assert data[0].prompt_ids == [tok.bos_token_id, *char_ids(tok, "hi")]
    assert data[1].prompt_ids == data[0].prompt_ids  # a template that writes BOS out does not double it


def test_chat_template_needs_a_tokenizer_that_has_one(tmp_path):
    with pytest.raises(UserError, match="data.apply_chat_template=true but the tokenizer has no chat template"):
        dataset(tmp_path, [{"prompt": "hi", "label": 1}], apply_chat_template=True)


def test_failing_chat_template_is_a_row_error(tmp_path):
    tok = tokenizer()
    tok.chat_template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}x"
    rows = [{"prompt": "hi", "label": 1}, {"prompt": [{"role": "assistant", "content": "no"}], "label": 1}]
    with pytest.raises(UserError, match=r"p.jsonl:2: the chat template failed on these messages .*first must be user"):
        dataset(tmp_path, rows, tok, apply_chat_template=True)


# -- labels, meta, filtering -------------------------------------------------------------------------------------


def test_label_none_and_meta_columns(tmp_path):
    rows = [{"prompt": "a", "id": 7, "tags": ["x"]}, {"prompt": "b", "id": None, "tags": []}]
    data = dataset(tmp_path, rows, label_key=None, meta_keys=["id", "tags"])
    assert [(s.label, s.meta) for s in data] == [(None, {"id": 7, "tags": ["x"]}), (None, {"id": None, "tags": []})]


def test_long_prompts_are_dropped_and_counted(tmp_path, caplog):
    rows = [{"prompt": "x" * n, "label": n} for n in (3, 9, 4, 5, 12, 2)]
    with caplog.at_level(logging.WARNING, logger="megarl.data.prompts"):
        data = dataset(tmp_path, rows, max_prompt_tokens=4)
    assert [s.label for s in data] == [3, 4, 2]
    assert [s.index for s in data] == [0, 1, 2]
    assert [s.source.rsplit(":", 1)[1] for s in data] == ["1", "3", "6"]
    assert (data.num_rows, data.num_too_long) == (6, 3)
    assert "3 of 6 rows dropped for being longer than data.max_prompt_tokens=4 tokens" in caplog.text
    unlimited = dataset(tmp_path, rows, max_prompt_tokens=None)
    assert (len(unlimited), unlimited.num_too_long) == (6, 0)
    with pytest.raises(UserError, match="none of the 6 prompts is at most data.max_prompt_tokens=1 tokens"):
        dataset(tmp_path, rows, max_prompt_tokens=1)


def test_eval_split_keeps_the_first_samples_after_filtering(tmp_path):
    rows = [{"prompt": "x" * n, "label": i} for i, n in enumerate((3, 9, 4, 5, 2))]
    data = dataset(tmp_path, rows, split="eval", max_prompt_tokens=4, eval_max_samples=2)
    assert [s.label for s in data] == [0, 2]
    assert [[s.label for s in batch] for batch in data.batches(1)] == [[0], [2]]


# -- sampling ----------------------------------------------------------------------------------------------------


def test_each_epoch_is_a_fresh_permutation_from_seed_and_epoch():
    orders = [epoch_order(10, seed=3, epoch=e) for e in range(4)]
    assert all(sorted(order) == list(range(10)) for order in orders)
    assert len({tuple(order) for order in orders}) == 4
    assert orders == [epoch_order(10, seed=3, epoch=e) for e in range(4)]  # recomputable
    assert epoch_order(10, seed=4, epoch=0) != orders[0]
    assert epoch_order(5, seed=3, epoch=2, shuffle=False) == [0, 1, 2, 3, 4]


def test_sampler_batches_follow_the_epoch_orders_and_drop_the_tail():
    sampler = EpochSampler(list(range(10)), batch_size=3, seed=1)
    batches = [next(sampler) for _ in range(7)]
    for epoch in range(2):
        order = epoch_order(10, 1, epoch)
        assert batches[3 * epoch : 3 * epoch + 3] == [order[0:3], order[3:6], order[6:9]]  # item order[9] skipped
    assert batches[6] == epoch_order(10, 1, 2)[:3]
    assert sampler.num_batches_per_epoch == 3
    keep_last = EpochSampler(list(range(5)), batch_size=2, shuffle=False, drop_last=False)
    assert [next(keep_last) for _ in range(4)] == [[0, 1], [2, 3], [4], [0, 1]]
    assert keep_last.num_batches_per_epoch == 3


@pytest.mark.parametrize("num_done", [0, 1, 3, 5, 6])
def test_resume_continues_with_exactly_the_batches_of_an_uninterrupted_run(tmp_path, num_done):
    rows = [{"prompt": f"q{i}", "label": i} for i in range(11)]
    data = dataset(tmp_path, rows, seed=7)
    uninterrupted = data.sampler(batch_size=4)
    assert isinstance(uninterrupted, PromptSampler)
    expected = [[s.index for s in next(uninterrupted)] for _ in range(num_done + 6)]

    first_run = data.sampler(batch_size=4)
    for _ in range(num_done):
        next(first_run)
    state = json.loads(json.dumps(first_run.state_dict()))  # as stored in trainer_state.json
    resumed = dataset(tmp_path, rows, seed=7).sampler(batch_size=4)  # a new process: data read again
    resumed.load_state_dict(state)
    assert [[s.index for s in next(resumed)] for _ in range(6)] == expected[num_done:]


def test_resume_refuses_a_different_dataset_or_seed():
    state = EpochSampler(list(range(10)), batch_size=2, seed=1).state_dict()
    with pytest.raises(UserError, match="saved data position is for 10 items with seed=1.*this dataset has 9 items"):
        EpochSampler(list(range(9)), batch_size=2, seed=1).load_state_dict(state)
    with pytest.raises(UserError, match="must use the same data files, filters, seed and shuffle"):
        EpochSampler(list(range(10)), batch_size=2, seed=2).load_state_dict(state)


def test_sampler_sizes_are_checked():
    with pytest.raises(UserError, match="a batch of 5 needs at least that many items; the dataset has 4"):
        EpochSampler(list(range(4)), batch_size=5)
    with pytest.raises(UserError, match="batch size must be >= 1"):
        EpochSampler(list(range(4)), batch_size=0)
