"""A byte-level BPE tokenizer of Qwen2's kind (transformers' Qwen2Tokenizer, built locally: no hub) with Qwen2.5's
chat template (the messages part; tool definitions left out) and its special and added tokens."""

from __future__ import annotations

QWEN25_CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

SPECIAL_TOKENS = ["<|im_start|>", "<|im_end|>"]
ADDED_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
"""Qwen2.5 adds these as tokens that are not special: they are matched in text, as they are there."""


def build_qwen_tokenizer():
    """Every byte is a token (byte-level, as Qwen's), a few merges, then <|endoftext|>, the role markers and the tool
    tags as Qwen2.5 has them."""
    from transformers import Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {symbol: index for index, symbol in enumerate(bytes_to_unicode().values())}
    merges = [("\u010a", "\u010a"), ("Ġ", "t"), ("a", "s"), ("as", "s"), ("ass", "i")]
    for left, right in merges:
        vocab[left + right] = len(vocab)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges)
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS})
    tokenizer.add_tokens(ADDED_TOKENS)
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.chat_template = QWEN25_CHAT_TEMPLATE
    return tokenizer
