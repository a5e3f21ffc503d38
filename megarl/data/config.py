"""Data settings: which files hold the prompts (RL), the demonstrations (SFT) or the preference pairs (reward
models), which columns to read, and how a row becomes text and tokens. Imports nothing heavy (the config loader
reads it).

Files are JSON Lines (`.jsonl`, one object per line), JSON (`.json`, a list of objects) or Parquet (`.parquet`).
A column key may be dotted to reach into nested objects (`reward_model.ground_truth`).
"""

from __future__ import annotations

import os
import string
import warnings
from dataclasses import dataclass, field

from megarl.config.paths import path_field
from megarl.errors import UserError

DATA_FILE_SUFFIXES = (".jsonl", ".json", ".parquet")
"""File types a dataset can be read from."""


def check_data_files(files: list[str], key: str) -> None:
    """Every file exists and has a known suffix; raises UserError naming `key[i]` otherwise."""
    problems = []
    for index, path in enumerate(files):
        name = f"{key}[{index}]={path!r}"
        if not path.endswith(DATA_FILE_SUFFIXES):
            problems.append(f"{name} has an unknown file type; valid: {', '.join(DATA_FILE_SUFFIXES)}")
        elif os.path.isdir(path):
            problems.append(f"{name} is a directory; list the data files in it instead")
        elif not os.path.exists(path):
            where = (
                ""
                if os.path.isabs(path)
                else f" (looked at {os.path.abspath(path)}: a relative path on the command line is read from the "
                "working directory, one in a config file from the file's folder)"
            )
            problems.append(f"{name} does not exist{where}")
    if problems:
        raise UserError("; ".join(problems))


def _at(key: str) -> str:
    """The prefix of a field's key path under `key` (none at the top level)."""
    return f"{key}." if key else ""


def template_fields(template: str) -> list[str]:
    """The row fields a template reads (`{prompt}`, `{meta[x]}` -> `prompt`, `meta`), in order of first use.
    Raises ValueError for a template Python cannot parse or one with positional fields."""
    names: list[str] = []
    for _, name, _, _ in string.Formatter().parse(template):
        if name is None:
            continue
        root = name.split(".")[0].split("[")[0]
        if not root or root.isdigit():
            raise ValueError(f"positional field {{{name}}}")
        if root not in names:
            names.append(root)
    return names


@dataclass
class TextDataConfig:
    """What every text dataset shares: its files, the prompt column and how a prompt is rendered."""

    train_files: list[str] = path_field("files", default_factory=list)  # noqa: RUF009 (a dataclasses.field)
    """Training files (.jsonl, .json or .parquet), read in order and concatenated."""
    eval_files: list[str] = path_field("files", default_factory=list)  # noqa: RUF009 (a dataclasses.field)
    """Evaluation files; empty means no evaluation set."""
    prompt_key: str = "prompt"
    """Column holding the prompt: text, or a list of chat messages ({"role": ..., "content": ...})."""
    template: str | None = None
    """Python format string over the row's columns that renders a text prompt, e.g. "Question: {prompt}\\nAnswer:";
    literal braces are written {{ and }}. With a template, the prompt column is read only if the template names
    it. None uses the prompt column as it is."""
    apply_chat_template: bool = False
    """Render the prompt with the tokenizer's chat template (a text prompt becomes one user message) and end it with
    the assistant's turn header; the template supplies BOS and other special tokens."""
    system_prompt: str | None = None
    """System message put before the prompt's messages when applying the chat template (unless the row's messages
    start with their own system message). None adds none."""
    shuffle: bool = True
    """Visit the training rows in a fresh random order each epoch (derived from `seed` and the epoch)."""
    seed: int = 0
    """Seed of the shuffling order (>= 0)."""
    eval_max_samples: int | None = None
    """Use only the first this many evaluation rows (after length filtering); None uses all."""

    def check(self, key: str) -> None:
        check_data_files(self.train_files, f"{_at(key)}train_files")
        check_data_files(self.eval_files, f"{_at(key)}eval_files")
        if not self.prompt_key:
            raise UserError(f"{_at(key)}prompt_key is empty; name the column that holds the prompt")
        if self.seed < 0:
            raise UserError(f"{_at(key)}seed={self.seed} must be >= 0")
        if self.eval_max_samples is not None and self.eval_max_samples < 1:
            raise UserError(f"{_at(key)}eval_max_samples={self.eval_max_samples} must be >= 1, or null to use all")
        if self.template is not None:
            _check_template(self.template, f"{_at(key)}template")
        if self.system_prompt is not None and not self.apply_chat_template:
            warnings.warn(
                f"{_at(key)}system_prompt has no effect without {_at(key)}apply_chat_template=true",
                UserWarning,
                stacklevel=2,
            )

    def split_files(self, split: str, key: str) -> list[str]:
        """The files of split `train` or `eval`; raises UserError when there are none."""
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        files = self.train_files if split == "train" else self.eval_files
        if not files:
            raise UserError(f"{_at(key)}{split}_files is empty; give at least one .jsonl, .json or .parquet file")
        return files

    def _check_positive(self, name: str, key: str, allow_none: bool = False) -> None:
        value = getattr(self, name)
        if value is None and allow_none:
            return
        if value is None or value < 1:
            valid = "an integer >= 1, or null for no limit" if allow_none else "an integer >= 1"
            raise UserError(f"{_at(key)}{name}={value} must be {valid}")


