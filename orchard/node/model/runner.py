"""The paged forward pass: mlx-lm's own model classes, with KV and attention going through the pool.

One engine step packs decode tokens (one per sequence) and prefill chunks of other
sequences side by side, no padding, and runs them as a batch of one-token rows
`[total_tokens, 1]`: each layer's projections, norms and MLP see the same rows either
way, rope takes one position per batch row (node.model.positions), and every tensor the seams
below hand over is a view of what the layer already holds, never a copy. mlx-lm's model
code is left as it is; three seams make it paged:

- each layer gets a `PagedLayerCache`, which mlx-lm treats as its KV cache: its
  `update_and_fetch` scatters the step's K/V into the pool (`kernels.write_kv`), its
  `offset` carries per-token positions, its `make_mask` returns None (the kernel
  applies causality per sequence);
- each attention module's rope is wrapped (`orchard.node.model.positions`) to honour those positions;
- the model module's `scaled_dot_product_attention` is replaced by one that runs the
  paged kernels (`kernels.paged_attention` for decode-only steps, `kernels.paged_varlen_attention`
  with the step's one `VarlenPlan` otherwise) for a paged cache and defers to the original for
  any other cache, so `mlx_lm.generate` still works on the same model object. A layer's
  sliding window (from the caches the model makes for itself, `orchard.node.model.capability.layer_windows`),
  its attention sinks and its score soft cap (the call's own `sinks=`, `softcap=`) go to the
  kernels with each call.

Gemma 2 and Ministral 3 reach past these seams; `orchard.node.model.layer_patches` patches them into them.

Metadata arrays are built once per step and shared by every layer through `StepContext`;
decode-only steps on a compiled backend replay a traced graph instead (`orchard.node.model.compiled_decode`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from orchard import kernels
from orchard.node.model.capability import attention_modules, layer_windows
from orchard.node.model.compiled_decode import shared_compiled_decode
from orchard.node.model.fused_layers import fuse_stack
from orchard.node.model.head import ModelHead
from orchard.node.model.layer_patches import install_layer_patches
from orchard.node.model.layers import attention_layers, attention_of, text_stack
from orchard.node.model.loader import LoadedModel
from orchard.node.model.positions import PackedPositions, install_positional_rope
from orchard.node.model.state_layers import PagedStateCache, StateStep, install_paged_state_layers, state_layer_indices

_PAGED_MARK = "_orchard_paged_attention"


class InvalidStep(ValueError):
    """Step metadata that disagrees with itself (lengths, offsets, shapes)."""


@dataclass
class StepInput:
    """What the scheduler hands the model for one step; plain lists or numpy arrays.

    Sequence s owns tokens `query_start_loc[s]:query_start_loc[s+1]` of `token_ids`; after
    this step it holds `context_lens[s]` tokens of KV. `slot_mapping[i]` is the pool slot
    (`block_id * block_size + offset`) where token i's K/V goes. `block_tables` rows are
    padded with block 0 (the null block) to a common width.
    """

    token_ids: Sequence[int]
    positions: Sequence[int]
    slot_mapping: Sequence[int]
    block_tables: Any  # [S, max_blocks]
    query_start_loc: Sequence[int]
    context_lens: Sequence[int]
    state_slots: Sequence[int] | None = None  # each sequence's state slot (hybrid models: kvcache.StatePool)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)


@dataclass(frozen=True)
class SequenceChunk:
    """New tokens of one sequence for a step: they sit at positions `start`, `start + 1`, ..."""

    token_ids: Sequence[int]
    start: int
    block_table: Sequence[int]


def pad_block_tables(tables: Sequence[Sequence[int]]) -> np.ndarray:
    """Ragged block tables as one int32 `[S, max_blocks]` array padded with the null block 0."""
    width = max((len(t) for t in tables), default=0)
    out = np.zeros((len(tables), max(width, 1)), dtype=np.int32)
    for row, table in enumerate(tables):
        out[row, : len(table)] = table
    return out


def pack_step(chunks: Sequence[SequenceChunk], block_size: int, state_slots: Sequence[int] | None = None) -> StepInput:
    """Lay several sequences' new tokens side by side and derive positions and slots.

    Vectorised over the step's tokens: with 64 decode rows a loop per chunk cost more host
    time than the device's whole attention.
    """
    lengths = np.fromiter((len(c.token_ids) for c in chunks), dtype=np.int64, count=len(chunks))
    starts = np.zeros(len(chunks) + 1, dtype=np.int64)
    np.cumsum(lengths, out=starts[1:])
    owner = np.repeat(np.arange(len(chunks)), lengths)
    first = np.fromiter((c.start for c in chunks), dtype=np.int64, count=len(chunks))
    positions = first[owner] + np.arange(starts[-1]) - starts[owner]
    tables = pad_block_tables([c.block_table for c in chunks])
    capacity = np.fromiter((len(c.block_table) for c in chunks), dtype=np.int64, count=len(chunks)) * block_size
    beyond = positions >= capacity[owner]
    if beyond.any():
        i = int(np.argmax(beyond))
        raise InvalidStep(f"position {positions[i]} lies beyond the {capacity[owner[i]] // block_size} blocks of the sequence")
    slots = tables[owner, positions // block_size].astype(np.int64) * block_size + positions % block_size
    return StepInput(
        token_ids=[int(t) for c in chunks for t in c.token_ids],
        positions=positions.tolist(),
        slot_mapping=slots.tolist(),
        block_tables=tables,
        query_start_loc=starts.tolist(),
        context_lens=(first + lengths).tolist(),
        state_slots=state_slots,
    )


def pack_decode(token_ids: list[int], positions: list[int], tables: Sequence[Sequence[int]], block_size: int,
                state_slots: Sequence[int] | None = None) -> StepInput:
    """`pack_step` for a step of one new token per sequence (token i of sequence i at
    `positions[i]`), the decode batch's every step: plain lists, no per-chunk objects."""
    slots = []
    for position, table in zip(positions, tables):
        index = position // block_size
        if index >= len(table):
            raise InvalidStep(f"position {position} lies beyond the {len(table)} blocks of the sequence")
        slots.append(table[index] * block_size + position % block_size)
    return StepInput(
        token_ids=token_ids,
        positions=positions,
        slot_mapping=slots,
        block_tables=pad_block_tables(tables),
        query_start_loc=list(range(len(positions) + 1)),
        context_lens=[p + 1 for p in positions],
        state_slots=state_slots,
    )


