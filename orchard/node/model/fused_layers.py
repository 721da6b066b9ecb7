"""The plainest decoder layers run with fused projections, in two dimensions, few primitives.

On a GPU a decode step of a small model is bound by the host: MLX spends host time on every
primitive of the step's graph, to replay it and to encode it (about 1-2 us a view, 5-13 us a
kernel; docs/benchmarks.md, "The encode cost per primitive"). mlx-lm's Llama layer is 48
primitives for a batch of one-token rows: seven projections, each a flatten, a transpose of
its weight, a matmul and an unflatten, and queries, keys and values each reshaped and
transposed. A layer of the families below runs here in 27: the query, key and value weights
are one matrix and so are the gate and up weights (one matmul each, the parts sliced off as
views), every unquantized weight is handed to its matmul as an already evaluated transposed
view (no transpose primitive), and the activations stay `[T, hidden]` from layer to layer.

The modules stay mlx-lm's: the fused matrices are made once from their weights and each
module's weight becomes a view of its rows in the fused one (same bytes, no second copy), so
`mlx_lm.generate` on the same model object computes what it computed before. The norms,
ropes (wrapped for packed positions) and activation are the modules' own; only the layer's
wiring is done here, for the classes in `FUSED_FAMILIES` whose projections fuse (all
unquantized, or all quantized alike; biases on all or none). Any other layer, or a stack
with one, runs through mlx-lm's own `__call__`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.activations import swiglu  # mlx-lm's own compiled activation

from orchard.kernels import cpu as cpu_kernels
from orchard.node.model.layers import attention_of

#: mlx-lm modules whose decoder stack and layers are wired as here (Mistral loads as Llama)
FUSED_FAMILIES = {
    "mlx_lm.models.llama": "LlamaModel",
    "mlx_lm.models.qwen2": "Qwen2Model",
    "mlx_lm.models.qwen3": "Qwen3Model",
}


_FUSED_MARK = "_orchard_fused_stack"


@dataclass(frozen=True)
class Projection:
    """`x @ W.T (+ b)` for one weight, or for several stacked along their outputs."""

    weight_t: mx.array | None  # unquantized: the weight's transposed view, evaluated
    bias: mx.array | None
    quantized: nn.QuantizedLinear | None = None  # quantized: a module over the stacked arrays

    def __call__(self, x: mx.array) -> mx.array:
        if self.quantized is not None:
            return self.quantized(x)
        if self.bias is not None:
            return mx.addmm(self.bias, x, self.weight_t)
        return x @ self.weight_t


def _fusable(linears: list) -> bool:
    """All plain Linears, or all QuantizedLinears of one quantization; biases on all or none."""
    kinds = {type(linear) for linear in linears}
    if len(kinds) != 1 or kinds.pop() not in (nn.Linear, nn.QuantizedLinear):
        return False
    if len({"bias" in linear for linear in linears}) != 1:
        return False
    quantization = {(getattr(lin, "group_size", None), getattr(lin, "bits", None), getattr(lin, "mode", None))
                     for lin in linears}
    return len(quantization) == 1


def _stacked(linears: list) -> Projection:
    """One projection over `linears`' outputs side by side; each module's arrays become views
    of their rows in the stacked ones, so the model holds each weight once."""
    names = [name for name in ("weight", "scales", "biases", "bias") if name in linears[0]]
    stacked = {name: mx.concatenate([linear[name] for linear in linears], axis=0) for name in names}
    mx.eval(list(stacked.values()))
    start = 0
    for linear in linears:
        rows = linear["weight"].shape[0]
        for name in names:
            linear[name] = stacked[name][start : start + rows]
        start += rows
    mx.eval([linear[name] for linear in linears for name in names])
    return _projection(linears[0], stacked)


def _single(linear) -> Projection:
    return _projection(linear, {name: linear[name] for name in ("weight", "scales", "biases", "bias") if name in linear})


def _projection(like, arrays: dict) -> Projection:
    if isinstance(like, nn.QuantizedLinear):
        module = nn.QuantizedLinear.__new__(nn.QuantizedLinear)
        nn.Module.__init__(module)
        module.group_size, module.bits, module.mode = like.group_size, like.bits, like.mode
        for name, array in arrays.items():
            module[name] = array
        module.freeze()
        return Projection(None, None, module)
    weight_t = arrays["weight"].T
    mx.eval(weight_t)
    return Projection(weight_t, arrays.get("bias"))


@dataclass(frozen=True)
class FusedLayer:
    """One decoder layer's forward over packed rows `[T, hidden]` through a paged cache."""

    input_norm: nn.Module
    post_norm: nn.Module
    qkv: Projection
    q_norm: nn.Module | None
    k_norm: nn.Module | None
    rope: nn.Module
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    o: Projection
    gate_up: Projection
    intermediate: int
    down: Projection
    activation: Callable[[mx.array, int], mx.array]  # silu(gate) * up of the gate_up rows

    def __call__(self, x: mx.array, cache) -> mx.array:
        rows = x.shape[0]
        heads, kv_heads, width = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv(self.input_norm(x))
        q_end, k_end = heads * width, (heads + kv_heads) * width
        queries = qkv[:, :q_end].reshape(rows, heads, 1, width)
        keys = qkv[:, q_end:k_end].reshape(rows, kv_heads, 1, width)
        if self.q_norm is not None:
            queries, keys = self.q_norm(queries), self.k_norm(keys)
        queries = self.rope(queries, offset=cache.offset).reshape(rows, heads, width)
        keys = self.rope(keys, offset=cache.offset).reshape(rows, kv_heads, width)
        cache.write(keys, qkv[:, k_end:].reshape(rows, kv_heads, width))
        out = cache.attend_packed(queries, self.scale)
        h = x + self.o(out.reshape(rows, -1))
        gate_up = self.gate_up(self.post_norm(h))
        return h + self.down(self.activation(gate_up, self.intermediate))


