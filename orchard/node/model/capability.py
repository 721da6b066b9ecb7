"""Whether the paged engine can run a model, judged by what the model's layers do, not by its name.

The engine drives mlx-lm's model classes through three seams (see `orchard.node.model.runner`):
the KV cache object each layer is handed, the rope of each layer's attention module, and
the `scaled_dot_product_attention` name in the model's own module. A model pages
correctly when everything that depends on context goes through those seams:

- every layer keeps a plain KV cache, over the whole context or over a sliding window
  (mlx-lm's `RotatingKVCache` without kept tokens, whose size is the window the kernels
  apply to that layer: `layer_windows`), and no recurrent state but a Gated DeltaNet's, which
  the state pool holds (node.model.state_layers);
- positions reach the layers only through a rope that accepts one position per token;
- every layer stores its K/V through its cache and attends over exactly what it stored with
  that one call and no mask of its own (its attention sinks or score soft cap, if any, passed
  along; Gemma 2 once patched, node.model.layer_patches), with one KV layout shared by all layers:
  KV heads, key and value head dims as the layers store them (`KVLayout`; DeepSeek-V2's values
  are narrower than its keys). A latent cache (DeepSeek-V3's multi-head latent attention stores
  a compressed KV and attends over keys and values expanded from it) is refused;
- the model's `__call__` is the text stack (`model.model`, EXAONE's `model.transformer`:
  node.model.layers) followed by a head that reads
  nothing but the stack's output and gives one row of logits per hidden row (the runner
  runs that head on the rows it needs, `orchard.node.model.head`).

`architecture_reason` looks at a model's structure (weights not needed, so a hub model is
refused before its weights are fetched); `paging_reason` traces one lazy forward pass
with probe caches that record what each layer stores and attends over, and checks each
rope against per-token calls; `stored_kv_layout` reads the pool's layout from the same trace.
"""

from __future__ import annotations

import sys
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from orchard.node.model.head import trace_head
from orchard.node.model.layer_patches import calls_attention, install_layer_patches
from orchard.node.model.layers import ATTENTION_NAMES, attention_layers, attention_of
from orchard.node.model.positions import PackedPositions, PositionalRoPE, install_positional_rope
from orchard.node.model.state_layers import state_layer_indices

_PROBE_TOKENS = 3
_ROPE_POSITIONS = (7, 0, 3)  # out of order, as in a packed step
_ROPE_ATOL = 1e-5


# ---------------------------------------------------------------- structure


def architecture_reason(model) -> str | None:
    """Why `model`'s structure cannot page, or None; reads no weights."""
    return _cache_reason(model) or _stack_reason(model) or _logits_reason(model)


def _stack_reason(model) -> str | None:
    layers = getattr(model, "layers", None)
    if not layers:
        return "no decoder layers at model.layers (a text stack nested elsewhere is not driven yet)"
    for index, layer in attention_layers(model):
        attention = attention_of(layer)
        if attention is None:
            where = " or ".join(f"layers[{index}].{name}" for name in ATTENTION_NAMES)
            return f"layer {index} has no attention module with a rope at {where}"
        if not calls_attention(attention):  # and no patch of node.model.layer_patches gives it one
            return f"its layers compute attention themselves ({type(attention).__module__} has no scaled_dot_product_attention)"
    return None


def _cache_reason(model) -> str | None:
    """A model that makes its own caches says what each layer needs kept."""
    if not hasattr(model, "make_cache"):
        return None  # mlx-lm gives such a model a full-context KVCache per layer
    caches = model.make_cache()
    state = set(state_layer_indices(model))
    if state and len(caches) != len(model.layers):
        return f"it makes {len(caches)} caches for {len(model.layers)} layers, so which layer keeps its state is not known"
    if (kinds := sorted({type(caches[i]).__name__ for i in state} - {"ArraysCache"})):
        return f"its recurrent-state layers keep {', '.join(kinds)}, not the convolution and DeltaNet state the state pool holds"
    kinds = sorted({type(cache).__name__ for i, cache in enumerate(caches) if i not in state and _window_of(cache) is False})
    if kinds:
        return f"layers keep {', '.join(kinds)} state (recurrent, chunked or sink-keeping attention)"
    if any(_window_of(cache) is not None for cache in caches) and len(caches) != len(model.layers):
        return f"it makes {len(caches)} caches for {len(model.layers)} layers, so which layer keeps which window is not known"
    return None


def layer_windows(model) -> list[int | None]:
    """Each layer's sliding window (keys a query sees, itself included), None for full context.

    Read from the caches the model makes for itself: mlx-lm gives a windowed layer a
    `RotatingKVCache` of the window's size, and masks that layer with the same window. A
    recurrent-state layer (node.model.state_layers) has none.
    """
    state = set(state_layer_indices(model))
    caches = model.make_cache() if hasattr(model, "make_cache") else []
    windows = [None if i in state else _window_of(cache) for i, cache in enumerate(caches)]
    if all(window is None for window in windows):
        return [None] * len(model.layers)  # also a model whose layers share caches (Hunyuan's CLA pairs)
    if False in windows or len(windows) != len(model.layers):
        raise ValueError("the model's caches are not one plain or windowed KV cache per layer")  # architecture_reason refuses it
    return windows


