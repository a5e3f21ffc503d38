"""Preference pairs for reward-model training: one prompt, a chosen and a rejected response.

A batch of k pairs has 2k rows, interleaved (chosen_0, rejected_0, chosen_1, ...), so a contiguous split between
data-parallel ranks keeps pairs together when each part has an even number of rows. `group_ids` [2k] names the pair
of each row and `is_chosen` [2k] is 1 on chosen rows; token tensors are laid out as in collate.py. Pairs whose
longer side exceeds `max_tokens` are dropped and counted.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megarl.data.batch import Batch
from megarl.data.collate import make_rl_batch
from megarl.data.config import PairDataConfig
from megarl.data.prompts import Split
from megarl.data.render import load_conversations, log_kept, pad_id_of
from megarl.data.sampler import EpochSampler, SampledDataset
from megarl.errors import UserError

logger = logging.getLogger(__name__)


@dataclass
class PairExample:
    index: int
    """Position in the dataset (after filtering)."""
    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]
    source: str = ""
    """Where the row came from: `file:line` or `file row N`."""


def collate_pairs(pairs: Sequence[PairExample], pad_id: int) -> Batch:
    """2 x len(pairs) rows, chosen then rejected for each pair, with `group_ids`, `is_chosen` and meta `index`,
    `source` (per row)."""
    prompts = [pair.prompt_ids for pair in pairs for _ in range(2)]
    responses = [ids for pair in pairs for ids in (pair.chosen_ids, pair.rejected_ids)]
    batch = make_rl_batch(
        prompts,
        responses,
        pad_id,
        meta={name: [getattr(pair, name) for pair in pairs for _ in range(2)] for name in ("index", "source")},
    )
    return batch.with_tensors(
        group_ids=torch.arange(len(pairs), dtype=torch.long).repeat_interleave(2),
        is_chosen=torch.tensor([1, 0], dtype=torch.long).repeat(len(pairs)),
    )


class PairDataset(SampledDataset[PairExample]):
    """The preference pairs of one split, tokenized; `collate` turns a list of them into a Batch."""

    sampler_cls = EpochSampler

    def __init__(self, config: PairDataConfig, tokenizer: Any, split: Split = "train", key: str = "data"):
        self.config = config
        self.split = split
        self.seed, self.shuffle = config.seed, config.shuffle
        self.pad_id = pad_id_of(tokenizer)
        keys = [config.chosen_key, config.rejected_key]
        loaded = load_conversations(config, tokenizer, split, key, keys, config.append_eos)
        kept = [
            (source, prompt, chosen, rejected)
            for source, prompt, chosen, rejected in zip(
                loaded.sources, loaded.prompt_ids, loaded.response_ids[keys[0]], loaded.response_ids[keys[1]]
            )
            if len(prompt) + max(len(chosen), len(rejected)) <= config.max_tokens
        ]
        self.num_rows = len(loaded.sources)
        """Rows read from the files."""
        self.num_too_long = self.num_rows - len(kept)
        """Pairs dropped for having a side longer than max_tokens tokens."""
        if split == "eval" and config.eval_max_samples is not None:
            kept = kept[: config.eval_max_samples]
        self.samples = [PairExample(i, *row[1:], source=row[0]) for i, row in enumerate(kept)]
        if not self.samples:
            raise UserError(f"{key}.{split}_files: no pair is at most {key}.max_tokens={config.max_tokens} tokens")
        log_kept(logger, f"{key}.{split}_files", self.num_rows, self.num_too_long, f"{key}.max_tokens")

    def collate(self, pairs: Sequence[PairExample]) -> Batch:
        return collate_pairs(pairs, self.pad_id)