def _mlx_lm_swiglu(gate_up: mx.array, intermediate: int) -> mx.array:
    return swiglu(gate_up[:, :intermediate], gate_up[:, intermediate:])


def _activation_for(gate_up: Projection) -> Callable[[mx.array, int], mx.array]:
    """The SwiGLU a layer runs, chosen once where the stack is fused: the CPU kernel's (the same
    bits, vectorized) for float32 activations on the CPU, mlx-lm's compiled one elsewhere."""
    plain = gate_up.weight_t is not None  # a quantized projection keeps mlx-lm's
    serves = plain and gate_up.weight_t.dtype == cpu_kernels.ELEMENTWISE_DTYPE and cpu_kernels.elementwise_serve_here()
    return cpu_kernels.swiglu if serves else _mlx_lm_swiglu


def _fuse_layer(layer) -> FusedLayer:
    """The fused form of an `_eligible` layer. Called once per layer: fusing turns the modules'
    weights into views of the stacked ones."""
    attention, mlp = attention_of(layer), layer.mlp
    gate_up = _stacked([mlp.gate_proj, mlp.up_proj])
    return FusedLayer(
        input_norm=layer.input_layernorm,
        post_norm=layer.post_attention_layernorm,
        qkv=_stacked([attention.q_proj, attention.k_proj, attention.v_proj]),
        q_norm=getattr(attention, "q_norm", None),
        k_norm=getattr(attention, "k_norm", None),
        rope=attention.rope,
        num_heads=attention.n_heads,
        num_kv_heads=attention.n_kv_heads,
        head_dim=attention.q_proj["weight"].shape[0] // attention.n_heads,  # rows = outputs, quantized or not
        scale=attention.scale,
        o=_single(attention.o_proj),
        gate_up=gate_up,
        intermediate=mlp.gate_proj["weight"].shape[0],
        down=_single(mlp.down_proj),
        activation=_activation_for(gate_up),
    )


class FusedStack:
    """A decoder stack of fused layers: embedding, layers, final norm over `[T]` token ids."""

    def __init__(self, stack, layers: list[FusedLayer]):
        self.embed = stack.embed_tokens
        self.norm = stack.norm
        self.layers = layers

    def __call__(self, tokens: mx.array, caches: list) -> mx.array:
        """Hidden rows `[T, hidden]` after the final norm."""
        h = self.embed(tokens)
        for layer, cache in zip(self.layers, caches):
            h = layer(h, cache)
        return self.norm(h)


def fuse_stack(stack) -> FusedStack | None:
    """The stack run with fused layers, when its family is one of `FUSED_FAMILIES` and every
    layer fuses; None (and nothing changed) otherwise. Fused once per stack: every engine
    over the same model shares the one set of stacked weights."""
    fused = getattr(stack, _FUSED_MARK, None)
    if fused is not None:
        return fused
    if FUSED_FAMILIES.get(type(stack).__module__) != type(stack).__name__:
        return None
    if getattr(stack, "pipeline_size", 1) != 1 or not all(_eligible(layer) for layer in stack.layers):
        return None
    fused = FusedStack(stack, [_fuse_layer(layer) for layer in stack.layers])
    setattr(stack, _FUSED_MARK, fused)
    return fused


def _eligible(layer) -> bool:
    """Whether `layer` is of a fused family and its projections fuse (checked for every layer
    before any is changed)."""
    attention, mlp = attention_of(layer), getattr(layer, "mlp", None)
    if FUSED_FAMILIES.get(type(layer).__module__) is None or type(layer).__name__ != "TransformerBlock":
        return False
    if attention is None or type(attention).__name__ != "Attention" or mlp is None or type(mlp).__name__ != "MLP":
        return False
    return (_fusable([attention.q_proj, attention.k_proj, attention.v_proj]) and _fusable([mlp.gate_proj, mlp.up_proj])
            and _fusable([attention.o_proj]) and _fusable([mlp.down_proj]))
