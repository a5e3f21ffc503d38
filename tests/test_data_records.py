"""Reading data files: JSONL / JSON / Parquet rows, and every malformed row named by file and line before training."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from megarl.data.char_tokenizer import build_char_tokenizer
from megarl.data.config import PairDataConfig, PromptDataConfig, SFTDataConfig
from megarl.data.prompts import PromptDataset
from megarl.data.records import ProblemLog, lookup, read_rows
from megarl.errors import UserError

ROWS = [
    {"prompt": "1+1=?", "label": "2", "source": "a"},
    {"prompt": "2+3=?", "label": "5", "source": "b"},
    {"prompt": "7-4=?", "label": "3", "source": None},
]


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


def write_jsonl(path, rows) -> str:
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return str(path)


def write_parquet(path, rows) -> str:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def load(tokenizer, files, **config) -> PromptDataset:
    config = PromptDataConfig(train_files=[str(f) for f in files], **config)
    config.check("data")
    return PromptDataset(config, tokenizer, key="data")


def problems_of(tokenizer, files, **config) -> str:
    with pytest.raises(UserError) as error:
        load(tokenizer, files, **config)
    return str(error.value)


# -- reading each format -----------------------------------------------------------------------------------------


def test_jsonl_json_and_parquet_give_the_same_prompts(tokenizer, tmp_path):
    jsonl = write_jsonl(tmp_path / "p.jsonl", ROWS)
    (tmp_path / "p.json").write_text(json.dumps(ROWS))
    parquet = write_parquet(tmp_path / "p.parquet", ROWS)
    loaded = {
        path: load(tokenizer, [path], meta_keys=["source"]) for path in (jsonl, str(tmp_path / "p.json"), parquet)
    }
    for dataset in loaded.values():
        assert [(s.text, s.label, s.meta) for s in dataset.samples] == [
            (row["prompt"], row["label"], {"source": row["source"]}) for row in ROWS
        ]
        assert [s.index for s in dataset.samples] == [0, 1, 2]
    assert [s.source for s in loaded[jsonl].samples] == [f"{jsonl}:1", f"{jsonl}:2", f"{jsonl}:3"]
    assert [s.source for s in loaded[parquet].samples] == [f"{parquet} row {i}" for i in range(3)]


def test_files_are_concatenated_in_order_and_blank_lines_skipped(tokenizer, tmp_path):
    first = tmp_path / "a.jsonl"
    first.write_text(json.dumps(ROWS[0]) + "\n\n   \n" + json.dumps(ROWS[1]) + "\n")
    second = write_jsonl(tmp_path / "b.jsonl", ROWS[2:])
    dataset = load(tokenizer, [first, second])
    assert [s.text for s in dataset.samples] == [row["prompt"] for row in ROWS]
    assert [s.source for s in dataset.samples] == [f"{first}:1", f"{first}:4", f"{second}:1"]


def test_parquet_reads_only_the_needed_columns_in_batches(tmp_path, monkeypatch):
    import megarl.data.records as records

    monkeypatch.setattr(records, "PARQUET_BATCH_ROWS", 2)  # several record batches: row numbers run on across them
    rows = [{"prompt": f"q{i}", "label": i, "unused": [i] * 3} for i in range(5)]
    path = write_parquet(tmp_path / "p.parquet", rows)
    problems = ProblemLog("test")
    read = list(read_rows([path], "data.train_files", ["prompt", "label"], problems))
    assert [row.values for row in read] == [{"prompt": f"q{i}", "label": i} for i in range(5)]
    assert [row.location for row in read] == [f"{path} row {i}" for i in range(5)]
    assert problems.num_problems == 0


def test_dotted_keys_reach_into_nested_columns(tokenizer, tmp_path):
    rows = [{"prompt": [{"role": "user", "content": "hi"}], "reward_model": {"ground_truth": "7"}}]
    assert lookup(rows[0], "reward_model.ground_truth") == "7"
    path = write_parquet(tmp_path / "verl.parquet", rows)
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    dataset = load(tokenizer, [path], label_key="reward_model.ground_truth", apply_chat_template=True)
    assert dataset[0].label == "7"
    assert dataset[0].text == "user: hi\nassistant:"


# -- malformed rows ----------------------------------------------------------------------------------------------


def test_malformed_jsonl_rows_are_each_named_by_file_and_line(tokenizer, tmp_path):
    path = write_jsonl(
        tmp_path / "bad.jsonl",
        [
            ROWS[0],  # line 1: fine
            '{"prompt": "unterminated',  # line 2: invalid JSON
            {"label": "3"},  # line 3: no prompt
            {"prompt": 42, "label": "1"},  # line 4: a number where text belongs
            {"prompt": "   ", "label": "1"},  # line 5: empty prompt
            {"prompt": "ok", "label": None},  # line 6: null label
            "[1, 2]",  # line 7: not an object
        ],
    )
    message = problems_of(tokenizer, [path])
    assert message.startswith("6 problem(s) in data.train_files (the first 5 shown):")
    assert f"{path}:2: invalid JSON" in message
    assert f"{path}:3: no key 'prompt'; the row has 'label'" in message
    assert f"{path}:4: 'prompt' is a number (42); expected non-empty text or a list of chat messages" in message
    assert f"{path}:5: 'prompt' is empty text; expected non-empty text" in message
    assert f"{path}:6: 'label' is null" in message
    assert f"{path}:7" not in message  # beyond the first five
    assert f"{path}:1" not in message


def test_problems_are_gathered_across_files_before_failing(tokenizer, tmp_path):
    good = write_jsonl(tmp_path / "good.jsonl", ROWS)
    first = write_jsonl(tmp_path / "one.jsonl", [ROWS[0], {"prompt": ["not", "messages"], "label": 1}])
    (tmp_path / "two.json").write_text(json.dumps([ROWS[0], {"prompt": "fine"}, "text"]))
    message = problems_of(tokenizer, [good, first, tmp_path / "two.json"])
    assert message.startswith("3 problem(s) in data.train_files:")
    assert f"{first}:2: 'prompt'[0] is text; expected non-empty text or a list of chat messages" in message
    assert f"{tmp_path / 'two.json'} row 1: no key 'label'" in message
    assert f"{tmp_path / 'two.json'} row 2: is text; expected an object" in message


def test_bad_chat_messages_name_the_message_and_part(tokenizer, tmp_path):
    path = write_jsonl(
        tmp_path / "chat.jsonl",
        [
            {"prompt": [{"role": "user", "content": "hi"}, {"role": "assistant"}], "label": 1},
            {"prompt": [{"role": "user", "content": 3}], "label": 1},
            {"prompt": [], "label": 1},
        ],
    )
    message = problems_of(tokenizer, [path])
    assert f"{path}:1: 'prompt'[1]['content'] is missing" in message
    assert f"{path}:2: 'prompt'[0]['content'] is a number (3)" in message
    assert f"{path}:3: 'prompt' is an empty list" in message


def test_chat_prompt_without_chat_template_is_a_row_error(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": [{"role": "user", "content": "hi"}], "label": 1}])
    assert "set apply_chat_template=true" in problems_of(tokenizer, [path])


def test_parquet_problems_name_the_row_or_the_missing_column(tokenizer, tmp_path):
    rows = [{"prompt": "a", "label": "1"}, {"prompt": "", "label": "2"}, {"prompt": None, "label": "3"}]
    path = write_parquet(tmp_path / "p.parquet", rows)
    message = problems_of(tokenizer, [path])
    assert f"{path} row 1: 'prompt' is empty text" in message
    assert f"{path} row 2: 'prompt' is null" in message
    message = problems_of(tokenizer, [path], label_key="answer")
    assert f"{path}: has no column 'answer'; its columns: 'label', 'prompt'" in message


def test_invalid_json_file_and_non_list_json(tokenizer, tmp_path):
    (tmp_path / "broken.json").write_text('[{"prompt": "a", "label": 1},')
    (tmp_path / "dict.json").write_text('{"prompt": "a", "label": 1}')
    message = problems_of(tokenizer, [tmp_path / "broken.json", tmp_path / "dict.json"])
    assert f"{tmp_path / 'broken.json'}: invalid JSON" in message
    assert f"{tmp_path / 'dict.json'}: holds an object; expected a list of objects" in message


def test_missing_files_and_unknown_types_are_named_with_valid_types(tokenizer, tmp_path):
    good = write_jsonl(tmp_path / "good.jsonl", ROWS)
    config = PromptDataConfig(train_files=[good, str(tmp_path / "gone.jsonl")], eval_files=["data.csv"])
    with pytest.raises(UserError, match=re.escape(f"data.train_files[1]='{tmp_path / 'gone.jsonl'}' does not exist")):
        config.check("data")
    config.train_files = [good]
    with pytest.raises(UserError, match=r"data.eval_files\[0\]='data.csv' has an unknown file type; valid: .jsonl"):
        config.check("data")
    with pytest.raises(UserError, match="data.eval_files\\[0\\]='data.csv' has an unknown file type"):
        PromptDataset(config, tokenizer, split="eval")
    with pytest.raises(UserError, match="data.train_files is empty"):
        PromptDataset(PromptDataConfig(), tokenizer)


# -- config checks -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "match"),
    [
        (PromptDataConfig(template="Answer in \\boxed{} : {prompt}"), "data.template=.* literal braces as {{ and }}"),
        (PromptDataConfig(template="Solve: {}"), "data.template=.*positional field"),
        (PromptDataConfig(template="Solve it."), "data.template=.*uses no column"),
        (PromptDataConfig(max_prompt_tokens=0), r"data.max_prompt_tokens=0 must be an integer >= 1, or null"),
        (PromptDataConfig(seed=-1), "data.seed=-1 must be >= 0"),
        (PromptDataConfig(eval_max_samples=0), "data.eval_max_samples=0 must be >= 1"),
        (PromptDataConfig(meta_keys=["label"]), "data.meta_keys has 'label'"),
        (SFTDataConfig(response_key="prompt"), "data.response_key='prompt' must name a column other"),
        (SFTDataConfig(max_tokens=0), "data.max_tokens=0 must be an integer >= 1"),
        (PairDataConfig(rejected_key="chosen"), "data.prompt_key, chosen_key and rejected_key must name three"),
    ],
)
def test_config_check_names_the_key(config, match):
    with pytest.raises(UserError, match=match):
        config.check("data")


def test_defaults_pass_and_system_prompt_without_chat_warns():
    for config in (PromptDataConfig(), SFTDataConfig(), PairDataConfig()):
        config.check("data")
    with pytest.warns(UserWarning, match="data.system_prompt has no effect without data.apply_chat_template=true"):
        PromptDataConfig(system_prompt="Be brief.").check("data")


def test_config_module_imports_nothing_heavy():
    code = "import sys, megarl.data.config; heavy = {'torch', 'transformers', 'numpy'} & set(sys.modules); print(heavy)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "set()"
