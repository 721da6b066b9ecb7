"""The state pool: fixed-size recurrent states of the linear-attention layers, one slot per sequence.

Beside the KV pool, for hybrid models (Gated DeltaNet + full attention): a state is not a sum of
blocks, so it lives in slots, not blocks. One preallocated array per (state layer, kind), as the
KV pool keeps one per layer, `[num_slots, *state shape]`; a step gathers its sequences' rows,
and writes the new states back in place (`store`). Slot 0 is never handed out: a step's padding
rows, if any, may write it. A slot is zeroed when it is handed out (a sequence that starts from
its first token starts from the zero state); a fork copies the parent's slot.

As with the KV pool, the arrays are replaced by every step, so nothing else may keep them.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import mlx.core as mx
import numpy as np

from orchard.kvcache.errors import OutOfStateSlots
from orchard.kvcache.geometry import StateGeometry

NULL_SLOT = 0


class StatePool:
    """Recurrent-state slots for `num_slots - 1` sequences at once, for every state layer."""

    def __init__(self, layer_shapes: Sequence, num_slots: int):
        """`layer_shapes`: per state layer, an object with `shapes` and `dtypes` per state kind."""
        if num_slots < 2:
            raise ValueError(f"a state pool needs the null slot and at least one more, got num_slots={num_slots}")
        self.num_slots = num_slots
        self.layer_shapes = list(layer_shapes)
        self.arrays: list[list[mx.array]] = [
            [mx.zeros((num_slots, *shape), dtype=getattr(mx, dtype)) for shape, dtype in zip(s.shapes, s.dtypes, strict=True)]
            for s in self.layer_shapes
        ]
        mx.eval(self.arrays)
        self._free = list(range(num_slots - 1, NULL_SLOT, -1))
        self._slots: dict[Hashable, int] = {}

    @property
    def nbytes(self) -> int:
        return self.num_slots * self.bytes_per_slot

    @property
    def bytes_per_slot(self) -> int:
        return sum(s.nbytes for s in self.layer_shapes)

    @property
    def geometry(self) -> StateGeometry:
        return StateGeometry.of(self.layer_shapes)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def slot(self, seq_id: Hashable) -> int:
        return self._slots[seq_id]

    def allocate(self, seq_id: Hashable) -> int:
        """A zeroed slot for a sequence that starts from its first token."""
        if seq_id in self._slots:
            raise ValueError(f"sequence {seq_id!r} already holds state slot {self._slots[seq_id]}")
        if not self._free:
            raise OutOfStateSlots(f"all {self.num_slots - 1} state slots are held; sequence {seq_id!r} gets none")
        slot = self._free.pop()
        self._slots[seq_id] = slot
        self._fill(slot, None)
        return slot

    def fork(self, parent_id: Hashable, child_id: Hashable) -> int:
        """A slot for `child_id` holding a copy of the parent's state."""
        child = self.allocate(child_id)
        self._fill(child, self._slots[parent_id])
        return child

    def free(self, seq_id: Hashable) -> None:
        slot = self._slots.pop(seq_id, None)
        if slot is not None:
            self._free.append(slot)

    def snapshot(self, seq_id: Hashable) -> list[list[mx.array]]:
        """A copy of the sequence's state as the last step built leaves it (lazy, evaluated with that step)."""
        slot = self._slots[seq_id]
        copies = [[pool[slot] * 1 for pool in layer] for layer in self.arrays]  # * 1: a copy, not a view of the pool
        mx.async_eval(copies)
        return copies

    def restore(self, seq_id: Hashable, snapshot: Sequence[Sequence[mx.array]]) -> None:
        """Put a snapshot's state into the sequence's slot."""
        slot = self._slots[seq_id]
        for layer, saved in zip(self.arrays, snapshot, strict=True):
            for kind, pool in enumerate(layer):
                pool[slot] = saved[kind]
                layer[kind] = pool

    def host_copy(self, snapshot: Sequence[Sequence[mx.array]]) -> list[list[np.ndarray]]:
        """A snapshot as numpy arrays in the wire's storage dtypes (bfloat16 as its uint16 bits), to send."""
        return [[np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a) for a in layer] for layer in snapshot]

    def device_copy(self, arrays: Sequence[Sequence[np.ndarray]]) -> list[list[mx.array]]:
        """A snapshot received as numpy arrays (`host_copy`'s form), copied into MLX arrays of this pool's dtypes."""
        copies = [[_from_storage(a, pool.dtype) for a, pool in zip(layer, pools, strict=True)]
                  for layer, pools in zip(arrays, self.arrays, strict=True)]
        mx.eval(copies)
        return copies

    def store(self, layer: int, slots: mx.array, states: Sequence[mx.array]) -> None:
        """A step's new states of one layer into its sequences' slots (in place once evaluated)."""
        for kind, state in enumerate(states):
            pool = self.arrays[layer][kind]
            pool[slots] = state.astype(pool.dtype)
            self.arrays[layer][kind] = pool

    def _fill(self, slot: int, source: int | None) -> None:
        for layer in self.arrays:
            for kind, pool in enumerate(layer):
                pool[slot] = 0 if source is None else pool[source]
                layer[kind] = pool


def _from_storage(array: np.ndarray, dtype: mx.Dtype) -> mx.array:
    copy = mx.array(np.ascontiguousarray(array))
    return copy.view(mx.bfloat16) if dtype == mx.bfloat16 else copy
