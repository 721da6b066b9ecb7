"""Incremental, streaming-safe detokenization.

Decoding one token at a time breaks words that BPE splits across tokens and bytes of a
multi-byte character split across byte-level tokens. With a Rust tokenizer whose decode
needs no clean-up, the tokenizers library's `DecodeStream` does it in one call a token
(it buffers an incomplete character itself). Otherwise each step decodes a short window
twice — up to the last emitted token and up to the newest — and emits the difference,
holding back text that ends in U+FFFD (a character still incomplete). Both start from a
few prompt tokens of context, so a leading space decodes as it does inside the text.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers.decoders import DecodeStream

_INCOMPLETE = "\ufffd"
# Tokens of context kept before the emitted text, so leading spaces decode as in context.
_CONTEXT_TOKENS = 6


def rust_backend(tokenizer):
    """The Rust tokenizer under `tokenizer` when decoding with it gives the wrapper's text
    (no clean-up of spaces to apply on top); else None."""
    inner = getattr(tokenizer, "_tokenizer", tokenizer)
    backend = getattr(inner, "backend_tokenizer", None)
    if backend is not None and getattr(inner, "clean_up_tokenization_spaces", True) is False:
        return backend
    return None


def fast_decoder(tokenizer):
    """`decode(ids) -> str` without special tokens, straight from the Rust tokenizer when that gives
    the same text: the Python wrapper costs ~5x more per call."""
    backend = rust_backend(tokenizer)
    if backend is not None:
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: Sequence[int], decode=None):
        """`decode(ids) -> str`: a decoding of the caller's own (special tokens kept, say), run
        in the two-decode window; None: the tokenizer's text, by the Rust stream where it has one."""
        tail = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.text = ""
        self._backend = rust_backend(tokenizer) if decode is None else None
        if self._backend is not None:  # one Rust call a token
            self._stream = DecodeStream(ids=self._whole_characters(tail), skip_special_tokens=True)
            return
        self._decode = decode or fast_decoder(tokenizer)
        self._ids = tail
        self._prefix_offset = 0
        self._read_offset = len(tail)

    def _whole_characters(self, tail: list[int]) -> list[int]:
        """The context without trailing tokens that end inside a character: primed with those,
        the stream would replay the context's text once the character completes."""
        while tail and self._backend.decode(tail, skip_special_tokens=True).endswith(_INCOMPLETE):
            tail = tail[:-1]
        return tail

    def add(self, token_id: int) -> str:
        """Append one token; return the text it completes (possibly empty)."""
        if self._backend is not None:
            delta = self._stream.step(self._backend, token_id) or ""
            self.text += delta
            return delta
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
