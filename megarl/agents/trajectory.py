"""Token-exact trajectories of multi-turn episodes (docs/architecture.md, "Agent episodes": token in, token out).

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

    The content is the environment's (a tool's output: text the policy can steer), so special-token text in it
    (`<|im_end|>\n<|im_start|>assistant`) is tokenized as text: only the template's own markers become special
    tokens, and a tool's output cannot forge a turn boundary. Where the content holds no special-token text, the ids
    are those of tokenizing the whole rendered text.
    """

    _SENTINEL = "\u2063megarl-assistant-turn\u2063"
    _CONTENT = "\u2063megarl-observation\u2063"

    def __init__(self, tokenizer, role: str = "tool", template: str | None = None):
        self.tokenizer = tokenizer
        self.role = role
        self.template = template
        if template is None and not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template: give an observation template with {content}")
        if template is not None and template.count("{content}") != 1:
            raise ValueError(f"observation template {template!r} must hold {{content}} once")
        special = {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special}
        self._special = sorted(special | set(getattr(tokenizer, "all_special_tokens", ())), key=len, reverse=True)
        self._frame: tuple[str, str] | None = None

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
        """The observation's ids: rendered, then tokenized once, special-token text inside `content` as text."""
        head, tail = self._frame_around_content()
        text = self.text(content)
        if text.startswith(head) and text.endswith(tail) and len(text) >= len(head) + len(tail):
            content = text[len(head) : len(text) - len(tail)]  # as the template rendered it (e.g. trimmed)
        # the template's text up to its last special token before the content, and from its first one after it,
        # tokenized as usual; the text between them (with the content) with special tokens read as plain text
        cut_head = max((head.rfind(t) + len(t) for t in self._special if t in head), default=0)
        cut_tail = min((tail.find(t) for t in self._special if t in tail), default=len(tail))
        encode = self.tokenizer.encode
        # a tokenizer without special tokens (megarl's character tokenizer) has nothing to split, nor the argument
        as_text = {"split_special_tokens": True} if self._special else {}
        return [
            *encode(head[:cut_head], add_special_tokens=False),
            *encode(head[cut_head:] + content + tail[:cut_tail], add_special_tokens=False, **as_text),
            *encode(tail[cut_tail:], add_special_tokens=False),
        ]

    def _frame_around_content(self) -> tuple[str, str]:
        """The rendered observation's text before and after its content."""
        if self._frame is None:
            rendered = self.text(self._CONTENT)
            at = rendered.index(self._CONTENT)
            self._frame = rendered[:at], rendered[at + len(self._CONTENT) :]
        return self._frame
