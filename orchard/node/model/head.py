"""The logits of selected hidden rows, computed by the model's own `__call__`.

mlx-lm's `Model.__call__` is the text stack (`self.model`) followed by the model's head:
a tied embedding or `lm_head`, quantized or not, then whatever the family does to the
logits (Granite divides them, Cohere multiplies them, Gemma 2 soft-caps them). The engine
runs the stack itself over a packed step and needs logits for a few rows only, so it runs
the same `__call__` on a view of the model whose stack hands back those rows: every
family's head then comes for free, and no head is ever chosen from config flags.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from orchard.node.model.layers import stack_name


class _ComputedStack:
    """Stands in for `model.model` in its `__call__`: returns hidden rows already computed;
    every attribute read (embed_tokens, args) goes to the real stack."""

    def __init__(self, stack: Any, hidden: mx.array):
        self._stack = stack
        self._hidden = hidden
        self.calls = 0

    def __call__(self, *args, **kwargs) -> mx.array:
        self.calls += 1
        return self._hidden

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stack, name)


class _ModelView:
    """The model as its own `__call__` sees it, with the text stack swapped for `stack`."""

    def __init__(self, model: Any, name: str, stack: _ComputedStack):
        self._model = model
        setattr(self, name, stack)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def trace_head(model: Any, hidden: mx.array, name: str | None = None) -> tuple[mx.array, int]:
    """(logits, how many times the stack was called) of the model's `__call__` over `hidden`
    `[1, T, hidden_size]`. Token ids and cache are passed as None: a `__call__` that reads
    them for anything but the stack raises here. `name`: the stack's attribute, when known."""
    name = name or stack_name(model)
    stack = _ComputedStack(getattr(model, name), hidden)
    logits = type(model).__call__(_ModelView(model, name, stack), None, None)
    return logits, stack.calls


class ModelHead:
    """Logits `[N, vocab]` of hidden rows `[N, hidden_size]`, as the model's own forward makes them."""

    def __init__(self, model: Any):
        self.model = model
        self._stack_name = stack_name(model)  # looked up once, not at every step

    def __call__(self, hidden: mx.array) -> mx.array:
        logits, _ = trace_head(self.model, hidden[None], self._stack_name)
        return logits[0]