def _check_template(template: str, key: str) -> None:
    try:
        fields = template_fields(template)
    except ValueError as error:
        raise UserError(
            f"{key}={template!r} is not a valid format string ({error}); name the row's columns in braces, "
            "e.g. 'Question: {prompt}\\nAnswer:', and write literal braces as {{ and }} (e.g. \\\\boxed{{}})"
        ) from None
    if not fields:
        raise UserError(f"{key}={template!r} uses no column: every prompt would be the same; add e.g. {{prompt}}")


@dataclass
class PromptDataConfig(TextDataConfig):
    """Prompts for RL: each row gives a prompt, the ground truth a verifier checks, and columns carried along."""

    label_key: str | None = "label"
    """Column holding the ground truth for verifiers (any JSON value but null); None reads no label."""
    meta_keys: list[str] = field(default_factory=list)
    """Further columns carried with each prompt (into the verifier and the logs); they may hold null."""
    max_prompt_tokens: int | None = 1024
    """Prompts longer than this (in tokens, after rendering) are dropped and counted; None keeps all."""

    def check(self, key: str) -> None:
        super().check(key)
        self._check_positive("max_prompt_tokens", key, allow_none=True)
        if self.label_key == "":
            raise UserError(f"{_at(key)}label_key is empty; name the column of the ground truth, or null for none")
        for name in self.meta_keys:
            if name in (self.prompt_key, self.label_key):
                raise UserError(f"{_at(key)}meta_keys has {name!r}, which is already the prompt or label column")


@dataclass
class SFTDataConfig(TextDataConfig):
    """Demonstrations for supervised fine-tuning: a prompt and a response per row; the loss is on response tokens
    only."""

    response_key: str = "response"
    """Column holding the response text (the assistant's turn when the chat template is applied)."""
    max_tokens: int = 2048
    """Examples longer than this (prompt + response tokens) are dropped and counted."""
    append_eos: bool = True
    """End a plain-text response with the tokenizer's EOS token so the model learns to stop (with the chat template,
    the template closes the turn instead)."""

    def check(self, key: str) -> None:
        super().check(key)
        self._check_positive("max_tokens", key)
        if self.response_key in ("", self.prompt_key):
            raise UserError(f"{_at(key)}response_key={self.response_key!r} must name a column other than the prompt's")


@dataclass
class PairDataConfig(TextDataConfig):
    """Preference pairs for reward-model training: a prompt with a preferred and a rejected response per row."""

    chosen_key: str = "chosen"
    """Column holding the preferred response text."""
    rejected_key: str = "rejected"
    """Column holding the rejected response text."""
    max_tokens: int = 2048
    """Pairs whose longer side (prompt + response tokens) exceeds this are dropped and counted."""
    append_eos: bool = True
    """End plain-text responses with the tokenizer's EOS token (with the chat template, the template closes the
    turn instead)."""

    def check(self, key: str) -> None:
        super().check(key)
        self._check_positive("max_tokens", key)
        names = [self.prompt_key, self.chosen_key, self.rejected_key]
        if "" in names or len(set(names)) < 3:
            raise UserError(
                f"{_at(key)}prompt_key, chosen_key and rejected_key must name three different columns; got {names}"
            )
