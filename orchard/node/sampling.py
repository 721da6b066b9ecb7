"""Turn one step's logits into tokens, for a batch whose rows want different things.

All rows are handled in a few vectorised MLX ops: penalties on the rows that ask for
them, then temperature, top-k, top-p and min-p as per-row thresholds, then Gumbel-max
with a key per row. A row's key depends only on (seed, continuation index, output
position), so a seeded request gives the same tokens whatever else shares its batch.
Greedy rows skip the noise and take the argmax of the penalised logits.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from orchard.node.types import SamplingParams, TokenLogprob


@dataclass
class SampleRow:
    """What the sampler needs to know about one sequence."""

    params: SamplingParams
    seed: int  # request seed, or one drawn by the engine for unseeded requests
    index: int  # which of the request's n continuations
    position: int  # number of output tokens so far
    prompt_token_ids: Seq[int]
    output_token_ids: Seq[int]  # read by penalties alone: a row without one may leave it empty

    @property
    def key_position(self) -> int:
        """The output position the noise is keyed by, counting the outputs of an earlier attempt."""
        return self.position + self.params.resumed_outputs

    @property
    def penalised_outputs(self) -> list[int]:
        """What presence and frequency penalties count: this attempt's outputs and an earlier one's."""
        earlier = self.params.resumed_outputs
        carried = list(self.prompt_token_ids[len(self.prompt_token_ids) - earlier:]) if earlier else []
        return carried + list(self.output_token_ids)


def row_key(seed: int, index: int, position: int) -> mx.array:
    state = np.random.SeedSequence([seed & 0xFFFFFFFF, seed >> 32 & 0xFFFFFFFF, index, position])
    return mx.random.key(int(state.generate_state(1, dtype=np.uint64)[0] >> 1))


def _apply_penalties(logits: mx.array, rows: list[SampleRow]) -> mx.array:
    if not any(r.params.has_penalty for r in rows):
        return logits
    vocab = logits.shape[-1]
    out = []
    for i, r in enumerate(rows):
        row = logits[i]
        p = r.params
        if p.presence_penalty or p.frequency_penalty:
            counts = _counts(r.penalised_outputs, vocab)
            row = row - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)
        if p.repetition_penalty != 1.0:
            seen = _counts(list(r.prompt_token_ids) + list(r.output_token_ids), vocab) > 0
            penalised = mx.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
            row = mx.where(seen, penalised, row)
        out.append(row)
    return mx.stack(out)


def _counts(token_ids: Seq[int], vocab: int) -> mx.array:
    if not token_ids:
        return mx.zeros((vocab,), mx.float32)
    return mx.zeros((vocab,), mx.float32).at[mx.array(list(token_ids))].add(1.0)


def _filter(scaled: mx.array, rows: list[SampleRow]) -> mx.array:
    """Mask what top-k, top-p and min-p exclude, as one threshold per row."""
    top_k = [r.params.top_k for r in rows]
    top_p = [r.params.top_p for r in rows]
    min_p = [r.params.min_p for r in rows]
    if not any(top_k) and all(p == 1.0 for p in top_p) and not any(min_p):
        return scaled
    vocab = scaled.shape[-1]
    desc = -mx.sort(-scaled, axis=-1)
    probs = mx.softmax(desc, axis=-1)
    keep = mx.arange(vocab)[None, :] < mx.array([k if k > 0 else vocab for k in top_k])[:, None]
    keep = keep & ((mx.cumsum(probs, axis=-1) - probs) < mx.array(top_p)[:, None])
    keep = keep & (probs >= mx.array(min_p)[:, None] * probs[:, :1])
    last_kept = mx.maximum(keep.sum(axis=-1) - 1, 0)
    threshold = mx.take_along_axis(desc, last_kept[:, None], axis=-1)
    return mx.where(scaled >= threshold, scaled, -mx.inf)


@dataclass
class DeviceSample:
    """One step's sampled tokens, still on the device; `resolve()` brings them to the host."""

    tokens: mx.array  # int32 [rows]
    raw_logprobs: mx.array | None
    rows: list[SampleRow]
    # The tokens as a node of their own (no copy), read by the host while the next step, whose
    # graph takes `tokens` as its input, is encoded on another thread: reading an MLX array
    # waits on its event and detaches it, which must not race with that encode reading it.
    host_tokens: mx.array | None = None

    def outputs(self, host_copy: bool) -> list[mx.array]:
        """What to evaluate for this sample; `host_copy`: also the host's own handle on the tokens."""
        if host_copy:
            self.host_tokens = mx.stop_gradient(self.tokens)
        extra = [self.host_tokens] if host_copy else []
        return [self.tokens, *extra, *([] if self.raw_logprobs is None else [self.raw_logprobs])]

    def resolve(self) -> tuple[list[int], list[TokenLogprob | None]]:
        token_list = (self.tokens if self.host_tokens is None else self.host_tokens).tolist()
        return token_list, _logprobs(self.raw_logprobs, self.rows, token_list)


def sample_on_device(logits: mx.array, rows: list[SampleRow]) -> DeviceSample:
    """Sample one token per row of `logits` `[rows, vocab]` without waiting for the device."""
    logits = logits.astype(mx.float32)
    want_logprobs = any(r.params.logprobs is not None for r in rows)
    raw_logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True) if want_logprobs else None
    logits = _apply_penalties(logits, rows)
    greedy = [r.params.greedy for r in rows]
    if all(greedy):
        tokens = mx.argmax(logits, axis=-1)
    else:
        temps = mx.array([1.0 if g else r.params.temperature for g, r in zip(greedy, rows)])[:, None]
        scaled = _filter(logits / temps, rows)
        vocab = logits.shape[-1]
        noise = mx.stack([mx.random.gumbel((vocab,), key=row_key(r.seed, r.index, r.key_position)) for r in rows])
        sampled = mx.argmax(scaled + noise, axis=-1)
        tokens = mx.where(mx.array(greedy), mx.argmax(logits, axis=-1), sampled)
    return DeviceSample(tokens.astype(mx.int32), raw_logprobs, rows)


def argmax_on_device(logits: mx.array) -> DeviceSample:
    """`sample_on_device` for rows that are all greedy without penalties or log-probs: the argmax,
    without building a row each."""
    return DeviceSample(mx.argmax(logits.astype(mx.float32), axis=-1).astype(mx.int32), None, [])


def sample(logits: mx.array, rows: list[SampleRow]) -> tuple[list[int], list[TokenLogprob | None]]:
    """Sample one token per row of `logits` `[rows, vocab]`; logprobs for rows that ask."""
    return sample_on_device(logits, rows).resolve()


def _logprobs(raw: mx.array | None, rows: list[SampleRow], tokens: list[int]) -> list[TokenLogprob | None]:
    if raw is None:
        return [None] * len(tokens)
    wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    host = np.asarray(raw[mx.array(wanted)])
    out: list[TokenLogprob | None] = [None] * len(rows)
    for j, i in enumerate(wanted):
        row, k = host[j], rows[i].params.logprobs
        top: list[tuple[int, float]] = []
        if k:
            idx = np.argpartition(-row, k - 1)[:k]
            idx = idx[np.argsort(-row[idx], kind="stable")]
            top = [(int(t), float(row[t])) for t in idx]
        out[i] = TokenLogprob(tokens[i], float(row[tokens[i]]), top)
    return out
