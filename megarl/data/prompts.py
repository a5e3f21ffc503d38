"""Prompts for RL: rows read and checked, rendered, tokenized and filtered by length, then sampled in batches.

Building a PromptDataset reads every row of its files first, so a malformed row stops the run before any worker
starts (see records.py). Prompts longer than `max_prompt_tokens` are dropped and counted (`num_too_long`, logged).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Literal

from megarl.data.config import PromptDataConfig
from megarl.data.records import Row, load_rows
from megarl.data.render import Renderer, log_kept
from megarl.data.sampler import EpochSampler, SampledDataset
from megarl.errors import UserError

logger = logging.getLogger(__name__)

Split = Literal["train", "eval"]


@dataclass
class PromptSample:
    index: int
    """Position in the dataset (after filtering): what the sampler draws."""
    text: str
    """The rendered prompt (template and chat template applied), as the tokenizer saw it."""
    prompt_ids: list[int]
    label: Any
    """Ground truth for verifiers (None when the config reads no label column)."""
    meta: dict[str, Any] = field(default_factory=dict)
    """The `meta_keys` columns of the row."""
    source: str = ""
    """Where the row came from: `file:line` or `file row N`."""


@dataclass
class _Rendered:
    text: str
    label: Any
    meta: dict[str, Any]


class PromptSampler(EpochSampler[PromptSample]):
    """Batches of PromptSamples, a fresh order each epoch, resumable (see EpochSampler)."""


class PromptDataset(SampledDataset[PromptSample]):
    """The prompts of one split, rendered and tokenized. `key` is the config's path, for messages."""

    sampler_cls = PromptSampler

    def __init__(self, config: PromptDataConfig, tokenizer: Any, split: Split = "train", key: str = "data"):
        self.config = config
        self.split = split
        self.seed, self.shuffle = config.seed, config.shuffle
        files = config.split_files(split, key)
        files_key = f"{key}.{split}_files"
        renderer = Renderer(config, tokenizer, key)
        rows = load_rows(files, files_key, self._fields(renderer), self._convert(renderer), what=files_key)
        token_ids = renderer.encode_prompts([rendered.text for _, rendered in rows])

        limit = config.max_prompt_tokens
        kept = [
            (source, rendered, ids)
            for (source, rendered), ids in zip(rows, token_ids)
            if limit is None or len(ids) <= limit
        ]
        self.num_rows = len(rows)
        """Rows read from the files."""
        self.num_too_long = len(rows) - len(kept)
        """Rows dropped for having more than max_prompt_tokens tokens."""
        if split == "eval" and config.eval_max_samples is not None:
            kept = kept[: config.eval_max_samples]
        self.samples = [
            PromptSample(index, rendered.text, ids, rendered.label, rendered.meta, source)
            for index, (source, rendered, ids) in enumerate(kept)
        ]
        if not self.samples:
            raise UserError(
                f"{files_key}: none of the {self.num_rows} prompts is at most {key}.max_prompt_tokens={limit} tokens "
                "long; raise the limit"
            )
        log_kept(logger, files_key, self.num_rows, self.num_too_long, f"{key}.max_prompt_tokens={limit}")

    def _fields(self, renderer: Renderer) -> dict[str, str]:
        fields = {name: "any" for name in self.config.meta_keys}
        if self.config.label_key is not None:
            fields[self.config.label_key] = "value"
        return {**fields, **renderer.input_fields()}  # the rendering's stricter checks win for shared columns

    def _convert(self, renderer: Renderer):
        def convert(row: Row, values: dict[str, Any]) -> _Rendered:
            label = values[self.config.label_key] if self.config.label_key is not None else None
            meta = {name: values[name] for name in self.config.meta_keys}
            return _Rendered(renderer.prompt_text(values), label, meta)

        return convert