@dataclass
class StepContext:
    """A step's metadata, built once and read by every layer: device arrays for the
    per-token ops, host arrays for the kernel's planning.

    Every eager step, decode-only or mixed, gets one `kernels.VarlenPlan`: checked and
    uploaded here once, then only launched by each layer (decode rows run the decode kernel
    from it). Without the model's head count the decode entry is used instead, planning per
    layer; so is a decode step a compiled graph runs (`orchard.node.model.compiled_decode`), whose context
    holds only device arrays and whose plan follows from their shapes.
    """

    pool: Any  # KVPool-like: `keys` / `values` lists of per-layer arrays
    positions: PackedPositions
    slots: kernels.SlotIndex  # where each token's K/V goes, split once for every layer's write
    block_tables: np.ndarray
    query_start_loc: np.ndarray
    context_lens: np.ndarray
    backend: str
    decode_only: bool = False
    decode_tables: Any = None
    decode_lens: Any = None
    varlen_plan: Any = None  # kernels.VarlenPlan of a mixed step, shared by every layer
    states: StateStep | None = None  # the state layers' regrouping (hybrid models)

    @classmethod
    def build(cls, step: StepInput, pool: Any, backend: str, num_heads: int | None = None) -> StepContext:
        starts = np.asarray(step.query_start_loc, dtype=np.int32)
        lengths = np.asarray(step.context_lens, dtype=np.int32)
        tables = np.asarray(step.block_tables, dtype=np.int32)
        _check_step(step, starts, lengths, tables)
        context = cls(
            pool=pool,
            positions=PackedPositions(mx.array(np.asarray(step.positions, dtype=np.int32))),
            slots=kernels.SlotIndex.of(step.slot_mapping, pool.keys[0].shape[1]),
            block_tables=tables,
            query_start_loc=starts,
            context_lens=lengths,
            backend=backend,
        )
        context.decode_only = step.num_tokens == step.num_seqs
        if step.state_slots is not None:
            context.states = StateStep.build(step.state_slots, starts)
        if num_heads is None and context.decode_only:  # no step plan: the decode entry plans per layer
            on_device = backend not in kernels.HOST_PLANNED
            context.decode_tables = mx.array(tables) if on_device else tables
            context.decode_lens = mx.array(lengths) if on_device else lengths
        elif num_heads is not None:
            num_blocks, block_size, num_kv_heads, head_dim = pool.keys[0].shape
            context.varlen_plan = kernels.plan_varlen(
                starts, lengths, tables, block_size=block_size, num_heads=num_heads,
                num_kv_heads=num_kv_heads, head_dim=head_dim, backend=backend, num_blocks=num_blocks,
            )
        return context


def _check_step(step: StepInput, starts: np.ndarray, lengths: np.ndarray, tables: np.ndarray) -> None:
    """Cheap shape checks; the kernel checks values against the pool."""
    n = step.num_tokens
    if len(step.positions) != n or len(step.slot_mapping) != n:
        raise InvalidStep(f"{n} tokens but {len(step.positions)} positions and {len(step.slot_mapping)} slots")
    if starts.shape != (step.num_seqs + 1,) or starts[0] != 0 or starts[-1] != n:
        raise InvalidStep(f"query_start_loc must rise from 0 to {n} over {step.num_seqs} sequences")
    if (np.diff(starts) < 1).any():
        raise InvalidStep("every sequence in a step needs at least one new token")
    if tables.ndim != 2 or tables.shape[0] != step.num_seqs:
        raise InvalidStep(f"block_tables must be [{step.num_seqs}, max_blocks], got {tables.shape}")


