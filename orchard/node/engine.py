"""The single-machine engine: continuous batching over the paged KV pool.

`step()` is the whole loop body: schedule under the token budget, run one packed forward
pass for every scheduled chunk (prefill chunks and decodes together), sample the
sequences whose pending tokens are all computed, register their full blocks in the
prefix cache, and report what changed. It has no threads and no Ray: `AsyncEngine` and
the node actor drive it.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import mlx.core as mx
import numpy as np

from orchard.kvcache import CacheConfig, KVCache
from orchard.kvcache.state_pool import StatePool
from orchard.node.detokenizer import IncrementalDetokenizer
from orchard.node.errors import DuplicateRequest, InvalidPrompt, PromptTooLong
from orchard.node.model.loader import LoadedModel, load_model
from orchard.node.model.residency import wire_model_and_pool
from orchard.node.model.runner import ModelRunner, SequenceChunk, StepInput, pack_decode, pack_step
from orchard.node.model.state_layers import probe_state_shapes
from orchard.node.rates import NodeRates
from orchard.node.sampling import DeviceSample, SampleRow, argmax_on_device, sample_on_device
from orchard.node.scheduler import PreemptionNeeded, ScheduledChunk, Scheduler, SchedulerConfig, SchedulerOutput
from orchard.node.sequence import PENDING_TOKEN, Request, Sequence, Status
from orchard.node.structured import GrammarMasks
from orchard.node.types import RequestOutput, SamplingParams

#: Tokens per step on a GPU and on a CPU, measured best end to end (docs/benchmarks.md, "engine on
#: the H200"): on the H200 1,024 beat 512 (1B burst 3.12x against 1.97x of mlx-lm, prefill 2.33x
#: against 1.33x) and 2,048 (8B burst 1.64x, its TTFT p99 worse than mlx-lm's); on CPUs 512.
GPU_TOKEN_BUDGET = 1024
CPU_TOKEN_BUDGET = 512
#: A hybrid model's prompt chunks stop at every multiple of this many blocks, where its recurrent
#: state is snapshotted (besides each prompt's last full block and each finished sequence's last
#: boundary): a shared system prompt of 256 tokens or more resumes from its first 256.
STATE_SNAPSHOT_BLOCKS = 16


def device_token_budget() -> int:
    """The step token budget for the device MLX computes on (a Mac's GPU, CUDA, or the CPU)."""
    return GPU_TOKEN_BUDGET if mx.default_device().type == mx.DeviceType.gpu else CPU_TOKEN_BUDGET


@dataclass
class EngineConfig:
    model: str | None = None  # local path or hub id; None = the bundled demo model
    block_size: int = 16
    num_blocks: int | None = None
    kv_memory_gb: float | None = None
    memory_fraction: float = 0.3
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None  # None: the device's (`device_token_budget`)
    max_model_len: int | None = None
    dtype: str | None = None  # KV dtype; follows the model when None
    cold_tier_dir: str | None = None
    cold_tier_gb: float = 4.0
    preemption: str = "auto"  # "auto" (measured cost), "swap" or "recompute"
    cache_salt: str | None = None
    enable_prefix_caching: bool = True  # False: no prompt reuses another's blocks (vLLM's flag)
    seed: int = 0
    # Overlap host work for step N+1 with the device's step N (vLLM's async scheduling). On a GPU and
    # on the CPU alike it pays: on this project's 2-core VM 32 streaming clients got 1.64x / 1.72x
    # mlx_lm.server's output tok/s overlapped, 1.56x / 1.55x step by step, over Ray / without (medians of
    # five rounds, docs/benchmarks.md, "Overlapped steps on the CPU"). Off,
    # each token leaves the step that computed it: a lone request's first token one step sooner.
    async_scheduling: bool = True
    # Decode-only steps replayed from compiled graphs (node.model.compiled_decode); None: where the
    # attention runs a compiled kernel (Metal, CUDA), not on the reference backend.
    compiled_decode: bool | None = None
    # Settle step N (tokens into sequences, stop rules, detokenizing, outputs) on a second thread
    # while this one encodes step N+1's kernels, which MLX does with the GIL released; None: where
    # decode graphs are compiled (a GPU), whose steps are bound by that host work.
    settle_in_thread: bool | None = None
    # Trace the compiled decode graphs of every batch size and context up to this many tokens
    # before serving (`LLMEngine.warm_up`), so no live step stalls on a trace; 0: trace lazily.
    warm_up_context: int = 4096

    def __post_init__(self):
        if self.preemption not in ("auto", "swap", "recompute"):
            raise ValueError(f"preemption must be auto, swap or recompute, got {self.preemption!r}")

    def for_device(self) -> EngineConfig:
        """This config with what it leaves to the device filled in for the one MLX computes on in
        this process. The engine calls it where it runs: a config made on a Ray head serves nodes
        whose devices may differ from the head's."""
        return replace(
            self,
            max_num_batched_tokens=device_token_budget() if self.max_num_batched_tokens is None else self.max_num_batched_tokens,
        )

    def cache_config(self) -> CacheConfig:
        return CacheConfig(
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            kv_memory_gb=self.kv_memory_gb,
            memory_fraction=self.memory_fraction,
            dtype=self.dtype,
            cold_tier_dir=self.cold_tier_dir,
            cold_tier_gb=self.cold_tier_gb,
            cache_salt=self.cache_salt,
            enable_prefix_caching=self.enable_prefix_caching,
        )


@dataclass
class _InFlightStep:
    """A launched step: what to commit and whose placeholders its samples resolve, once settled."""

    commits: list  # (sequence, tokens of KV it holds after this step)
    owners: list  # the sequence each sample row belongs to
    sample: DeviceSample
    launched_at: float
    prefill_tokens: int
    decode_tokens: int

    def start(self, settled_elsewhere: bool = False) -> None:
        """Queue the step's graph on the device (MLX encodes its kernels here, the GIL released);
        `settled_elsewhere`: a settle thread will read the tokens while this thread encodes the next step."""
        mx.async_eval(*self.sample.outputs(host_copy=settled_elsewhere))


@dataclass
class _StepCounters:
    steps: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    forward_seconds: float = 0.0
    step_seconds: float = 0.0
    finished_requests: int = 0
    aborted_requests: int = 0
    # Where step time goes (host scheduling, packing the step, building the lazy graph,
    # waiting for the device, sampling + bookkeeping): the profile behind step overhead.
    schedule_seconds: float = 0.0
    pack_seconds: float = 0.0
    graph_seconds: float = 0.0
    device_seconds: float = 0.0


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, *, loaded: LoadedModel | None = None):
        self.config = (config or EngineConfig()).for_device()
        self.model = loaded or load_model(self.config.model)
        self.tokenizer = self.model.tokenizer
        geometry = self.model.geometry(self.config.block_size, self.config.dtype)
        states = hybrid_state_pool(self.model, self.config.max_num_seqs)
        cache_config = self.config.cache_config()
        self.kv = KVCache(geometry, cache_config, states=states)
        self._snapshots_on = states is not None and cache_config.enable_prefix_caching
        self.runner = ModelRunner(self.model, self.kv.pool, compiled_decode=self.config.compiled_decode, states=states)
        # a hybrid model's states: the pool's slots and as many snapshots (kvcache.state_snapshots)
        state_bytes = 2 * states.nbytes if states is not None else 0
        wire_model_and_pool(self.model.model, self.kv.pool.nbytes + state_bytes)
        self.max_model_len = min(self.config.max_model_len or self.model.max_context_length, self.model.max_context_length)
        self.eos_token_ids = set(self.model.eos_token_ids)
        self.rates = NodeRates.new()
        self.scheduler = Scheduler(
            SchedulerConfig(self.config.max_num_seqs, self.config.max_num_batched_tokens,
                            state_interval=STATE_SNAPSHOT_BLOCKS * self.config.block_size if states is not None else None),
            self.kv,
            self._should_swap,
        )
        self.requests: dict[str, Request] = {}
        self._aborted: list[RequestOutput] = []
        self._in_flight: _InFlightStep | None = None
        self._rng = np.random.default_rng(self.config.seed)
        self.counters = _StepCounters()
        self.grammars = GrammarMasks(self.tokenizer, self.model.vocab_size, self.eos_token_ids)
        threaded = self.config.settle_in_thread
        if threaded is None:
            threaded = self.runner.compiled_decode is not None
        # A hybrid model's settle stores state snapshots (MLX work), so it stays on the engine's thread.
        self._settler = ThreadPoolExecutor(1, "orchard-settle") if threaded and not self._snapshots_on else None
        self._settled_elsewhere: _InFlightStep | None = None

    def warm_up(self) -> int:
        """Trace the compiled decode graphs the node will meet (batches up to `max_num_seqs`,
        contexts up to `warm_up_context`) before serving; call it in the thread that steps the
        engine (MLX's streams are per thread). Returns how many graphs were new."""
        compiled = self.runner.compiled_decode
        context = min(self.config.warm_up_context, self.max_model_len)
        if compiled is None or context <= 0:
            return 0
        return compiled.warm_up(self.kv.pool, self.config.max_num_seqs, -(-context // self.config.block_size))

    def close(self) -> None:
        """Stop the settle thread (the engine steps no more); a dropped engine's thread would
        otherwise end only once the collector finds the engine."""
        if self._settler is not None:
            self._settler.shutdown(wait=True)
            self._settler = None

    # -- requests -------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | None = None) -> None:
        params = params or SamplingParams()
        if request_id in self.requests:
            raise DuplicateRequest(f"request id {request_id!r} is already in the engine")
        self._check_prompt(prompt_token_ids)
        request = Request(request_id, list(prompt_token_ids), params, grammar=self.grammars.start(params, prompt_token_ids))
        request.seed = params.seed if params.seed is not None else int(self._rng.integers(2**62))
        request.sequences.append(self._new_sequence(request, 0))
        self.requests[request_id] = request
        self.counters.prompt_tokens += len(prompt_token_ids)
        self.scheduler.add(request.sequences[0])

    def _check_prompt(self, prompt_token_ids: list[int]) -> None:
        if not prompt_token_ids:
            raise InvalidPrompt("the prompt is empty")
        if len(prompt_token_ids) >= self.max_model_len:
            raise PromptTooLong(len(prompt_token_ids), self.max_model_len)
        vocab = self.model.vocab_size
        bad = next((t for t in prompt_token_ids if not 0 <= int(t) < vocab), None)
        if bad is not None:
            raise InvalidPrompt(f"token id {bad} is outside the vocabulary (0..{vocab - 1})")

    def _new_sequence(self, request: Request, index: int, token_ids: list[int] | None = None) -> Sequence:
        return Sequence(
            seq_id=f"{request.request_id}/{index}",
            request=request,
            index=index,
            token_ids=list(token_ids if token_ids is not None else request.prompt_token_ids),
            detokenizer=IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids),
            matcher=request.grammar.deep_copy() if request.grammar is not None else None,
        )

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its blocks now; its final output says `abort`."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        for seq in request.sequences:
            self._release(seq)
            if not seq.finished:
                seq.finish_reason = "abort"
            seq.status = Status.FINISHED
        self.counters.aborted_requests += 1
        self._aborted.append(self._output(request, final=True))
        return True

    def _release(self, seq: Sequence) -> None:
        if seq.status is Status.RUNNING or (seq.status is Status.WAITING and seq.swapped):
            if seq.status is Status.WAITING:
                self.kv.forget_swapped(seq.seq_id)
            else:
                self.kv.free(seq.seq_id)
        self.scheduler.remove(seq)
        seq.drop_unresolved()

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests) or self._in_flight is not None

    # -- the loop body -----------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Launch the next step on the device, then settle the one launched before it.

        With `async_scheduling` the host schedules and builds step N+1 while the device
        still runs step N, whose sampled tokens feed step N+1 on the device; only then does
        it wait for N's tokens. Outputs arrive one step later; the tokens are the same. A
        schedule that needs N's values on the host first (penalties, a preemption) settles N.
        """
        try:
            return self._step()
        except Exception:
            self._in_flight = None  # a failed step's samples will never arrive
            raise

    def _step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        outputs, self._aborted = self._aborted, []
        sched = self._schedule(outputs)
        self.counters.schedule_seconds += time.perf_counter() - t0
        launched = self._launch(sched) if sched.chunks else None
        previous, self._in_flight = self._in_flight, None
        outputs += self._start_and_settle(launched, previous)
        self._in_flight = launched
        if launched is not None and not self.config.async_scheduling:
            outputs += self._settle_in_flight()
        if launched is not None:
            self.counters.steps += 1
        self.counters.step_seconds += time.perf_counter() - t0
        return outputs

    def _schedule(self, outputs: list[RequestOutput]) -> SchedulerOutput:
        flight = self._in_flight
        if flight is not None and any(s.params.reads_outputs for s in flight.owners):
            outputs += self._settle_in_flight()  # penalties and grammars read the tokens still in flight
        if self._in_flight is None:
            return self.scheduler.schedule()
        try:
            return self.scheduler.schedule(preempt=False)
        except PreemptionNeeded:
            outputs += self._settle_in_flight()  # a preempted sequence must not hold placeholders
            return self.scheduler.schedule()

    def _start_and_settle(self, launched: _InFlightStep | None, previous: _InFlightStep | None) -> list[RequestOutput]:
        """Start the new step on the device, then settle the one before it.

        With a settle thread the previous step is settled there while this thread encodes the
        new step's kernels: on a GPU that encoding is most of a step's host time, and the
        settling, Python, would otherwise wait for it. The new step's bookkeeping is done before
        either starts, and no other engine state is touched until both are done, so the tokens
        and outputs are those of settling after the start. A step whose rows want log-probs
        settles here, since turning them into values is more MLX work.
        """
        if self._settler is None or launched is None:  # `_launch` started it, or there is none
            return self._settle(previous)
        if previous is None or previous.sample.raw_logprobs is not None:
            launched.start(settled_elsewhere=True)
            return self._settle(previous)
        pending = self._settler.submit(self._settle, previous)
        try:
            launched.start(settled_elsewhere=True)
        finally:
            outputs = pending.result()
        # Kept one step more, so its MLX arrays are freed on this thread, never by the settle
        # thread (whose last reference may drop after it answered) while this one encodes.
        self._settled_elsewhere = previous
        return outputs

    def _launch(self, sched: SchedulerOutput) -> _InFlightStep:
        """Build the step's graph, do its bookkeeping, and queue it on the device unless a settle
        thread will (`_start_and_settle`); nothing here waits for the device."""
        t_pack = time.perf_counter()
        step = build_step_input(sched.chunks, self.kv, self.config.block_size)
        tokens = self._device_tokens(sched.chunks, step)
        t0 = time.perf_counter()
        decode = sum(1 for c in sched.chunks if c.num_tokens == 1 and c.seq.num_computed >= c.seq.num_prompt_tokens)
        logits = self.runner.forward(step, tokens=tokens)
        completing = [i for i, c in enumerate(sched.chunks) if c.completes]
        if completing and len(completing) < len(sched.chunks):
            logits = logits[mx.array(completing)]
        commits = []  # chunks whose input holds a placeholder: committed once its value is known
        for chunk in sched.chunks:
            seq = chunk.seq
            seq.num_computed += chunk.num_tokens
            if seq.num_unresolved:
                commits.append((seq, seq.num_computed))
            else:  # later steps run after this one on the device, so they may reuse these blocks now
                self.kv.commit(seq.seq_id, seq.token_ids, seq.num_computed)
        owners, sample = self._sample_on_device([sched.chunks[i].seq for i in completing], logits)
        flight = _InFlightStep(commits, owners, sample, t0, sched.num_tokens - decode, decode)
        if self._settler is None:  # else started beside the settling of the step before it
            flight.start()
        if self._snapshots_on:
            self._snapshot_states(sched.chunks)
        for row, seq in enumerate(owners):
            seq.token_ids.append(PENDING_TOKEN)
            seq.num_unresolved += 1
            seq.device_row = row
            seq.last_in_flight = seq.num_output_tokens >= seq.params.max_tokens or seq.num_tokens >= self.max_model_len
        self.counters.pack_seconds += t0 - t_pack
        self.counters.graph_seconds += time.perf_counter() - t0
        return flight

    def _snapshot_states(self, chunks: list[ScheduledChunk]) -> None:
        """A hybrid model's state at each block boundary a chunk just reached: stored now within the
        prompt (its tokens are known), else only the last one, when the sequence finishes. Storing
        every boundary of an answer would crowd the prompts' snapshots out of the pool, whether or
        not the answer's tokens are known yet (step by step they are)."""
        for chunk in chunks:
            seq = chunk.seq
            if seq.num_computed % self.config.block_size == 0:
                self.kv.capture_state(seq.seq_id, seq.num_computed)
                if seq.num_computed <= seq.num_prompt_tokens and not seq.num_unresolved:
                    self.kv.publish_state(seq.seq_id, seq.token_ids)

    def _device_tokens(self, chunks: list[ScheduledChunk], step: StepInput) -> mx.array | None:
        """The step's input ids; a placeholder's value is read from the in-flight step's samples."""
        ids = np.asarray(step.token_ids, dtype=np.int32)
        pending = ids == PENDING_TOKEN
        if not pending.any():
            return None
        previous = self._in_flight.sample.tokens
        if pending.all() and ids.size == len(chunks) == previous.shape[0] and all(
            c.seq.device_row == i for i, c in enumerate(chunks)
        ):
            return previous  # a steady decode batch: last step's samples, in order, are this step's input
        rows = np.zeros_like(ids)
        ends = np.asarray(step.query_start_loc[1:]) - 1
        for end, chunk in zip(ends, chunks):
            if pending[end]:
                rows[end] = chunk.seq.device_row
        return mx.where(mx.array(pending), mx.take(previous, mx.array(rows)), mx.array(ids))

    def _settle_in_flight(self) -> list[RequestOutput]:
        flight, self._in_flight = self._in_flight, None
        return self._settle(flight)

    def _settle(self, flight: _InFlightStep | None) -> list[RequestOutput]:
        """Wait for a launched step's tokens, commit its KV, and turn its tokens into outputs."""
        if flight is None:
            return []
        t0 = time.perf_counter()
        tokens, logprobs = flight.sample.resolve()
        now = time.perf_counter()
        self.counters.device_seconds += now - t0
        self.counters.forward_seconds += now - flight.launched_at
        self.rates.observe_step(now - flight.launched_at, flight.prefill_tokens, flight.decode_tokens)
        for seq, computed in flight.commits:
            if not seq.finished:  # finished or aborted meanwhile: its blocks are already free
                self.kv.commit(seq.seq_id, seq.token_ids, computed)
        touched: dict[str, Request] = {}
        for seq, token, lp in zip(flight.owners, tokens, logprobs):
            if seq.finished:
                continue
            self._resolve_token(seq, token, lp)
            touched[seq.request.request_id] = seq.request
        return [self._request_output(request) for request in touched.values()]

    def _request_output(self, request: Request) -> RequestOutput:
        finished = request.finished
        out = self._output(request, final=finished)
        if finished:
            self.requests.pop(request.request_id, None)
            self.counters.finished_requests += 1
        return out

    def _sample_on_device(self, seqs: list[Sequence], logits: mx.array) -> tuple[list[Sequence], DeviceSample]:
        """One sample row per continuation: a request's first sample forks its n - 1 siblings."""
        if all(s.request.plain_greedy for s in seqs):
            return seqs, argmax_on_device(logits)
        rows: list[SampleRow] = []
        owners: list[Sequence] = []
        row_logits: list[int] = []
        for i, seq in enumerate(seqs):
            for target in self._fork_if_first(seq):
                owners.append(target)
                row_logits.append(i)
                rows.append(self._sample_row(target))
        if len(owners) != len(seqs):
            logits = logits[mx.array(row_logits)]
        logits = self.grammars.apply(logits, [s.matcher for s in owners])
        return owners, sample_on_device(logits, rows)

    def _fork_if_first(self, seq: Sequence) -> list[Sequence]:
        """At a request's first sample, create its n - 1 other continuations sharing the prompt's blocks."""
        request = seq.request
        if request.params.n == 1 or request.forked:
            return [seq]
        request.forked = True
        for index in range(1, request.params.n):
            child = self._new_sequence(request, index, seq.token_ids)
            child.num_computed = seq.num_computed
            self.kv.fork(seq.seq_id, child.seq_id)
            request.sequences.append(child)
            self.scheduler.add_running(child)
        return list(request.sequences)

    def _sample_row(self, seq: Sequence) -> SampleRow:
        return SampleRow(
            params=seq.params,
            seed=seq.request.seed,
            index=seq.index,
            position=seq.num_output_tokens,
            prompt_token_ids=seq.request.prompt_token_ids,
            output_token_ids=seq.output_token_ids if seq.params.has_penalty else (),
        )

    def _resolve_token(self, seq: Sequence, token: int, logprob) -> None:
        """Put a sampled token's value in place of its placeholder and apply the stop rules."""
        seq.token_ids[len(seq.token_ids) - seq.num_unresolved] = token
        seq.num_unresolved -= 1
        if seq.first_token_time is None:
            seq.first_token_time = time.monotonic()
        self.counters.generated_tokens += 1
        if logprob is not None:
            seq.pending_logprobs.append(logprob)
        params = seq.params
        if token in self.eos_token_ids and not params.ignore_eos:
            return self._finish(seq, "stop", None)
        if token in params.stop_token_ids:
            return self._finish(seq, "stop", token)
        delta = seq.detokenizer.add(token)
        if delta:
            seq.text += delta
            if params.stop and self._cut_at_stop(seq, len(delta)):
                return None
        if seq.matcher is not None and (done := self.grammars.advance(seq.matcher, token)):
            return self._finish(seq, done, None)
        known = len(seq.token_ids) - seq.num_unresolved
        if seq.num_known_outputs >= params.max_tokens or known >= self.max_model_len:
            return self._finish(seq, "length", None)
        return None

    def _cut_at_stop(self, seq: Sequence, delta_len: int) -> bool:
        longest = max(len(s) for s in seq.params.stop)
        start = max(0, len(seq.text) - delta_len - longest + 1)
        hits = [(seq.text.find(s, start), s) for s in seq.params.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return False
        index, stop = min(hits)
        seq.text = seq.text[:index]
        self._finish(seq, "stop", stop)
        return True

    def _finish(self, seq: Sequence, reason: str, stop_reason) -> None:
        seq.drop_unresolved()
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        if self._snapshots_on:
            self.kv.publish_state(seq.seq_id, seq.token_ids)  # where a next turn resumes
        self.kv.free(seq.seq_id)
        self.scheduler.remove(seq)
        seq.status = Status.FINISHED

    def _output(self, request: Request, final: bool) -> RequestOutput:
        holdback = request.stop_holdback
        return RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[s.take_delta(final or s.finished, holdback) for s in request.sequences],
            num_cached_tokens=request.num_cached_tokens,
            finished=final,
        )

    # -- preemption and introspection ---------------------------------------------------

    def _should_swap(self, seq: Sequence) -> bool:
        """Swap to the cold tier when restoring is expected to beat recomputing."""
        if self.kv.cold is None or self.kv.states is not None or self.config.preemption == "recompute":
            return False  # a hybrid sequence resumes from its last state snapshot instead
        if self.config.preemption == "swap":
            return True
        tokens = seq.num_computed
        restore = tokens * self.kv.geometry.bytes_per_token * self.rates.restore_s_per_byte.get(0.0)
        recompute = tokens * self.rates.prefill_s_per_token.get(float("inf"))
        return restore < recompute

    def export_blocks(self, hashes) -> bytes:
        return self.kv.export_blocks(hashes)

    def import_blocks(self, payload: bytes) -> int:
        return self.kv.import_blocks(payload)

    def drain_kv_events(self):
        return self.kv.drain_events()

    def kv_snapshot(self):
        return self.kv.snapshot()

    def stats(self) -> dict:
        kv = self.kv.stats()
        c = self.counters
        return {
            "waiting": len(self.scheduler.waiting),
            "running": len(self.scheduler.running),
            "requests": len(self.requests),
            "preemptions": self.scheduler.num_preemptions,
            "swaps": self.scheduler.num_swaps,
            "kv": kv.to_dict() if hasattr(kv, "to_dict") else dict(vars(kv)),
            "prefill_s_per_token": self.rates.prefill_s_per_token.value,
            "prefill_marginal_s_per_token": self.rates.prefill_line.marginal_s_per_token,
            "decode_s_per_token": self.rates.decode_s_per_token.value,
            "steps": c.steps,
            "generated_tokens": c.generated_tokens,
            "forward_seconds": c.forward_seconds,
            "step_seconds": c.step_seconds,
            "finished_requests": c.finished_requests,
            "aborted_requests": c.aborted_requests,
        }


