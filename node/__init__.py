"""One machine: the paged engine, its APIs and its Ray actor.

`LLM`, `LLMEngine`, `EngineConfig`, `AsyncEngine` and `SamplingParams` are exported
lazily so that importing `node.types` (gateway, coordinator) never loads MLX.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "LLM": "node.llm",
    "LLMEngine": "node.engine",
    "EngineConfig": "node.engine",
    "AsyncEngine": "node.async_engine",
    "SamplingParams": "node.types",
    "RequestOutput": "node.types",
    "CompletionOutput": "node.types",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'node' has no attribute {name!r}")
