"""Token-exact trajectories of multi-turn episodes (DESIGN.md, "Agent episodes": token in, token out).

A trajectory is the prompt's ids, then turns: each model turn is the engine's sampled ids and log-probs as returned
(never decoded and encoded again), each observation (a tool result, an environment's reply) is text rendered with
the chat template's turn delimiters and tokenized once, then appended. `loss_mask` is 1 exactly on model-sampled
tokens. What the engine reads next is `context_ids`: the same ids, so the trainer scores the tokens the engine
sampled, in the context the engine saw.

Decoding a trajectory and encoding the text again can give other ids (BPE merges across turn boundaries, tokens
the model sampled in a non-canonical split): `retokenization_divergence` counts such positions. megarl's own path
never re-tokenizes, so it is 0 there; the metric catches user environments that rebuild the context from text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

Source = Literal["model", "observation"]


@dataclass(frozen=True)
class Turn:
    source: Source
    start: int
    """First position in `Trajectory.token_ids` (after the prompt)."""
    end: int


@dataclass
class Trajectory:
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    """Everything after the prompt: model turns and observations, in order."""
    logprobs: list[float] = field(default_factory=list)
    """The engine's log-prob of each model token; 0.0 on observation tokens."""
    loss_mask: list[int] = field(default_factory=list)
    """1 on model-sampled tokens, 0 on observation tokens."""
    versions: list[int] = field(default_factory=list)
    """Weight version that sampled each model token; -1 on observation tokens."""
    turns: list[Turn] = field(default_factory=list)

    @property
    def context_ids(self) -> list[int]:
        """What the engine reads before the next model turn."""
        return [*self.prompt_ids, *self.token_ids]

    def add_model_turn(self, token_ids: Sequence[int], logprobs: Sequence[float], versions: Sequence[int]) -> None:
        if not len(token_ids) == len(logprobs) == len(versions):
            raise ValueError(f"{len(token_ids)} tokens, {len(logprobs)} log-probs, {len(versions)} versions")
        self._append("model", token_ids, list(logprobs), 1, list(versions))

    def add_observation(self, token_ids: Sequence[int]) -> None:
        self._append("observation", token_ids, [0.0] * len(token_ids), 0, [-1] * len(token_ids))

    def _append(self, source: Source, ids: Sequence[int], logprobs: list[float], mask: int, versions: list[int]):
        start = len(self.token_ids)
        self.token_ids += list(ids)
        self.logprobs += logprobs
        self.loss_mask += [mask] * len(ids)
        self.versions += versions
        self.turns.append(Turn(source, start, len(self.token_ids)))

    def num_tokens(self, source: Source) -> int:
        return sum(t.end - t.start for t in self.turns if t.source == source)

    @property
    def num_model_turns(self) -> int:
        return sum(t.source == "model" for t in self.turns)


def retokenization_divergence(tokenizer, trajectory: Trajectory) -> int:
    """Positions at which encoding the decoded trajectory differs from its stored ids (0: token-exact), counting a
    length difference as that many positions."""
    stored = trajectory.context_ids
    again = tokenizer.encode(tokenizer.decode(stored, skip_special_tokens=False), add_special_tokens=False)
    differing = sum(a != b for a, b in zip(stored, again))
    return differing + abs(len(stored) - len(again))


class ObservationRenderer:
    """An observation as the tokens the chat template puts between a model turn and the next one.

    With a chat template: the text the template adds after an assistant turn for a message of `role` (e.g. Qwen's
    `\\n<|im_start|>user\\n<tool_response>\\n...\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n`), read off
    the template itself by rendering a conversation with and without that message; the part of the assistant turn's
    closing that the model does not sample (the newline after its end token) is included. Without a chat template
    (tiny tokenizers): `template` with `{content}` filled in.
    """

    _SENTINEL = "\u2063megarl-assistant-turn\u2063"

    def __init__(self, tokenizer, role: str = "tool", template: str | None = None):
        self.tokenizer = tokenizer
        self.role = role
        self.template = template
        if template is None and not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template: give an observation template with {content}")
        if template is not None and "{content}" not in template:
            raise ValueError(f"observation template {template!r} has no {{content}}")

    def text(self, content: str) -> str:
        if self.template is not None:
            return self.template.replace("{content}", content)
        base = [{"role": "user", "content": "q"}, {"role": "assistant", "content": self._SENTINEL}]
        before = self.tokenizer.apply_chat_template(base, tokenize=False)
        after = self.tokenizer.apply_chat_template(
            [*base, {"role": self.role, "content": content}], tokenize=False, add_generation_prompt=True
        )
        anchor = after.index(self._SENTINEL) + len(self._SENTINEL)
        if not after.startswith(before[: before.index(self._SENTINEL)]):
            raise ValueError("the chat template renders earlier turns differently once a message follows")
        rest = after[anchor:]
        end = self.tokenizer.eos_token or ""
        return rest[len(end) :] if end and rest.startswith(end) else rest  # the model samples its end token

    def token_ids(self, content: str) -> list[int]:
        """The observation's ids: rendered, then tokenized once."""
        return self.tokenizer.encode(self.text(content), add_special_tokens=False)
