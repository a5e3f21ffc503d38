"""Demonstrations for supervised fine-tuning: prompt and response tokenized apart, the loss on the response only.

An example is laid out like an RL sample (prompt ids, then response ids; see collate.py), so `response_mask` marks
exactly the tokens the SFT loss is taken on. Examples longer than `max_tokens` are dropped and counted.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from megarl.data.batch import Batch
from megarl.data.collate import make_rl_batch
from megarl.data.config import SFTDataConfig
from megarl.data.prompts import Split
from megarl.data.render import load_conversations, log_kept, pad_id_of
from megarl.data.sampler import EpochSampler, SampledDataset
from megarl.errors import UserError

logger = logging.getLogger(__name__)


@dataclass
class SFTExample:
    index: int
    """Position in the dataset (after filtering)."""
    prompt_ids: list[int]
    response_ids: list[int]
    """The response's tokens (ending with EOS for plain text when `append_eos`, or the chat template's end of
    turn)."""
    source: str = ""
    """Where the row came from: `file:line` or `file row N`."""


def collate_sft(examples: Sequence[SFTExample], pad_id: int) -> Batch:
    """A Batch of examples (see collate.py), with meta `index` and `source`."""
    return make_rl_batch(
        [example.prompt_ids for example in examples],
        [example.response_ids for example in examples],
        pad_id,
        meta={"index": [e.index for e in examples], "source": [e.source for e in examples]},
    )


class SFTDataset(SampledDataset[SFTExample]):
    """The demonstrations of one split, tokenized; `collate` turns a list of them into a Batch."""

    sampler_cls = EpochSampler

    def __init__(self, config: SFTDataConfig, tokenizer: Any, split: Split = "train", key: str = "data"):
        self.config = config
        self.split = split
        self.seed, self.shuffle = config.seed, config.shuffle
        self.pad_id = pad_id_of(tokenizer)
        loaded = load_conversations(config, tokenizer, split, key, [config.response_key], config.append_eos)
        responses = loaded.response_ids[config.response_key]
        kept = [
            (source, prompt, response)
            for source, prompt, response in zip(loaded.sources, loaded.prompt_ids, responses)
            if len(prompt) + len(response) <= config.max_tokens
        ]
        self.num_rows = len(loaded.sources)
        """Rows read from the files."""
        self.num_too_long = self.num_rows - len(kept)
        """Rows dropped for having more than max_tokens tokens."""
        if split == "eval" and config.eval_max_samples is not None:
            kept = kept[: config.eval_max_samples]
        self.samples = [SFTExample(i, prompt, response, source) for i, (source, prompt, response) in enumerate(kept)]
        if not self.samples:
            raise UserError(f"{key}.{split}_files: no example is at most {key}.max_tokens={config.max_tokens} tokens")
        log_kept(logger, f"{key}.{split}_files", self.num_rows, self.num_too_long, f"{key}.max_tokens")

    def collate(self, examples: Sequence[SFTExample]) -> Batch:
        return collate_sft(examples, self.pad_id)
