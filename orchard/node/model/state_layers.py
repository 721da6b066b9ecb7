"""Layers that keep a recurrent state instead of KV (Qwen3-Next's and Qwen3.5's Gated DeltaNet),
and how a paged step runs them over the state pool (`kvcache.StatePool`).

Such a layer's module (`linear_attn`) takes mlx-lm's `ArraysCache(size=2)`: `cache[0]` the
convolution window, `cache[1]` the DeltaNet state, `cache.lengths` each row's valid length.
A state is a fold over the sequence, so the layer must see each sequence's new tokens as one row
in order, not the step's one-token rows the attention layers see: `PagedStateCache.run` regroups
the step's rows into `[sequences, longest chunk]` (right-padded and masked, which the module
honours: masked tokens leave the state as it was), feeds it each sequence's state from its slot,
writes the new states back to the slots, and hands the rows back in the step's order.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

STATE_MODULE_NAMES = ("linear_attn",)
_PAGED_MARK = "_orchard_paged_state"


def state_module_of(layer):
    """The layer's recurrent-state module, or None for an attention layer."""
    if not getattr(layer, "is_linear", False):
        return None
    for name in STATE_MODULE_NAMES:
        module = getattr(layer, name, None)
        if module is not None:
            return module
    return None


def state_layer_indices(model) -> list[int]:
    return [i for i, layer in enumerate(model.layers) if state_module_of(layer) is not None]


@dataclass(frozen=True)
class StateShape:
    """One state layer's arrays per sequence: shape and dtype of each `cache[i]`."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(s)) * getattr(mx, d).size for s, d in zip(self.shapes, self.dtypes, strict=True))


def probe_state_shapes(model, dtype) -> list[StateShape]:
    """Each state layer's per-sequence state, read from one lazy call on a two-token row (never evaluated)."""
    from mlx_lm.models.cache import ArraysCache

    shapes = []
    for index in state_layer_indices(model):
        module = state_module_of(model.layers[index])
        cache = ArraysCache(size=2)
        module(mx.zeros((1, 2, model.args.hidden_size), dtype=dtype), None, cache)
        arrays = [cache[i] for i in range(2)]
        shapes.append(StateShape(tuple(tuple(a.shape[1:]) for a in arrays),
                                 tuple(str(a.dtype).removeprefix("mlx.core.") for a in arrays)))
    return shapes


@dataclass
class StateStep:
    """A step's regrouping for the state layers, built once per step on the host and uploaded once.

    `slots[b]` is sequence b's state slot; `rows[b, s]` the step row of its s-th new token (row 0
    where b has fewer); `valid` marks real tokens; `back[t]` is where step row t sits in the
    flattened `[sequences, longest]` grid.
    """

    slots: mx.array  # int32 [B]
    rows: mx.array | None  # int32 [B * S]; None when every sequence has one new token (a decode step)
    valid: mx.array | None  # bool [B, S]
    lengths: mx.array | None  # int32 [B]
    back: mx.array | None  # int32 [T]
    longest: int

    @classmethod
    def build(cls, slots, query_start_loc: np.ndarray) -> StateStep:
        starts = np.asarray(query_start_loc, dtype=np.int64)
        lengths = np.diff(starts)
        slot_array = mx.array(np.asarray(slots, dtype=np.int32))
        longest = int(lengths.max())
        if longest == 1:
            return cls(slot_array, None, None, None, None, 1)
        offsets = np.arange(longest)[None, :]
        valid = offsets < lengths[:, None]
        rows = np.where(valid, starts[:-1, None] + offsets, 0).astype(np.int32)
        owner = np.repeat(np.arange(len(lengths)), lengths)
        back = (owner * longest + np.arange(starts[-1]) - starts[owner]).astype(np.int32)
        return cls(slot_array, mx.array(rows.reshape(-1)), mx.array(valid), mx.array(lengths.astype(np.int32)),
                   mx.array(back), longest)


class PagedStateCache:
    """What one state layer sees as its cache during a paged step: `run` does the regrouping."""

    def __init__(self, index: int, step: StateStep, pool):
        self.index = index  # among the state layers
        self.step = step
        self.pool = pool  # kvcache.StatePool
        self._arrays: list[mx.array | None] = [None, None]
        self.lengths = step.lengths

    # mlx-lm's ArraysCache protocol, as the module uses it
    def __getitem__(self, i: int):
        return self._arrays[i]

    def __setitem__(self, i: int, value) -> None:
        self._arrays[i] = value

    def __bool__(self) -> bool:
        return True

    def advance(self, n: int) -> None:
        pass

    def make_mask(self, *args, **kwargs) -> None:
        return None  # each state layer masks its own regrouped rows (`run`)

    def run(self, call, rows: mx.array) -> mx.array:
        """`call(x, mask, cache)` over the step's rows `[T, 1, D]` regrouped per sequence; rows back in step order."""
        step, pool = self.step, self.pool
        self._arrays = [pool.arrays[self.index][i][step.slots] for i in range(2)]
        if step.rows is None:  # one token per sequence: the rows already are the sequences
            out = call(rows, None, self)
        else:
            num_seqs, width = step.valid.shape
            x = rows.reshape(rows.shape[0], rows.shape[-1])[step.rows].reshape(num_seqs, width, rows.shape[-1])
            out = call(x, step.valid, self)
            out = out.reshape(num_seqs * width, out.shape[-1])[step.back][:, None, :]
        pool.store(self.index, step.slots, self._arrays)
        return out


def install_paged_state_layers(model) -> bool:
    """Route each state module class's call through `PagedStateCache.run` for paged caches; once per class."""
    classes = dict.fromkeys(type(state_module_of(model.layers[i])) for i in state_layer_indices(model))
    return any([_install_in(cls) for cls in classes])


def _install_in(cls) -> bool:
    original = cls.__call__
    if getattr(original, _PAGED_MARK, False):
        return False

    def __call__(self, inputs, mask=None, cache=None):
        if isinstance(cache, PagedStateCache):
            return cache.run(lambda x, m, c: original(self, x, m, c), inputs)
        return original(self, inputs, mask, cache)

    setattr(__call__, _PAGED_MARK, True)
    cls.__call__ = __call__
    return True