def _check_decode_step(step: StepInput, key_cache: mx.array) -> None:
    """What the eager path's plan checks, for a decode step a compiled graph runs unplanned:
    shapes, lengths within the tables' capacity, block ids within the pool."""
    lengths = np.asarray(step.context_lens, dtype=np.int32)
    tables = np.asarray(step.block_tables, dtype=np.int32)
    _check_step(step, np.arange(step.num_seqs + 1, dtype=np.int32), lengths, tables)
    kernels.reference.check_table_values(key_cache, tables, lengths)  # as the eager plan does, InvalidAttentionMetadata


class PagedLayerCache:
    """What one layer of an mlx-lm model sees as its KV cache during a paged step."""

    def __init__(self, layer: int, context: StepContext, window: int | None = None):
        self.layer = layer
        self.context = context
        self.window = window  # keys each query sees, itself included; None: the whole context

    @property
    def offset(self) -> PackedPositions:
        return self.context.positions

    def make_mask(self, *args, **kwargs) -> None:
        return None  # causality per sequence is the attention kernel's job

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Scatter the step's K `[T, H_kv, 1, D]` and V `[T, H_kv, 1, Dv]` into the pool; attention reads the pool."""
        self.write(_packed(keys), _packed(values))
        return keys, values

    def write(self, keys: mx.array, values: mx.array) -> None:
        """Scatter packed K `[T, H_kv, D]` and V `[T, H_kv, Dv]` into this layer's pool arrays."""
        pool, layer = self.context.pool, self.layer
        pool.keys[layer], pool.values[layer] = kernels.write_kv(
            pool.keys[layer], pool.values[layer], keys, values, self.context.slots,
        )

    def attend(self, queries: mx.array, scale: float, sinks: mx.array | None = None,
               softcap: float | None = None) -> mx.array:
        """Queries `[T, H_q, 1, D]` over each sequence's paged context (this layer's window of it), `[T, H_q, 1, Dv]` back."""
        out = self.attend_packed(_packed(queries), scale, sinks, softcap)
        return out.reshape(queries.shape[0], queries.shape[1], 1, out.shape[-1])

    def attend_packed(self, queries: mx.array, scale: float, sinks: mx.array | None = None,
                      softcap: float | None = None) -> mx.array:
        """Packed queries `[T, H_q, D]` over each sequence's paged context, `[T, H_q, Dv]` back."""
        ctx, layer = self.context, self.layer
        keys, values = ctx.pool.keys[layer], ctx.pool.values[layer]
        rules = dict(scale=scale, window=self.window, sinks=sinks, softcap=softcap)
        if ctx.varlen_plan is not None:
            return kernels.paged_varlen_attention(queries, keys, values, ctx.varlen_plan, **rules)
        if ctx.decode_only:
            return kernels.paged_attention(
                queries, keys, values, ctx.decode_tables, ctx.decode_lens, backend=ctx.backend, **rules
            )
        return kernels.paged_prefill_attention(
            queries, keys, values, ctx.block_tables, ctx.query_start_loc, ctx.context_lens,
            backend=ctx.backend, **rules,
        )


def _packed(rows: mx.array) -> mx.array:
    """`[T, H, 1, D]` (a batch of one-token rows, as the layers shape them) as `[T, H, D]`: a view."""
    if rows.shape[2] != 1:
        raise InvalidStep(f"a paged step runs one token per batch row, got a tensor of shape {tuple(rows.shape)}")
    return rows.reshape(rows.shape[0], rows.shape[1], rows.shape[3])


def install_paged_attention(model) -> bool:
    """Route the attention call of every module the model's layers use through the pool for
    paged caches; once per module. True when any module was newly routed."""
    install_layer_patches(model)  # Gemma 2's module has an attention call only once patched
    installed = [_install_in(module) for module in attention_modules(model)]
    return any(installed)


def _install_in(module) -> bool:
    original = module.scaled_dot_product_attention
    if getattr(original, _PAGED_MARK, False):
        return False

    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, **kwargs):
        if isinstance(cache, PagedLayerCache):
            return cache.attend(queries, scale, sinks=kwargs.get("sinks"), softcap=kwargs.get("softcap"))
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, **kwargs)

    setattr(scaled_dot_product_attention, _PAGED_MARK, True)
    module.scaled_dot_product_attention = scaled_dot_product_attention
    return True


