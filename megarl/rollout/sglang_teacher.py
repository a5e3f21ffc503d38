"""A teacher served by SGLang (teacher.backend=sglang): the teacher's log-probs of the student's sampled tokens,
from a running SGLang server's /generate with prompt log-probs and nothing generated.

Each sample is sent whole (prompt and response, `input_ids`) with `max_new_tokens` 0, `return_logprob` and
`logprob_start_len` at its first response token; SGLang answers `meta_info.input_token_logprobs`, one
`[logprob, token_id, text]` per token from that position on: the log-prob of token t given the tokens before it,
at temperature 1 (SGLang applies no temperature to prompt tokens; the config check asks for sampling temperature 1).
Tokens after the first response token that are not the model's (an agent episode's observations) are scored too
and masked later, as the Megatron teacher's are.

Samples are grouped into requests of at most teacher.sglang.max_request_tokens tokens, sent a few at a time over
the servers; a failed request goes to the next server up to teacher.sglang.retries times. Every answer is checked
against what was sent (one entry per token, the same ids): a server serving another model or cutting a sample
short fails the step naming the server, never yields misaligned log-probs.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from megarl.data.batch import Batch
from megarl.errors import RunFailure
from megarl.rollout.sglang_client import SGLangClient, SGLangError


@dataclass(frozen=True)
class ScoredSample:
    """One sample to score: its tokens (prompt, response; no padding) and the first position to score."""

    token_ids: list[int]
    start: int


def samples_of(batch: Batch) -> list[ScoredSample]:
    """Each row's real tokens and its first response token (rows are right-padded; Batch's conventions)."""
    samples = []
    for ids, attention, response in zip(batch["input_ids"], batch["attention_mask"], batch["response_mask"]):
        length = int(attention.sum())
        positions = torch.nonzero(response[:length]).reshape(-1)
        start = int(positions[0]) if positions.numel() else length
        samples.append(ScoredSample(ids[:length].tolist(), max(start, 1)))
    return samples


def score_payload(samples: Sequence[ScoredSample]) -> dict[str, Any]:
    """The /generate body (SGLang's GenerateReqInput) that scores `samples` without generating."""
    return {
        "input_ids": [sample.token_ids for sample in samples],
        "sampling_params": [{"max_new_tokens": 0, "temperature": 1.0} for _ in samples],
        "return_logprob": [True] * len(samples),
        "logprob_start_len": [sample.start for sample in samples],
    }


def parse_scores(answer: Any, samples: Sequence[ScoredSample], url: str) -> list[list[float]]:
    """Per sample, the log-probs of its tokens from `start` on; raises SGLangError when the answer does not match
    what was sent."""
    items = answer if isinstance(answer, list) else [answer]
    if len(items) != len(samples):
        raise SGLangError(f"teacher server {url}: {len(items)} results for {len(samples)} samples", url=url)
    scores = []
    for i, (item, sample) in enumerate(zip(items, samples)):
        try:
            entries = item["meta_info"]["input_token_logprobs"]
        except (KeyError, TypeError):
            raise SGLangError(
                f"teacher server {url}: result {i} has no meta_info.input_token_logprobs: {str(item)[:200]}", url=url
            ) from None
        expected = sample.token_ids[sample.start :]
        ids = [int(entry[1]) for entry in entries]
        if ids != expected:
            raise SGLangError(
                f"teacher server {url}: sample {i} came back with {len(ids)} scored tokens for the {len(expected)} "
                f"sent from position {sample.start} (or other ids): is the server serving the teacher, with the "
                "student's tokenizer?",
                url=url,
            )
        if any(entry[0] is None for entry in entries):
            raise SGLangError(f"teacher server {url}: sample {i} has a token without a log-prob", url=url)
        scores.append([float(entry[0]) for entry in entries])
    return scores


def group_samples(samples: Sequence[ScoredSample], max_tokens: int) -> list[list[int]]:
    """Sample indices in requests of at most `max_tokens` tokens, in order (a longer sample goes alone)."""
    groups: list[list[int]] = []
    size = 0
    for i, sample in enumerate(samples):
        n = len(sample.token_ids)
        if not groups or size + n > max_tokens:
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += n
    return groups


class SGLangTeacher:
    """The teacher's log-probs of a batch, from the SGLang servers at `urls`."""

    def __init__(
        self,
        urls: Sequence[str],
        *,
        timeout_s: float = 600.0,
        max_request_tokens: int = 65536,
        parallel_requests: int = 4,
        retries: int = 1,
    ) -> None:
        self.clients = [SGLangClient(url, control_timeout_s=timeout_s) for url in urls]
        self.timeout_s = timeout_s
        self.max_request_tokens = max_request_tokens
        self.parallel_requests = parallel_requests
        self.retries = retries
        self._next = itertools.count()
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, server) -> SGLangTeacher:
        """From teacher.sglang (job.TeacherServer)."""
        return cls(
            server.urls,
            timeout_s=server.timeout_s,
            max_request_tokens=server.max_request_tokens,
            parallel_requests=server.parallel_requests,
            retries=server.retries,
        )

    def describe(self) -> list[str]:
        """One line per server (its model path as it reports it); raises RunFailure when one does not answer."""
        lines = []
        for client in self.clients:
            try:
                client.health()
                info = client.model_info()
            except SGLangError as err:
                raise RunFailure(f"teacher.sglang.urls: {err}") from None
            lines.append(f"{client.base_url} serves {info.get('model_path', '(model path not reported)')}")
        return lines

    def logprobs(self, batch: Batch) -> torch.Tensor:
        """[B, S] aligned with input_ids (column t: log p_teacher(token t | tokens before it)); 0 before each
        sample's first response token and on padding."""
        samples = samples_of(batch)
        scored = [i for i, sample in enumerate(samples) if sample.start < len(sample.token_ids)]  # a response to score
        groups = [
            [scored[j] for j in group] for group in group_samples([samples[i] for i in scored], self.max_request_tokens)
        ]
        out = torch.zeros(batch["input_ids"].shape, dtype=torch.float32)
        if not groups:
            return out
        with ThreadPoolExecutor(max_workers=min(self.parallel_requests, len(groups))) as pool:
            results = list(pool.map(lambda group: self._score([samples[i] for i in group]), groups))
        for group, scores in zip(groups, results):
            for i, values in zip(group, scores):
                start = samples[i].start
                out[i, start : start + len(values)] = torch.tensor(values, dtype=torch.float32)
        return out

    def _score(self, samples: list[ScoredSample]) -> list[list[float]]:
        payload = score_payload(samples)
        errors = []
        for _ in range(self.retries + 1):
            with self._lock:
                client = self.clients[next(self._next) % len(self.clients)]
            try:
                return parse_scores(client.generate(payload, self.timeout_s), samples, client.base_url)
            except SGLangError as err:
                errors.append(str(err))
        raise RunFailure(
            f"the teacher's log-probs (teacher.backend=sglang): {len(errors)} tries failed; last: {errors[-1]}"
        )
