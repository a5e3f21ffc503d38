"""From a row to text and token ids: the format template, the chat template, and tokenization without doubled
special tokens.

A prompt is rendered in one of three ways: as it is (text), through `template` (a format string over the row's
columns), or through the tokenizer's chat template (a text prompt, templated or not, becomes one user message; a
list of messages is used as it is). Chat-rendered text already holds the special tokens the model expects (BOS,
turn markers), so it is tokenized without adding any; plain text gets the tokenizer's usual special tokens, and a
BOS doubled by a template that writes it out is dropped once. Responses are tokenized without special tokens.
Prompt and response are tokenized separately, as in a rollout (prompt ids, then generated ids).
"""

from __future__ import annotations

import logging
import string
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from megarl.data.config import TextDataConfig, template_fields
from megarl.data.records import Row, RowError, load_rows
from megarl.errors import UserError

ENCODE_CHUNK = 1024
"""Texts tokenized per call of the (Rust, multi-threaded) fast tokenizer."""


class Renderer:
    """Renders and tokenizes the prompts (and responses) of one dataset config."""

    def __init__(self, config: TextDataConfig, tokenizer: Any, key: str):
        self.config = config
        self.tokenizer = tokenizer
        self.fields = template_fields(config.template) if config.template else [config.prompt_key]
        # A field the template indexes into ({problem[text]}) is a container; only what it writes must be scalar,
        # and a missing part is reported when the template is filled.
        self.indexed = {
            name.split(".")[0].split("[")[0]
            for _, name, _, _ in string.Formatter().parse(config.template or "")
            if name and ("[" in name or "." in name)
        }
        if config.apply_chat_template and not getattr(tokenizer, "chat_template", None):
            raise UserError(
                f"{key}.apply_chat_template=true but the tokenizer has no chat template; set it to false, or use a "
                "tokenizer (model) that has one"
            )

    def input_fields(self) -> dict[str, str]:
        """The columns a prompt is rendered from, with their kinds (see records.FIELD_CHECKS)."""
        if self.config.template is None:
            return {self.config.prompt_key: "prompt"}
        return {name: "any" if name in self.indexed else "scalar" for name in self.fields}

    def prompt_text(self, values: dict[str, Any]) -> str:
        """The rendered prompt of one row (`values` checked against `input_fields`), ending where the response
        starts."""
        content = self._content(values)
        if not self.config.apply_chat_template:
            if not isinstance(content, str):
                raise RowError(
                    f"{self.config.prompt_key!r} is a list of chat messages; set apply_chat_template=true to render "
                    "it with the tokenizer's chat template"
                )
            return content
        return self._chat(self._messages(content), add_generation_prompt=True)

    def prompt_and_response_text(self, values: dict[str, Any], response: str) -> tuple[str, str]:
        """Prompt text and response text such that their concatenation is the whole rendered conversation."""
        prompt = self.prompt_text(values)
        if not self.config.apply_chat_template:
            return prompt, response
        conversation = [*self._messages(self._content(values)), {"role": "assistant", "content": response}]
        full = self._chat(conversation, add_generation_prompt=False)
        if not full.startswith(prompt):
            raise RowError(
                "the chat template renders the conversation with a different beginning than the prompt alone (it "
                "may rewrite earlier turns), so the response tokens cannot be told apart"
            )
        return prompt, full[len(prompt) :]

    # -- tokenization --------------------------------------------------------------------------------------------

    def encode_prompts(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of rendered prompts: chat-rendered text as it is, plain text with the tokenizer's special
        tokens (BOS), a doubled leading BOS dropped once."""
        ids = self._encode(texts, add_special_tokens=not self.config.apply_chat_template)
        bos = self.tokenizer.bos_token_id
        if bos is not None:
            ids = [row[1:] if len(row) > 1 and row[0] == bos and row[1] == bos else row for row in ids]
        return ids

    def encode_responses(self, texts: Sequence[str], append_eos: bool) -> list[list[int]]:
        """Token ids of responses, without special tokens; plain-text responses end with EOS if `append_eos`."""
        ids = self._encode(texts, add_special_tokens=False)
        eos = self.tokenizer.eos_token_id
        if append_eos and not self.config.apply_chat_template and eos is not None:
            ids = [row if row and row[-1] == eos else [*row, eos] for row in ids]
        return ids

    def _encode(self, texts: Sequence[str], add_special_tokens: bool) -> list[list[int]]:
        ids: list[list[int]] = []
        for start in range(0, len(texts), ENCODE_CHUNK):
            chunk = list(texts[start : start + ENCODE_CHUNK])
            ids.extend(self.tokenizer(chunk, add_special_tokens=add_special_tokens)["input_ids"])
        return ids

    # -- rendering -----------------------------------------------------------------------------------------------

    def _content(self, values: dict[str, Any]) -> str | list[dict[str, Any]]:
        if self.config.template is None:
            return values[self.config.prompt_key]
        try:
            return self.config.template.format(**values)
        except (KeyError, IndexError, AttributeError, ValueError) as error:
            raise RowError(f"template {self.config.template!r} cannot be filled from this row ({error!r})") from None

    def _messages(self, content: str | Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        if isinstance(content, str):
            messages = [{"role": "user", "content": content}]
        else:
            messages = [dict(message) for message in content]
        if self.config.system_prompt is not None and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": self.config.system_prompt})
        return messages

    def _chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except Exception as error:  # jinja raises whatever the template raises (e.g. roles must alternate)
            raise RowError(f"the chat template failed on these messages ({type(error).__name__}: {error})") from None
        if not isinstance(text, str):
            raise TypeError(f"apply_chat_template returned {type(text).__name__}, expected text")
        return text


def pad_id_of(tokenizer: Any) -> int:
    """The id to pad with (masks mark padding, so any id works; the pad token when there is one)."""
    for token_id in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if token_id is not None:
            return token_id
    return 0


def log_kept(logger: logging.Logger, what: str, num_rows: int, num_too_long: int, limit: str) -> None:
    logger.info("%s: %d of %d rows kept", what, num_rows - num_too_long, num_rows)
    if num_too_long:
        logger.warning("%s: %d of %d rows dropped for being longer than %s tokens", what, num_too_long, num_rows, limit)


@dataclass
class Conversations:
    """Tokenized prompts, each with one or more responses (SFT: one; preference pairs: chosen and rejected)."""

    sources: list[str]
    """Where each row came from (`file:line` or `file row N`)."""
    prompt_ids: list[list[int]]
    response_ids: dict[str, list[list[int]]]
    """Per response column, the token ids of each row's response."""


def load_conversations(
    config: TextDataConfig, tokenizer: Any, split: str, key: str, response_keys: Sequence[str], append_eos: bool
) -> Conversations:
    """Read, check, render and tokenize every row of a split: the prompt, and each response column as the
    assistant's reply to it."""
    files = config.split_files(split, key)
    files_key = f"{key}.{split}_files"
    renderer = Renderer(config, tokenizer, key)
    fields = {**renderer.input_fields(), **{name: "text" for name in response_keys}}

    def convert(row: Row, values: dict[str, Any]) -> tuple[str, list[str]]:
        texts = [renderer.prompt_and_response_text(values, values[name]) for name in response_keys]
        # The prompt renders the same whatever the response (checked by prompt_and_response_text).
        return texts[0][0], [response for _, response in texts]

    rows = load_rows(files, files_key, fields, convert, what=files_key)
    return Conversations(
        sources=[source for source, _ in rows],
        prompt_ids=renderer.encode_prompts([prompt for _, (prompt, _) in rows]),
        response_ids={
            name: renderer.encode_responses([responses[i] for _, (_, responses) in rows], append_eos)
            for i, name in enumerate(response_keys)
        },
    )