def layer_slots(model) -> list[int]:
    """Where each layer keeps its context: `k >= 0` is KV pool layer k, `-1 - j` state pool layer j."""
    state = {layer: j for j, layer in enumerate(state_layer_indices(model))}
    kv = {layer: k for k, (layer, _) in enumerate(attention_layers(model))}
    return [kv[i] if i in kv else -1 - state[i] for i in range(len(model.layers))]


def _query_heads(model) -> int | None:
    """Query heads per layer, which a step's attention plan is built for; None if layers disagree."""
    attentions = [attention_of(layer) for _, layer in attention_layers(model)]
    heads = {getattr(a, "n_heads", None) or getattr(a, "num_heads", None) for a in attentions}
    return heads.pop() if len(heads) == 1 and None not in heads else None


class ModelRunner:
    """Runs packed steps of one loaded model against a KV pool.

    The pool is read when each step runs, so the engine may swap `runner.pool`; the pool's
    per-layer arrays are replaced by every step (see `orchard.kvcache.pool`).
    """

    def __init__(self, loaded: LoadedModel, pool: Any, *, attention_backend: str | None = None,
                 compiled_decode: bool | None = None, states: Any = None, fused_layers: bool = True):
        self.loaded = loaded
        self.pool = pool
        self.states = states  # kvcache.StatePool of a hybrid model's recurrent-state layers
        # once per model: values of another head dim than keys run on the reference kernels
        self.attention_backend = kernels.backend_for_head_dims(attention_backend, pool.keys[0].shape[-1],
                                                               pool.values[0].shape[-1])
        install_positional_rope(loaded.model)
        install_paged_attention(loaded.model)
        install_paged_state_layers(loaded.model)
        self._head = ModelHead(loaded.model)  # the model's own head and logit transforms
        self._stack = text_stack(loaded.model)  # the decoder stack each step runs
        # the same stack with fused projections, for the families that have them; else None
        self._fused = fuse_stack(self._stack) if fused_layers else None
        self._num_layers = len(attention_layers(loaded.model))  # the KV pool's layers
        self._num_heads = _query_heads(loaded.model)
        self._windows = layer_windows(loaded.model)
        self._slots = layer_slots(loaded.model)
        if min(self._slots) < 0 and states is None:
            raise ValueError("a model with recurrent-state layers needs a state pool")
        if compiled_decode is None:  # a compiled graph carries no state pool yet
            compiled_decode = self.attention_backend not in kernels.HOST_PLANNED and states is None
        self.compiled_decode = shared_compiled_decode(self._stack, self.attention_backend, self._num_layers,
                                                      self._decode_context, self._run) if compiled_decode else None

    def layer_caches(self, context: StepContext) -> list:
        """One cache per layer for a step: a paged KV cache with its layer's sliding window, or a
        recurrent-state layer's view of the state pool."""
        return [
            PagedStateCache(-1 - slot, context.states, self.states) if slot < 0 else PagedLayerCache(slot, context, window)
            for slot, window in zip(self._slots, self._windows)
        ]

    def forward(self, step: StepInput, tokens: mx.array | None = None) -> mx.array:
        """Logits `[S, vocab]` for the last new token of each sequence (lazy; evaluating
        them also materialises this step's KV writes). `tokens` replaces `step.token_ids`
        when some ids are still on the device."""
        if self.compiled_decode is not None and step.num_tokens == step.num_seqs:
            _check_decode_step(step, self.pool.keys[0])
            return self.compiled_decode(self.pool, step, tokens)
        context = StepContext.build(step, self.pool, self.attention_backend, self._num_heads)
        if tokens is None:
            tokens = mx.array(np.asarray(step.token_ids, dtype=np.int32))
        return self._run(context, tokens)

    def _run(self, context: StepContext, tokens: mx.array) -> mx.array:
        """The model's stack over a step's packed tokens, then its head: logits of every row
        of a decode step, and of each chunk's last row otherwise."""
        if self._fused is not None:
            hidden = self._fused(tokens, self.layer_caches(context))
        else:
            hidden = self._stack(tokens[:, None], cache=self.layer_caches(context))
            hidden = hidden.reshape(hidden.shape[0], hidden.shape[2])
        if not context.decode_only:  # a decode step's rows are each its sequence's last token
            hidden = hidden[mx.array(context.query_start_loc[1:] - 1)]
        return self._head(hidden)

    def _decode_context(self, pool, positions: PackedPositions, slots: kernels.SlotIndex, tables: mx.array,
                        lengths: mx.array) -> StepContext:
        """A decode step's context from device arrays alone, as a compiled graph traces it."""
        return StepContext(
            pool=pool, positions=positions, slots=slots, block_tables=None, query_start_loc=None,
            context_lens=None, backend=self.attention_backend, decode_only=True, decode_tables=tables,
            decode_lens=lengths,
        )
