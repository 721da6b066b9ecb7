"""A sequence: one continuation of one request, and the request that groups them.

Prefill and decode are not separate states: a sequence simply has tokens whose KV is not
computed yet (`num_pending`). A step computes some of them; when none remain, the step's
logits for its last token are sampled and the new token becomes pending in turn.

With overlapped steps a sampled token is appended before its value reaches the host: it
stands in `token_ids` as `PENDING_TOKEN` (at most two trail a sequence: the input of the step
on the device and that step's output) until the step is synced, and the next step reads its
value from the device. Everything the host shows or hashes skips those placeholders.
"""

from __future__ import annotations

import enum
import functools
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from orchard.node.detokenizer import IncrementalDetokenizer
from orchard.node.types import CompletionOutput, SamplingParams, TokenLogprob


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_arrivals = itertools.count()

#: A sampled token whose value is still on the device.
PENDING_TOKEN = -1


@dataclass(eq=False)
class Sequence:
    seq_id: str
    request: Request
    index: int
    token_ids: list[int]
    detokenizer: IncrementalDetokenizer
    num_computed: int = 0
    status: Status = Status.WAITING
    swapped: bool = False  # blocks live in the cold tier, resume by copy
    prefetched: bool = False  # the cold tier was asked to fault its blocks in
    block_hashes: tuple | None = None  # (token count, full-block hashes) cached for admission checks
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    text: str = ""  # accepted text, stop strings cut off
    sent_text_len: int = 0
    sent_tokens: int = 0
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    first_token_time: float | None = None
    num_unresolved: int = 0  # trailing PENDING_TOKEN placeholders
    device_row: int = 0  # row of the in-flight step's sampled tokens that holds the newest placeholder
    last_in_flight: bool = False  # the in-flight token is its last (length limit): schedule nothing more
    matcher: Any = None  # a constrained continuation's grammar state, fed each settled token (orchard/node/structured.py)

    # A request's params and prompt never change; cached, they cost a dict lookup, not a call,
    # on the per-sequence paths every step walks.
    @functools.cached_property
    def params(self) -> SamplingParams:
        return self.request.params

    @functools.cached_property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_pending(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def output_token_ids(self) -> list[int]:
        """Output tokens whose values are known on the host (a copy: O(outputs) per call)."""
        return self.token_ids[self.num_prompt_tokens : len(self.token_ids) - self.num_unresolved]

    @property
    def num_known_outputs(self) -> int:
        """len(output_token_ids), without copying them."""
        return len(self.token_ids) - self.num_unresolved - self.num_prompt_tokens

    @property
    def num_output_tokens(self) -> int:
        """Output tokens sampled so far, placeholders included: the next sample's position."""
        return len(self.token_ids) - self.num_prompt_tokens

    def drop_unresolved(self) -> None:
        """Forget placeholders whose step no longer counts (the sequence finished or was aborted)."""
        if self.num_unresolved:
            del self.token_ids[-self.num_unresolved :]
            self.num_unresolved = 0

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def take_delta(self, final: bool, holdback: int) -> CompletionOutput:
        """What is new since the last call; text near the end is held back while a stop string could still match."""
        visible = len(self.text) if final else max(self.sent_text_len, len(self.text) - holdback)
        outputs = self.output_token_ids
        out = CompletionOutput(
            index=self.index,
            text=self.text[:visible],
            token_ids=outputs,
            text_delta=self.text[self.sent_text_len : visible],
            token_ids_delta=outputs[self.sent_tokens :],
            logprobs_delta=self.pending_logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )
        self.sent_text_len = visible
        self.sent_tokens = len(outputs)
        self.pending_logprobs = []
        return out


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    arrival_order: int = field(default_factory=lambda: next(_arrivals))
    sequences: list[Sequence] = field(default_factory=list)
    num_cached_tokens: int = 0
    seed: int = 0  # the request's seed, or one the engine drew for it
    forked: bool = False  # the n > 1 continuations have been created
    grammar: Any = None  # the constraint's matcher at the output's start; each continuation works on a copy

    @functools.cached_property
    def stop_holdback(self) -> int:
        """Characters of new text held back while a stop string could still complete across them."""
        return max((len(s) for s in self.params.stop), default=1) - 1

    @functools.cached_property
    def plain_greedy(self) -> bool:
        """One greedy continuation without penalties, grammar or log-probs: its token is the logits' argmax."""
        p = self.params
        return p.n == 1 and p.greedy and not p.has_penalty and p.logprobs is None and p.constraint is None

    @property
    def sort_key(self) -> tuple[int, int]:
        """Lower runs first: priority, then first come, first served."""
        return (self.params.priority, self.arrival_order)

    @property
    def finished(self) -> bool:
        if len(self.sequences) == 1 and self.params.n == 1:  # the common case, asked every step
            return self.sequences[0].status is Status.FINISHED
        return (self.forked or self.params.n == 1) and all(s.finished for s in self.sequences)
