"""One machine: the paged engine's loop and its APIs; the model it runs (model/) and its edge to the cluster (serving/).

    engine.py        the engine: continuous batching over the paged KV pool (`add_request`, `step`, `abort`)
    scheduler.py     iteration-level scheduling under a token budget
    sequence.py      a sequence (one continuation) and the request that groups them
    sampling.py      one step's logits to tokens, per row
    structured.py    structured output at sampling: each constrained row's grammar state as a token mask
    constraint.py    what a request's output must match, compiled once where the request enters
    detokenizer.py   incremental, streaming-safe detokenization
    async_engine.py  an asyncio face on the engine: one thread steps, coroutines stream
    llm.py           offline batch generation: `LLM(model=...).generate(prompts, SamplingParams(...))`
    types.py         what a caller hands the engine and gets back (no MLX)
    errors.py        named request errors (no MLX)
    rates.py         moving averages of what the node measures about itself
    openblas.py      OpenBLAS for MLX's Linux CPU build (`python -m orchard.node.openblas`)
    heap.py          a serving process's loaded objects frozen out of the collector's full passes
    model/           the model: loader, paged runner, capability checks, layer seams, the demo model
    serving/         the Ray actor, its output streams, the KV mover, the join agent

`cluster -> node -> kvcache, kernels`; inside node, `serving -> loop -> model`.

`LLM`, `LLMEngine`, `EngineConfig`, `AsyncEngine` and `SamplingParams` are exported
lazily so that importing `orchard.node.types` (gateway, coordinator) never loads MLX.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "LLM": "orchard.node.llm",
    "LLMEngine": "orchard.node.engine",
    "EngineConfig": "orchard.node.engine",
    "AsyncEngine": "orchard.node.async_engine",
    "SamplingParams": "orchard.node.types",
    "RequestOutput": "orchard.node.types",
    "CompletionOutput": "orchard.node.types",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
