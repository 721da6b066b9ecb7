"""What structured output costs a decode step: `orchard bench grammar` (or `python -m orchard.cluster.bench.grammar`).

32 sequences decode together twice: free, then each held to a JSON schema long enough that
none finishes during the measured steps. The table gives the step time of both runs, the
host time llguidance spends filling the batch's masks (one batched call per step), the
device time of applying them, and the mask's share of the free step: the target is < 10 %.
A constrained step also settles the step before it (its matcher needs the last token), so
the constrained step time includes the overlap it gives up; the table keeps the two apart.
`--tokenizer` adds the fill time on another vocabulary (e.g. a 128k one) for the same walk.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import mlx.core as mx
import numpy as np

from orchard.node.engine import EngineConfig, LLMEngine
from orchard.node.structured import apply_bitmask
from orchard.node.types import SamplingParams

BATCH = 32
#: Twelve records of four fields: over 150 tokens, so no sequence completes its grammar while measured.
SCHEMA = {
    "type": "array",
    "minItems": 12,
    "maxItems": 12,
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 9999},
            "name": {"type": "string", "maxLength": 12},
            "kind": {"enum": ["alpha", "beta", "gamma"]},
            "ok": {"type": "boolean"},
        },
        "required": ["id", "name", "kind", "ok"],
        "additionalProperties": False,
    },
}


def _decode_steps(engine: LLMEngine, constrained: bool, warm: int, steps: int) -> tuple[list[float], float, int]:
    """Per-step wall times of `steps` decode steps at batch 32, after `warm` steps; and the mask fill totals."""
    rng = np.random.default_rng(0)
    for i in range(BATCH):
        prompt = rng.integers(10, engine.model.vocab_size - 10, size=16).tolist()
        params = SamplingParams(max_tokens=warm + steps + 8, temperature=1.0, seed=i, ignore_eos=True,
                                constraint={"json_schema": SCHEMA} if constrained else None)
        engine.add_request(f"{'c' if constrained else 'f'}{i}", prompt, params)
    for _ in range(warm):
        engine.step()
    fill0, rows0 = engine.grammars.fill_seconds, engine.grammars.filled_rows
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    running = len(engine.scheduler.running)
    for rid in list(engine.requests):
        engine.abort(rid)
    while engine.has_unfinished:
        engine.step()
    assert running == BATCH, f"only {running} sequences decoded together"
    return times, engine.grammars.fill_seconds - fill0, engine.grammars.filled_rows - rows0


def _apply_seconds(vocab: int, repeats: int = 20) -> float:
    logits = mx.random.normal((BATCH, vocab))
    bitmask = np.random.default_rng(0).integers(-(2**31), 2**31 - 1, size=(BATCH, (vocab + 31) // 32), dtype=np.int32)
    mx.eval(apply_bitmask(logits, bitmask))
    t0 = time.perf_counter()
    for _ in range(repeats):
        mx.eval(apply_bitmask(logits, bitmask))
    return (time.perf_counter() - t0) / repeats


def _fill_on(tokenizer_path: str, walk: int) -> tuple[int, float]:
    """Mean batched fill time for 32 matchers on another vocabulary, each walking the schema with its own random tokens."""
    import llguidance
    import llguidance.numpy as lln

    from orchard.node.constraint import Constraint

    tok = llguidance.LLTokenizer(open(tokenizer_path, encoding="utf-8").read())
    grammar = Constraint.from_dict({"json_schema": SCHEMA}).grammar
    matchers = [llguidance.LLMatcher(tok, grammar, log_level=0) for _ in range(BATCH)]
    executor, bitmask = llguidance.LLExecutor(), lln.allocate_token_bitmask(BATCH, tok.vocab_size)
    rng, times = np.random.default_rng(0), []
    for _ in range(walk):
        t0 = time.perf_counter()
        lln.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(matchers)], bitmask)
        times.append(time.perf_counter() - t0)
        bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, : tok.vocab_size]
        for i, m in enumerate(matchers):  # a random allowed token: a walk no model bias shortens
            m.consume_token(int(rng.choice(np.flatnonzero(bits[i]))))
    return tok.vocab_size, statistics.mean(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="orchard bench grammar", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model path; default: the large demo model")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warm", type=int, default=8, help="steps first run and not measured (prefill, first decodes)")
    ap.add_argument("--tokenizer", default=None, help="a tokenizer.json whose vocabulary the fill is also timed on")
    args = ap.parse_args(argv)
    from orchard.node.model.demo import default_demo_model_path

    path = args.model or str(default_demo_model_path("large"))
    engine = LLMEngine(EngineConfig(model=path, max_num_seqs=BATCH, max_num_batched_tokens=1024, kv_memory_gb=0.5))
    free, _, _ = _decode_steps(engine, False, args.warm, args.steps)
    held, fill_s, rows = _decode_steps(engine, True, args.warm, args.steps)
    free_ms, held_ms = statistics.median(free) * 1e3, statistics.median(held) * 1e3
    fill_ms = fill_s / args.steps * 1e3
    apply_ms = _apply_seconds(engine.model.vocab_size) * 1e3
    print(f"# grammar masks at batch {BATCH}: {path}, vocab {engine.model.vocab_size}, {platform.machine()} "
          f"{mx.default_device()}, {time.strftime('%Y-%m-%d')}")
    print(f"{'metric':46} {'value':>10}")
    rows_out = [
        ("decode step, free (median ms)", f"{free_ms:.2f}"),
        ("decode step, all 32 constrained (median ms)", f"{held_ms:.2f}"),
        ("mask fill per step, 32 rows (ms)", f"{fill_ms:.3f}"),
        ("mask fill per token (us)", f"{fill_s / max(rows, 1) * 1e6:.1f}"),
        ("mask apply per step, 32 rows (ms)", f"{apply_ms:.3f}"),
        ("mask (fill + apply) / free step", f"{(fill_ms + apply_ms) / free_ms:.1%}"),
        ("constrained step / free step - 1", f"{held_ms / free_ms - 1:.1%}"),
    ]
    if args.tokenizer:
        vocab, fill = _fill_on(args.tokenizer, args.steps)
        rows_out.append((f"mask fill per step, 32 rows, vocab {vocab} (ms)", f"{fill * 1e3:.3f}"))
        rows_out.append((f"mask apply per step, 32 rows, vocab {vocab} (ms)", f"{_apply_seconds(vocab) * 1e3:.3f}"))
    for name, value in rows_out:
        print(f"{name:46} {value:>10}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
