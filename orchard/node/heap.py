"""A serving process's loaded objects kept out of the garbage collector's full passes.

A process that has loaded what it serves with (a model, a tokenizer, Ray, FastAPI, pydantic's
schemas) holds 80k-190k objects that live as long as it does. CPython's collector walks all of
them in every full pass, and it starts one whenever enough new objects have survived: a KV
pull of 512 blocks makes thousands, and so do 32 streaming requests in a gateway. Frozen
(`gc.freeze`, as vLLM's servers do once started), a full pass walks only what came after.
Measured: a full pass over a node with the small demo model loaded took ~25 ms and a KV pull's
export waited that long on one; a gateway over Ray under 32 streaming clients ran 15 full
passes of ~115 ms each in one run of 960 requests (docs/benchmarks.md, "serve").
"""

from __future__ import annotations

import gc


def freeze_loaded_objects() -> int:
    """Collect what is already garbage, then freeze the rest; returns how many objects are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
