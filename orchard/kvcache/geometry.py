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
    """Layout of a KV pool: per layer K `[num_blocks, block_size, num_kv_heads, head_dim]` and V
    `[num_blocks, block_size, num_kv_heads, value_dim]`.

    Most models store keys and values of one width; DeepSeek-V2's attention stores keys of its
    nope and rope parts together (e.g. 192) and values of 128. `value_head_dim` is V's width
    where it differs from K's and None where it does not (a V width equal to `head_dim` is
    stored as None), so geometries of one width compare equal however they were made, and
    `replace(geometry, head_dim=...)` changes both widths.
    """

    model_fingerprint: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    value_head_dim: int | None = None

    def __post_init__(self):
        if self.value_head_dim == self.head_dim:
            object.__setattr__(self, "value_head_dim", None)
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"unsupported KV dtype {self.dtype!r}; expected one of {sorted(DTYPE_SIZES)}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "value_dim", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def value_dim(self) -> int:
        """V's head dim."""
        return self.head_dim if self.value_head_dim is None else self.value_head_dim

    @property
    def same_key_value_dims(self) -> bool:
        return self.value_head_dim is None

    @property
    def key_block_shape(self) -> tuple[int, int, int]:
        """Shape of one block of one layer's K."""
        return (self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def value_block_shape(self) -> tuple[int, int, int]:
        """Shape of one block of one layer's V."""
        return (self.block_size, self.num_kv_heads, self.value_dim)

    @property
    def block_shape(self) -> tuple[int, int, int]:
        """Shape of one block of one layer's K, which is also V's: only where the two have one width,
        so that no caller takes K's shape for V's."""
        self._require_same_dims("block_shape")
        return self.key_block_shape

    @property
    def key_bytes_per_block_layer(self) -> int:
        """Bytes of K that one block holds in one layer."""
        return self.block_size * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def value_bytes_per_block_layer(self) -> int:
        """Bytes of V that one block holds in one layer."""
        return self.block_size * self.num_kv_heads * self.value_dim * self.itemsize

    @property
    def bytes_per_block_layer(self) -> int:
        """Bytes of K (or V) that one block holds in one layer, where K and V have one width."""
        self._require_same_dims("bytes_per_block_layer")
        return self.key_bytes_per_block_layer

    @property
    def bytes_per_block(self) -> int:
        """Bytes of K and V that one block holds across all layers."""
        return self.num_layers * (self.key_bytes_per_block_layer + self.value_bytes_per_block_layer)

    @property
    def bytes_per_token(self) -> int:
        return self.bytes_per_block // self.block_size

    @property
    def numpy_storage_dtype(self) -> np.dtype:
        """numpy has no bfloat16: its raw bytes travel as uint16."""
        return np.dtype({"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}[self.dtype])

    def _require_same_dims(self, name: str) -> None:
        if not self.same_key_value_dims:
            raise ValueError(f"{name} is one shape for K and V, but K has head dim {self.head_dim} and V "
                             f"{self.value_dim}: use the key_ or value_ form")

    def to_dict(self) -> dict:
        """The fields that travel and are compared; `value_head_dim` only where V's width differs
        from K's, so a geometry of one width reads as it did before values had their own."""
        fields = asdict(self)
        if self.same_key_value_dims:
            del fields["value_head_dim"]
        return fields

    @classmethod
    def from_dict(cls, d: dict) -> KVGeometry:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k != "value_head_dim"},
                   value_head_dim=d.get("value_head_dim"))

    def mismatch(self, other: KVGeometry) -> str | None:
        """Name the first field on which `other` differs, or None when they match."""
        for field_name in self.__dataclass_fields__:
            name = "value_dim" if field_name == "value_head_dim" else field_name  # V's width, not None
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
