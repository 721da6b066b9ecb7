"""The shape of one model's KV memory, shared by the pool, the wire format and the cold tier.

Every place that stores or moves KV bytes checks its peer's geometry against its own
before touching a byte, so this is the one definition they all compare.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

#: dtype names the pool accepts, mapped to their item size in bytes.
DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class KVGeometry:
    """Layout of a KV pool: per layer `[num_blocks, block_size, num_kv_heads, head_dim]`."""

    model_fingerprint: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str

    def __post_init__(self):
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"unsupported KV dtype {self.dtype!r}; expected one of {sorted(DTYPE_SIZES)}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def block_shape(self) -> tuple[int, int, int]:
        """Shape of one block of one layer's K (or V)."""
        return (self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def bytes_per_block_layer(self) -> int:
        """Bytes of K (or V) that one block holds in one layer."""
        return self.block_size * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def bytes_per_block(self) -> int:
        """Bytes of K and V that one block holds across all layers."""
        return 2 * self.num_layers * self.bytes_per_block_layer

    @property
    def bytes_per_token(self) -> int:
        return self.bytes_per_block // self.block_size

    @property
    def numpy_storage_dtype(self) -> np.dtype:
        """numpy has no bfloat16: its raw bytes travel as uint16."""
        return np.dtype({"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}[self.dtype])

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> KVGeometry:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__})

    def mismatch(self, other: KVGeometry) -> str | None:
        """Name the first field on which `other` differs, or None when they match."""
        for name in self.__dataclass_fields__:
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                return f"{name}: expected {mine!r}, got {theirs!r}"
        return None


@dataclass(frozen=True)
class StateArray:
    """One of a state layer's per-sequence arrays (a Gated DeltaNet layer has two: its
    convolution window and its recurrent state)."""

    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self):
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"unsupported state dtype {self.dtype!r}; expected one of {sorted(DTYPE_SIZES)}")
        if any(not isinstance(n, int) or n <= 0 for n in self.shape):
            raise ValueError(f"a state array's dimensions must be positive integers, got {self.shape}")

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * DTYPE_SIZES[self.dtype]

    @property
    def numpy_storage_dtype(self) -> np.dtype:
        """As for KV: bfloat16's raw bytes travel as uint16."""
        return np.dtype({"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}[self.dtype])


@dataclass(frozen=True)
class StateGeometry:
    """The recurrent state one sequence of a hybrid model holds: `layers[l]` are state layer l's
    arrays. A state snapshot is only meaningful to a state pool of exactly this geometry, so the
    wire format carries it and a receiver compares it with its own before reading a byte."""

    layers: tuple[tuple[StateArray, ...], ...]

    @classmethod
    def of(cls, layer_shapes) -> StateGeometry:
        """From per-layer objects with `shapes` and `dtypes` (the state pool's `layer_shapes`)."""
        return cls(tuple(tuple(StateArray(tuple(int(n) for n in shape), str(dtype))
                               for shape, dtype in zip(layer.shapes, layer.dtypes, strict=True))
                         for layer in layer_shapes))

    @property
    def nbytes(self) -> int:
        return sum(array.nbytes for layer in self.layers for array in layer)

    def to_list(self) -> list:
        return [[{"shape": list(a.shape), "dtype": a.dtype} for a in layer] for layer in self.layers]

    @classmethod
    def from_list(cls, raw: list) -> StateGeometry:
        return cls(tuple(tuple(StateArray(tuple(a["shape"]), a["dtype"]) for a in layer) for layer in raw))

    def mismatch(self, other: StateGeometry) -> str | None:
        """Name the first difference from `other` (layer count, array count, shape, dtype), or None."""
        if len(self.layers) != len(other.layers):
            return f"state layers: expected {len(self.layers)}, got {len(other.layers)}"
        for index, (mine, theirs) in enumerate(zip(self.layers, other.layers)):
            if len(mine) != len(theirs):
                return f"state layer {index} arrays: expected {len(mine)}, got {len(theirs)}"
            for kind, (a, b) in enumerate(zip(mine, theirs)):
                if a != b:
                    return f"state layer {index} array {kind}: expected {a.shape} {a.dtype}, got {b.shape} {b.dtype}"
        return None