def _window_of(cache) -> int | None | bool:
    """None for a full-context KVCache, the window of a RotatingKVCache that keeps no tokens, else False."""
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    if type(cache) is KVCache:
        return None
    if type(cache) is RotatingKVCache and cache.keep == 0:
        return int(cache.max_size)
    return False


def _logits_reason(model) -> str | None:
    """The runner computes logits by running the model's `__call__` over a stand-in stack
    (`orchard.node.model.head`); traced lazily, so no weights are read."""
    hidden_size = getattr(model.args, "hidden_size", None)
    if hidden_size is None:
        return "its args state no hidden_size, so its head cannot be traced"
    try:
        logits, calls = trace_head(model, mx.zeros((1, _PROBE_TOKENS, hidden_size)))
    except Exception as error:  # a forward that reads token ids or caches outside model.model
        return f"its forward does more than apply a head to model.model's output ({type(error).__name__}: {error})"
    if calls != 1:
        return f"its forward calls the text stack model.model {calls} times, not once"
    expected = (1, _PROBE_TOKENS, getattr(model.args, "vocab_size", None))
    if tuple(logits.shape) != expected:
        return f"its head maps hidden rows {(1, _PROBE_TOKENS, hidden_size)} to logits {tuple(logits.shape)}, not {expected}"
    return None


# ---------------------------------------------------------------- behaviour


@dataclass(frozen=True)
class KVLayout:
    """What an attention layer stores per token through its cache: its KV heads, and the head
    dims of its keys and of its values (which differ in DeepSeek-V2)."""

    num_kv_heads: int
    key_head_dim: int
    value_head_dim: int


@dataclass
class ProbeCache:
    """A layer's stand-in KV cache: it records what the layer stores and how it attends."""

    offset: PackedPositions
    stored: tuple | None = None
    fetched: tuple = ()  # the K/V arrays it handed back, which the attention call must read
    attended: dict | None = None  # the keyword arguments of its attention call
    attended_stored: bool = False  # whether that call read the fetched K/V themselves, with no mask of its own
    mask_windows: list = field(default_factory=list)  # window_size of each mask the model asked this cache for

    def make_mask(self, *args, window_size=None, **kwargs) -> None:
        self.mask_windows.append(window_size)
        return None

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.stored = (tuple(keys.shape), tuple(values.shape))
        self.fetched = (keys, values)
        return keys, values

    @property
    def layout(self) -> KVLayout:
        """What it stored, as the pool would hold it (`_layer_reason` checks K and V have one head count)."""
        (_, kv_heads, _, key_dim), (_, _, _, value_dim) = self.stored
        return KVLayout(kv_heads, key_dim, value_dim)


def attention_modules(model) -> list:
    """The Python modules whose `scaled_dot_product_attention` the layers call: each layer's
    attention class's own module (SmolLM3 reuses Llama's attention class, for one)."""
    names = dict.fromkeys(type(attention_of(layer)).__module__ for _, layer in attention_layers(model))
    return [sys.modules[name] for name in names]


@contextmanager
def _recording_attention(modules):
    """Swap each module's attention call for one that records probe calls and passes others on."""
    with ExitStack() as stack:
        for module in modules:
            stack.enter_context(_recording_one(module))
        yield


@contextmanager
def _recording_one(module):
    original = module.scaled_dot_product_attention

    def record(queries, keys, values, cache, scale, mask, **kwargs):
        if not isinstance(cache, ProbeCache):
            return original(queries, keys, values, cache=cache, scale=scale, mask=mask, **kwargs)
        cache.attended = kwargs
        cache.attended_stored = mask is None and len(cache.fetched) == 2 and \
            keys is cache.fetched[0] and values is cache.fetched[1]
        return mx.zeros((*queries.shape[:-1], values.shape[-1]), dtype=queries.dtype)

    module.scaled_dot_product_attention = record
    try:
        yield
    finally:
        module.scaled_dot_product_attention = original


def trace_layers(model) -> list[ProbeCache]:
    """Build (never evaluate) one forward pass of a few packed tokens over probe caches (mlx-lm's
    own `ArraysCache` for a recurrent-state layer, which the probe does not judge).

    Installs the per-token rope wrapper and the layer patches the runner would install anyway. Raises whatever
    the model raises when handed per-token positions.
    """
    install_positional_rope(model)
    install_layer_patches(model)
    modules = attention_modules(model)
    for module in modules:
        if not hasattr(module, "scaled_dot_product_attention"):
            raise AttributeError(f"{module.__name__} does not call scaled_dot_product_attention")
    from mlx_lm.models.cache import ArraysCache

    positions = PackedPositions(mx.arange(_PROBE_TOKENS, dtype=mx.int32))
    state = set(state_layer_indices(model))
    caches = [ArraysCache(size=2) if i in state else ProbeCache(positions) for i in range(len(model.layers))]
    with _recording_attention(modules):
        model(mx.arange(_PROBE_TOKENS, dtype=mx.int32)[:, None], cache=caches)  # the runner's layout: a token per row
    return caches


