"""Iteration-level scheduling under a token budget.

Each step has a budget of tokens (`max_num_batched_tokens`). There are no prefill and
decode phases: every running sequence has some tokens whose KV is not computed yet — one
for a decoding sequence, many for a prompt — and the scheduler hands out the budget in
priority order (priority, then arrival): running sequences first, then waiting ones are
admitted while their blocks fit under the pool's watermark. A long prompt therefore takes
only what is left of the budget after the decodes, in chunks, and never stalls them.
When a running sequence cannot get a slot, the lowest-priority running sequence is
preempted (its blocks swapped to the cold tier or dropped for recompute) and goes back to
the front of the waiting queue; its prefix usually hits the cache when it returns.
A waiting sequence whose next uncached block is being computed right now by a running
sequence waits for it rather than computing the same prefix a second time: a burst of
requests sharing a system prompt then prefills that prompt once, not once per request.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, field

from orchard.node.sequence import Sequence, Status


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    # A hybrid model's state snapshot interval, in tokens (a multiple of the block size): prompt
    # chunks stop at each multiple of it, and a prompt's last chunk at its last full block, so the
    # engine can snapshot the recurrent state there (kvcache.state_snapshots).
    state_interval: int | None = None

    def __post_init__(self):
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be at least 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be at least 1")


@dataclass
class ScheduledChunk:
    seq: Sequence
    num_tokens: int

    @property
    def completes(self) -> bool:
        """True when this chunk computes the sequence's last pending token, so it is sampled."""
        return self.num_tokens == self.seq.num_pending


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class PreemptionNeeded(RuntimeError):
    """A schedule asked not to preempt would have had to."""


