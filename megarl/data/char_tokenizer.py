"""A character-level tokenizer, built locally and saved as a standard HF fast tokenizer."""

from __future__ import annotations

import string

SPECIAL_TOKENS = {"pad": "<pad>", "bos": "<s>", "eos": "</s>", "unk": "<unk>"}


def build_char_tokenizer():
    """Every printable ASCII character is one token, after the four special tokens; decoding joins them back."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    symbols = list(SPECIAL_TOKENS.values()) + sorted(set(string.printable) - set("\x0b\x0c\r"))
    vocab = {symbol: index for index, symbol in enumerate(symbols)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=SPECIAL_TOKENS["unk"]))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        **{f"{role}_token": token for role, token in SPECIAL_TOKENS.items()},
    )