def build_step_input(chunks: list[ScheduledChunk], kv: KVCache, block_size: int) -> StepInput:
    """The scheduled chunks as the packed batch the model runner takes."""
    if all(c.num_tokens == 1 for c in chunks):
        seqs = [c.seq for c in chunks]
        positions = [s.num_computed for s in seqs]
        return pack_decode([s.token_ids[p] for s, p in zip(seqs, positions)], positions,
                           [kv.block_table(s.seq_id) for s in seqs], block_size,
                           kv.state_slots([s.seq_id for s in seqs]))
    return pack_step(
        [
            SequenceChunk(
                token_ids=c.seq.token_ids[c.seq.num_computed : c.seq.num_computed + c.num_tokens],
                start=c.seq.num_computed,
                block_table=kv.block_table(c.seq.seq_id),
            )
            for c in chunks
        ],
        block_size,
        kv.state_slots([c.seq.seq_id for c in chunks]),
    )


def hybrid_state_pool(loaded: LoadedModel, max_num_seqs: int) -> StatePool | None:
    """A state slot per sequence the scheduler may run (forks included), for a model with
    recurrent-state layers (node.model.state_layers); None for a model of attention layers only."""
    shapes = probe_state_shapes(loaded.model, getattr(mx, loaded.dtype))
    return StatePool(shapes, 2 * max_num_seqs + 1) if shapes else None