def _key(seq: Sequence) -> tuple[int, int, int]:
    return (*seq.request.sort_key, seq.index)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv, should_swap: Callable[[Sequence], bool]):
        self.config = config
        self.kv = kv
        self.should_swap = should_swap
        self.waiting: list[Sequence] = []  # sorted by _key
        self.running: list[Sequence] = []  # sorted by _key
        self.num_preemptions = 0
        self._may_preempt = True
        self.num_swaps = 0  # preemptions that kept their KV in the cold tier
        self._inflight: dict = {}  # block hash -> running sequences computing that block now
        self._computing: dict[Sequence, tuple[list, int]] = {}  # sequence -> (hashes it put in _inflight, tokens they cover)

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        bisect.insort(self.waiting, seq, key=_key)

    def add_running(self, seq: Sequence) -> None:
        """A forked continuation that already holds (shared) blocks."""
        seq.status = Status.RUNNING
        bisect.insort(self.running, seq, key=_key)

    def remove(self, seq: Sequence) -> None:
        """Forget a finished or aborted sequence; the caller frees its blocks."""
        self._stop_computing(seq)
        for queue in (self.running, self.waiting):
            if seq in queue:
                queue.remove(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, preempt: bool = True) -> SchedulerOutput:
        """The next step's chunks. With `preempt=False` a step that would need to preempt raises
        `PreemptionNeeded` before changing anything but slot reservations (which stay valid)."""
        self._retire_computed()
        out = SchedulerOutput()
        self._may_preempt = preempt
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted:
            self._admit_waiting(out, budget)
        self._prefetch_swapped()
        return out

    def _prefetch_swapped(self, lookahead: int = 4) -> None:
        """Ask the cold tier to fault in what the next admissions will restore.

        Issued a step ahead, the page-ins overlap this step's forward pass instead of
        stalling the step that resumes the sequence.
        """
        for seq in self.waiting[:lookahead]:
            if seq.swapped and not seq.prefetched:
                self.kv.prefetch(self.kv.block_hashes(seq.token_ids))
                seq.prefetched = True

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not Status.RUNNING or seq.last_in_flight:
                continue  # preempted earlier in this loop, or its last token is on the device
            n = self._chunk(seq, budget)
            if n == 0:
                continue
            if not self.kv.holds_slots(seq.seq_id, seq.num_computed + n):
                if not self._make_room(seq, seq.num_computed + n, out):
                    continue
                self.kv.ensure_slots(seq.seq_id, seq.num_computed + n)
            out.chunks.append(ScheduledChunk(seq, n))
            budget -= n
        return budget

    def _make_room(self, seq: Sequence, num_slots: int, out: SchedulerOutput) -> bool:
        """Preempt from the tail until `seq` can grow to `num_slots`; False if `seq` itself went."""
        while not self.kv.can_append(seq.seq_id, num_slots):
            if not self._may_preempt:
                raise PreemptionNeeded(seq.seq_id)
            victim = self.running[-1]
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._stop_computing(seq)
        swapped = False
        if seq.num_computed and self.should_swap(seq):
            swapped = self.kv.swap_out(seq.seq_id, seq.token_ids, seq.num_computed)
        else:
            self.kv.free(seq.seq_id)
        seq.swapped = swapped
        seq.prefetched = False
        seq.num_computed = 0
        self.num_preemptions += 1
        self.num_swaps += swapped
        self.add(seq)

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        for seq in list(self.waiting):
            if budget == 0 or len(self.running) >= self.config.max_num_seqs:
                return
            if self._prefix_in_flight(seq):
                continue  # its next block is being computed: admit it once that block is cached
            if not self.kv.can_allocate(seq.token_ids):
                return  # head-of-line: keep priority order rather than starve big prompts
            self.waiting.remove(seq)
            if seq.swapped:
                seq.num_computed = self.kv.swap_in(seq.seq_id, seq.token_ids)
                seq.swapped = False
            else:
                seq.num_computed = self.kv.allocate(seq.seq_id, seq.token_ids)
                if seq.index == 0 and not seq.request.forked:
                    seq.request.num_cached_tokens = seq.num_computed
            seq.status = Status.RUNNING
            bisect.insort(self.running, seq, key=_key)
            self._start_computing(seq)
            n = self._chunk(seq, budget)
            out.chunks.append(ScheduledChunk(seq, n))
            budget -= n

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """How many of the sequence's pending tokens this step computes: as many as the budget
        allows; for a hybrid model (`SchedulerConfig.state_interval`) no further than the next
        multiple of the interval, and a prompt's last chunk stops at its last full block, so the
        engine can snapshot the recurrent state at each."""
        n = min(seq.num_pending, budget)
        interval = self.config.state_interval
        if interval is None or n <= 1:
            return n
        start, end, known = seq.num_computed, seq.num_computed + n, len(seq.token_ids)
        mark = (start // interval + 1) * interval
        if mark < known and mark < end:
            return mark - start
        last = known - known % self.kv.block_size
        return last - start if end == known and start < last < end else n

    # -- prefixes being computed --------------------------------------------------------

    def _full_block_hashes(self, seq: Sequence) -> list:
        cached = seq.block_hashes
        if cached is None or cached[0] != len(seq.token_ids):
            cached = seq.block_hashes = (len(seq.token_ids), self.kv.block_hashes(seq.token_ids))
        return cached[1]

    def _prefix_in_flight(self, seq: Sequence) -> bool:
        """True when the first block of `seq` missing from the cache is being computed now."""
        if not self._inflight or seq.swapped:
            return False
        for block_hash in self._full_block_hashes(seq):
            if self.kv.manager.cached_block(block_hash) is None:
                return block_hash in self._inflight
        return False

    def _start_computing(self, seq: Sequence) -> None:
        full = self._full_block_hashes(seq)
        hashes = full[seq.num_computed // self.kv.block_size :]
        if hashes:
            self._computing[seq] = (hashes, len(full) * self.kv.block_size)
            for block_hash in hashes:
                self._inflight[block_hash] = self._inflight.get(block_hash, 0) + 1

    def _stop_computing(self, seq: Sequence) -> None:
        hashes, _ = self._computing.pop(seq, ((), 0))
        for block_hash in hashes:
            left = self._inflight[block_hash] - 1
            if left:
                self._inflight[block_hash] = left
            else:
                del self._inflight[block_hash]

    def _retire_computed(self) -> None:
        """Sequences whose announced blocks now all hold KV stop counting as computing them."""
        for seq in [s for s, (_, end) in self._computing.items() if s.num_computed >= end]:
            self._stop_computing(seq)
