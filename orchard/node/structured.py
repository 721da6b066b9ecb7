"""Structured output at sampling: each constrained continuation's grammar state as a token mask.

The engine holds one `GrammarMasks`. A constrained request gets a matcher when it is added
(a grammar the tokenizer cannot serve is refused there, before anything is queued); each of
its `n` continuations works on its own copy. At a step, the masks of every constrained row
are filled in one batched llguidance call while the device computes the logits, then applied
to those rows only: unconstrained rows keep their logits, and no mask is built for them. A
matcher advances when its token's value reaches the host, so the engine settles an overlapped
step before it masks the next one (`SamplingParams.reads_outputs`, as penalties do).

EOS is just another token of the mask: llguidance allows it only where the grammar accepts.
A continuation whose grammar can take nothing more ends there ("stop"), without spending a
step on EOS. Logprobs, when asked for, are those of the masked distribution. Preemption keeps
a sequence's outputs, and so its matcher, which stays valid whether the KV is swapped or
recomputed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence

import llguidance
import llguidance.hf
import llguidance.numpy as lln
import mlx.core as mx
import numpy as np

from orchard.node.constraint import UnsupportedConstraint
from orchard.node.types import SamplingParams

log = logging.getLogger("orchard.node")


class GrammarMasks:
    """The engine's grammar side: llguidance's view of the tokenizer (built on first use) and the batched masks."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Iterable[int]):
        self._hf_tokenizer = getattr(tokenizer, "_tokenizer", tokenizer)  # mlx-lm wraps the HF tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._executor: llguidance.LLExecutor | None = None
        self.fill_seconds = 0.0  # host time in mask fills, and how many rows they filled (orchard/cluster/bench/grammar.py)
        self.filled_rows = 0

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:  # about a second for a 128k vocabulary: only once a grammar is asked for
            self._tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_token_ids)
        return self._tokenizer

    @property
    def executor(self) -> llguidance.LLExecutor:
        if self._executor is None:  # llguidance's thread pool for batched fills, started with the first one
            self._executor = llguidance.LLExecutor()
        return self._executor

    def start(self, params: SamplingParams, prompt_token_ids: Sequence[int]) -> llguidance.LLMatcher | None:
        """A matcher at the start of the output, or None for an unconstrained request.

        A resumed request's trailing prompt tokens are its earlier attempt's outputs: they were
        generated under the grammar, so the matcher walks them first.
        """
        if params.constraint is None:
            return None
        matcher = llguidance.LLMatcher(self.tokenizer, params.constraint.grammar, log_level=0)
        if params.resumed_outputs:
            matcher.consume_tokens(list(prompt_token_ids[len(prompt_token_ids) - params.resumed_outputs :]))
        if matcher.is_error():
            raise UnsupportedConstraint(matcher.get_error())
        return matcher

    def apply(self, logits: mx.array, matchers: Sequence[llguidance.LLMatcher | None]) -> mx.array:
        """Mask row i of `logits` `[rows, vocab]` by matcher i; rows whose matcher is None pass unchanged."""
        targets = [(m, i) for i, m in enumerate(matchers) if m is not None]
        if not targets:
            return logits
        mx.async_eval(logits)  # the device computes the logits while the host fills the masks
        if len(targets) == len(matchers):
            return apply_bitmask(logits, self.fill(targets, len(matchers)))
        rows = mx.array([i for _, i in targets])  # only the constrained rows are read and written
        bitmask = self.fill([(m, j) for j, (m, _) in enumerate(targets)], len(targets))
        logits[rows] = apply_bitmask(logits[rows], bitmask)
        return logits

    def fill(self, targets: list[tuple[llguidance.LLMatcher, int]], rows: int) -> np.ndarray:
        """One batched llguidance call: the mask of each (matcher, row) into an all-allowed bitmask."""
        t0 = time.perf_counter()
        bitmask = lln.allocate_token_bitmask(rows, self.vocab_size)
        lln.fill_next_token_bitmask_par(self.executor, targets, bitmask)
        self.fill_seconds += time.perf_counter() - t0
        self.filled_rows += len(targets)
        return bitmask

    @staticmethod
    def advance(matcher: llguidance.LLMatcher, token: int) -> str | None:
        """Feed a sampled token; the finish reason when the output is complete (or the grammar broke)."""
        if not matcher.consume_token(token):
            log.warning("grammar refused a sampled token: %s", matcher.get_error())
            return "abort"
        return "stop" if matcher.is_stopped() else None


def apply_bitmask(logits: mx.array, bitmask: np.ndarray) -> mx.array:
    """Set to -inf every logit whose bit is 0 in `bitmask` `[rows, ceil(vocab / 32)]` (bit j of word w is token 32w + j).

    The bits are unpacked on the host (numpy's unpackbits, a few ms for 32 x 128k) and applied
    in one `where`: on CPUs that measured faster than shifting the words on the device.
    """
    rows, vocab = logits.shape
    assert bitmask.shape == (rows, (vocab + 31) // 32) and bitmask.dtype == np.int32, (bitmask.shape, logits.shape)
    allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :vocab].view(np.bool_)
    return mx.where(mx.array(allowed), logits, mx.array(-mx.inf, dtype=logits.dtype))
