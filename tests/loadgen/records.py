"""Hand-made request records with known latencies."""

from __future__ import annotations

from orchard.cluster.bench.loadgen.client import RequestRecord


def record(ttft=0.1, itl=(0.02, 0.02), out=None, error=None, prompt_tokens=10, start=0.0, conv=0, turn=0):
    """A successful (or failed) record whose E2E latency is TTFT plus the gaps."""
    out = len(itl) + 1 if out is None else out
    rec = RequestRecord(conversation_id=conv, turn=turn, start_s=start, input_tokens=prompt_tokens, max_tokens=out)
    if error is not None:
        rec.error = error
        return rec
    rec.prompt_tokens = prompt_tokens
    rec.output_tokens = out
    rec.content_chunks = len(itl) + 1
    rec.token_source = "usage"
    rec.ttft_s = ttft
    rec.itl_s = list(itl)
    rec.e2el_s = ttft + sum(itl)
    return rec