def paging_reason(model) -> str | None:
    """Why the model would not page correctly, or None.

    Wraps each rope as the runner does, checks the ropes, then traces the layers: what each
    stores and attends over, one KV layout for all of them.
    """
    install_positional_rope(model)
    if (reason := _rope_reason(model)) is not None:
        return reason
    try:
        caches = trace_layers(model)
    except Exception as error:  # whatever breaks under per-token positions and probe caches
        return f"its layers do not run over paged caches ({type(error).__name__}: {error})"
    return _layers_reason(caches) or _mask_reason(caches, layer_windows(model))


def stored_kv_layout(model) -> KVLayout:
    """The KV layout the model's attention layers store (the pool's), read from a traced forward
    pass rather than from attributes, which families name differently (DeepSeek-V2 names no KV-head
    count and stores its one rope key repeated over every head). `paging_reason` has checked that
    every layer stores this one layout; raises ValueError where no layer stores K/V."""
    stored = [cache for cache in trace_layers(model) if isinstance(cache, ProbeCache) and cache.stored is not None]
    if not stored:
        raise ValueError("no layer stores K/V through its cache")
    return stored[0].layout


#: keyword arguments of the attention call the paged kernels apply
_ATTENTION_KWARGS = frozenset({"sinks", "softcap"})


def _layers_reason(caches: list[ProbeCache]) -> str | None:
    """Every KV layer stores K/V, attends over them with the kernels' rules, all in one layout."""
    layouts = {}
    for index, cache in enumerate(caches):
        if not isinstance(cache, ProbeCache):
            continue  # a recurrent-state layer: its state goes to the state pool whatever its shape
        if (reason := _layer_reason(index, cache)) is not None:
            return reason
        layouts[index] = cache.layout
    first, layout = next(iter(layouts.items()), (None, None))
    for index, other in layouts.items():
        if other != layout:
            return (f"layer {index} stores {other.num_kv_heads} KV heads of key dim {other.key_head_dim} and value dim "
                    f"{other.value_head_dim}, layer {first} {layout.num_kv_heads} of {layout.key_head_dim} and "
                    f"{layout.value_head_dim}; the pool holds one layout for every layer")
    return None


def _layer_reason(index: int, cache: ProbeCache) -> str | None:
    if cache.stored is None:
        return f"layer {index} stores no K/V through its cache"
    if cache.attended is None:
        return f"layer {index} computes attention itself, not through scaled_dot_product_attention"
    if unknown := sorted(set(cache.attended) - _ATTENTION_KWARGS):
        return f"layer {index} passes {', '.join(unknown)} to its attention call, which the paged kernels do not apply"
    if not cache.attended_stored:
        return (f"layer {index} attends over other keys or values than it stores, or with a mask of its own "
                f"(a latent cache, as in multi-head latent attention, cannot be paged as K/V)")
    (_, key_heads, _, _), (_, value_heads, _, _) = cache.stored
    if key_heads != value_heads:
        return f"layer {index} stores {key_heads} key heads and {value_heads} value heads"
    return None


def _mask_reason(caches: list[ProbeCache], windows: list[int | None]) -> str | None:
    """A mask the model builds from a layer's cache must have that layer's window: the kernels
    apply the cache's window, so a model that masks otherwise would be computed differently."""
    for index, (cache, window) in enumerate(zip(caches, windows)):
        if isinstance(cache, ProbeCache) and any(asked != window for asked in cache.mask_windows):
            return f"layer {index} keeps a cache of window {window} but is masked with window {cache.mask_windows}"
    return None


def _rope_reason(model) -> str | None:
    """Each layer's rope must rotate a batch of one-token rows, each at its own position, exactly as it rotates each token alone."""
    for index, layer in attention_layers(model):
        rope: PositionalRoPE = attention_of(layer).rope
        x = mx.random.normal((len(_ROPE_POSITIONS), 2, 1, _rope_width(rope.inner, model)), key=mx.random.key(0))
        try:
            packed = rope(x, offset=PackedPositions(mx.array(_ROPE_POSITIONS, dtype=mx.int32)))
            alone = mx.concatenate([rope.inner(x[t : t + 1], offset=p) for t, p in enumerate(_ROPE_POSITIONS)], axis=0)
            close = np.allclose(np.array(packed), np.array(alone), atol=_ROPE_ATOL, rtol=0)
        except Exception as error:
            return f"layer {index}'s {type(rope.inner).__name__} fails on per-token positions ({type(error).__name__}: {error})"
        if not close:
            return f"layer {index}'s {type(rope.inner).__name__} rotates per-token positions differently"
    return None


def _rope_width(rope, model) -> int:
    """The width to probe a rope at: the head dim the model's args state, as its layers hand their
    ropes whole heads; but a rope that names no `dims` and rotates whatever it is handed by the
    frequencies it keeps (DeepSeek-V2's yarn, applied to the rope part of each head) at theirs."""
    freqs = getattr(rope, "_freqs", None)
    if isinstance(freqs, mx.array) and getattr(rope, "dims", None) is None and getattr(rope, "dim", None) is None:
        return 2 * freqs.size
    args = model.args
    return int(getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads)
