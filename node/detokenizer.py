"""Incremental, streaming-safe detokenization.

Decoding one token at a time breaks words that BPE splits across tokens and bytes of a
multi-byte character split across byte-level tokens. So each step decodes a short window
twice — up to the last emitted token and up to the newest — and emits the difference,
holding back text that ends in U+FFFD (a character still incomplete).
"""

from __future__ import annotations

from collections.abc import Sequence

_INCOMPLETE = "\ufffd"
# Tokens of context kept before the emitted text, so leading spaces decode as in context.
_CONTEXT_TOKENS = 6


def fast_decoder(tokenizer):
    """`decode(ids) -> str` without special tokens, straight from the Rust tokenizer when that gives
    the same text: the Python wrapper costs ~5x more per call, and every sequence decodes twice a step."""
    inner = getattr(tokenizer, "_tokenizer", tokenizer)
    backend = getattr(inner, "backend_tokenizer", None)
    if backend is not None and getattr(inner, "clean_up_tokenization_spaces", True) is False:
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: Sequence[int], decode=None):
        self._decode = decode or fast_decoder(tokenizer)
        tail = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._ids = tail
        self._prefix_offset = 0
        self._read_offset = len(tail)
        self.text = ""

    def add(self, token_id: int) -> str:
        """Append one token; return the text it completes (possibly empty)."""
        self._ids.append(token_id)
        before = self._decode(self._ids[self._prefix_offset : self._read_offset])
        after = self._decode(self._ids[self._prefix_offset :])
        if after.endswith(_INCOMPLETE) or len(after) <= len(before):
            return ""
        delta = after[len(before) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self.text += delta
        return delta
