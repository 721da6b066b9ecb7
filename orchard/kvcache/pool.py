"""The KV block pool: one K and one V array per layer, holding every block of one model.

One large array per layer rather than one per block, because Metal caps how many
buffers a process may hold and the attention kernels index blocks through a table.
Block 0 is the null block that padded block-table entries point at; nothing here ever
writes it, so it stays zero.

The engine swaps `keys[l]` / `values[l]` for the arrays a forward pass returns, so
nothing outside this object may keep a reference to them: a stale reference would
both read old KV and stop MLX from updating the buffer in place.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from orchard.kvcache.geometry import KVGeometry

NULL_BLOCK = 0


def _as_run(blocks: Sequence[np.ndarray]) -> np.ndarray | None:
    """`blocks` as one `[n, ...]` strided view when they lie equally spaced in one buffer (as
    `orchard.kvcache.wire_stream.decode_views` hands them out), else None; an array of blocks is one already."""
    if isinstance(blocks, np.ndarray):
        return blocks
    if len(blocks) < 2 or _owner(blocks[0]) is None or any(_owner(b) is not _owner(blocks[0]) for b in blocks):
        return None
    if any(not b.flags.c_contiguous or b.dtype != blocks[0].dtype for b in blocks):
        return None
    addresses = [b.__array_interface__["data"][0] for b in blocks]
    step = addresses[1] - addresses[0]
    if step < blocks[0].nbytes or any(b - a != step for a, b in zip(addresses, addresses[1:])):
        return None
    first = blocks[0]
    return np.lib.stride_tricks.as_strided(first, (len(blocks), *first.shape), (step, *first.strides), writeable=False)


def as_slice(ids: list[int]) -> slice | np.ndarray:
    """Consecutive ascending ids (a fresh pool hands them out so) as a slice: numpy copies a slice
    faster than it scatters through an index array, and reads one as a view, not a copy."""
    if ids[-1] - ids[0] == len(ids) - 1 and all(b - a == 1 for a, b in zip(ids, ids[1:])):
        return slice(ids[0], ids[-1] + 1)
    return np.asarray(ids)


def _owner(array: np.ndarray):
    """The object whose memory `array` views (a memoryview's underlying buffer), or None."""
    base = array.base
    while isinstance(base, np.ndarray):
        base = base.base
    return base.obj if isinstance(base, memoryview) else base


def host_memory() -> bool:
    """Whether MLX arrays live in memory numpy can address: the CPU, or Metal's unified memory."""
    return mx.default_device() == mx.cpu or mx.metal.is_available()

MX_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


class KVPool:
    """Per-layer K arrays `[num_blocks, block_size, num_kv_heads, head_dim]` and V arrays of the
    same shape but for their last dim, `value_head_dim`."""

    def __init__(self, geometry: KVGeometry, num_blocks: int):
        if num_blocks < 2:
            raise ValueError(f"a pool needs the null block and at least one more, got num_blocks={num_blocks}")
        self.geometry = geometry
        self.num_blocks = num_blocks
        key_shape, value_shape = (num_blocks, *geometry.key_block_shape), (num_blocks, *geometry.value_block_shape)
        dtype = MX_DTYPES[geometry.dtype]
        self.keys: list[mx.array] = [mx.zeros(key_shape, dtype=dtype) for _ in range(geometry.num_layers)]
        self.values: list[mx.array] = [mx.zeros(value_shape, dtype=dtype) for _ in range(geometry.num_layers)]
        mx.eval(*self.keys, *self.values)

    @property
    def nbytes(self) -> int:
        """Bytes the pool's arrays hold, null block included."""
        return self.num_blocks * self.geometry.bytes_per_block

    def read_blocks(self, block_ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """K and V of `block_ids`, each `[num_layers, n, block_size, heads, its head dim]`, in storage dtype."""
        index = self._index(block_ids)
        keys = mx.stack([layer[index] for layer in self.keys])
        values = mx.stack([layer[index] for layer in self.values])
        return self._to_numpy(keys), self._to_numpy(values)

    def write_blocks(self, block_ids: Sequence[int], keys_np: np.ndarray, values_np: np.ndarray) -> None:
        """Store K and V (as `read_blocks` returns them) into `block_ids`, bit for bit."""
        index = self._index(self._checked_targets(block_ids))
        self._check_payload("keys", keys_np, len(block_ids), self.geometry.key_block_shape)
        self._check_payload("values", values_np, len(block_ids), self.geometry.value_block_shape)
        for layer in range(self.geometry.num_layers):
            self.keys[layer] = self._assign(self.keys[layer], index, self._to_mlx(keys_np[layer]))
            self.values[layer] = self._assign(self.values[layer], index, self._to_mlx(values_np[layer]))
        mx.eval(*self.keys, *self.values)

    def layer_views(self) -> tuple[list[np.ndarray], list[np.ndarray]] | None:
        """numpy views of every layer's K and V arrays in the storage dtype (bfloat16's as uint16, which
        numpy has), sharing their memory (no copy), or None where the device does not keep arrays in
        host memory.

        A view aliases its layer's buffer: a step's write lands there in place and shows through (MLX
        reuses the buffer, `orchard.kernels.kv_write`), and costs no copy while views are held. So an
        export may hold them on another thread across steps for pinned blocks, which no step writes.
        """
        if not host_memory():
            return None
        mx.eval(*self.keys, *self.values)
        try:
            keys, values = [self._host_view(layer) for layer in self.keys], [self._host_view(layer) for layer in self.values]
        except BufferError:  # a bfloat16 layer that is not one run of memory exports no bytes to read as uint16
            return None
        if not all(view.flags.c_contiguous and view.flags.writeable for view in keys + values):
            return None  # a broadcast or strided array: writing through it would not mean one block
        return keys, values

    def buffer_addresses(self) -> list[int] | None:
        """Where every layer's K buffer, then every layer's V buffer, begins, or None where `layer_views` would
        give none: what a pull's landing compares before it lists blocks written through views it took at its
        start (`orchard.kvcache.block_landing`). Read through each array's buffer with no numpy view made: a few
        times cheaper than reading them off `layer_views` (`experiments/pool_addresses.py`)."""
        if not host_memory():
            return None
        mx.eval(*self.keys, *self.values)
        buffers = [memoryview(layer) for layer in (*self.keys, *self.values)]
        if not all(buffer.c_contiguous and not buffer.readonly for buffer in buffers):
            return None
        return [ctypes.addressof(ctypes.c_char.from_buffer(buffer)) for buffer in buffers]

    def write_block_arrays(self, block_ids: Sequence[int], keys: Sequence[np.ndarray], values: Sequence[np.ndarray]) -> None:
        """Store each block's K and V (`[num_layers, block_size, heads, its head dim]`) into `block_ids`,
        copied once, straight into the pool's memory where `layer_views` allows. `keys` and `values`
        may be arrays with the blocks on their first axis (a `orchard.kvcache.wire.BlockRun`'s)."""
        ids = self._checked_targets(block_ids)
        self._index(ids)
        if len(keys) != len(ids) or len(values) != len(ids):
            raise ValueError(f"{len(ids)} blocks to write, {len(keys)} K and {len(values)} V given")
        views = self.layer_views()
        if views is None:
            self.write_blocks(ids, np.stack(keys, axis=1), np.stack(values, axis=1))
            return
        self._check_block_arrays(keys, values)
        runs = _as_run(keys), _as_run(values)
        if runs[0] is not None and runs[1] is not None:  # equally spaced in one buffer: a copy per layer
            index = as_slice(ids)
            for layer in range(self.geometry.num_layers):
                views[0][layer][index] = runs[0][:, layer]
                views[1][layer][index] = runs[1][:, layer]
            return
        for block_id, k, v in zip(ids, keys, values):
            for layer in range(self.geometry.num_layers):
                views[0][layer][block_id] = k[layer]
                views[1][layer][block_id] = v[layer]

    def _check_block_arrays(self, keys: Sequence[np.ndarray], values: Sequence[np.ndarray]) -> None:
        key_shape = (self.geometry.num_layers, *self.geometry.key_block_shape)
        value_shape = (self.geometry.num_layers, *self.geometry.value_block_shape)
        if isinstance(keys, np.ndarray) and isinstance(values, np.ndarray):
            wrong = keys.shape[1:] != key_shape or values.shape[1:] != value_shape
        else:
            wrong = any(k.shape != key_shape or v.shape != value_shape for k, v in zip(keys, values))
        if wrong:
            raise ValueError(f"every block's K must have shape {key_shape} and its V {value_shape}")

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy each `(src, dst)` block in every layer; all sources are read before any write."""
        if not pairs:
            return
        sources = self._index([src for src, _ in pairs])
        targets = self._index(self._checked_targets([dst for _, dst in pairs]))
        # Gather first: a scatter whose input a pending gather still reads cannot reuse
        # the buffer, and would copy the whole layer.
        key_blocks = [layer[sources] for layer in self.keys]
        value_blocks = [layer[sources] for layer in self.values]
        mx.eval(*key_blocks, *value_blocks)
        for layer in range(self.geometry.num_layers):
            self.keys[layer] = self._assign(self.keys[layer], targets, key_blocks[layer])
            self.values[layer] = self._assign(self.values[layer], targets, value_blocks[layer])
        mx.eval(*self.keys, *self.values)

    @staticmethod
    def _assign(layer: mx.array, index: mx.array, blocks: mx.array) -> mx.array:
        # Index assignment lets MLX scatter into the existing buffer when nothing else holds it.
        layer[index] = blocks
        return layer

    def _index(self, block_ids: Sequence[int]) -> mx.array:
        ids = [int(b) for b in block_ids]
        bad = [b for b in ids if not 0 <= b < self.num_blocks]
        if bad:
            raise ValueError(f"block ids {bad} outside the pool of {self.num_blocks} blocks")
        return mx.array(ids, dtype=mx.int32)

    @staticmethod
    def _checked_targets(block_ids: Sequence[int]) -> list[int]:
        ids = [int(b) for b in block_ids]
        if NULL_BLOCK in ids:
            raise ValueError("block 0 is the null block and is never written")
        if len(set(ids)) != len(ids):
            raise ValueError(f"a write names the same block twice: {ids}")
        return ids

    def _check_payload(self, name: str, array: np.ndarray, n: int, block_shape: tuple[int, ...]) -> None:
        g = self.geometry
        expected = (g.num_layers, n, *block_shape)
        if array.shape != expected:
            raise ValueError(f"{name} has shape {array.shape}, expected {expected}")
        if array.dtype != g.numpy_storage_dtype:
            raise ValueError(f"{name} has dtype {array.dtype}, expected {g.numpy_storage_dtype}")

    def _host_view(self, layer: mx.array) -> np.ndarray:
        """`layer`'s own buffer as numpy, in the storage dtype. A bfloat16 layer's is read as uint16
        through the buffer the layer exports itself: an MLX view array over it (`layer.view(mx.uint16)`)
        would be a second owner of the buffer, and while it lived each step would copy the layer rather
        than write in place."""
        if self.geometry.dtype != "bfloat16":
            return np.asarray(layer)
        return np.frombuffer(memoryview(layer), dtype=np.uint16).reshape(layer.shape)

    def _to_numpy(self, array: mx.array) -> np.ndarray:
        if self.geometry.dtype == "bfloat16":
            array = array.view(mx.uint16)
        return np.array(array, copy=True)

    def _to_mlx(self, array: np.ndarray) -> mx.array:
        converted = mx.array(np.ascontiguousarray(array))
        if self.geometry.dtype == "bfloat16":
            converted = converted.view(mx.bfloat16)
        return converted
