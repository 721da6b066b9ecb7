"""`orchard bench engine`: this engine against mlx-lm's BatchGenerator, same model, same run.

Scenarios (one table): 64 mixed requests arriving at once and as a Poisson stream; the
same with a shared 512-token system prompt (TTFT p50 too); the most sequences that fit a
fixed KV budget, paged vs contiguous preallocation; and the share of each step spent
outside the forward pass at batch 32. Lengths can be scaled down with --scale for a
quick look; the recorded run states the scale it used.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from rich.console import Console
from rich.table import Table

from node.engine import EngineConfig, LLMEngine
from node.types import SamplingParams

console = Console()


@dataclass
class Workload:
    prompts: list[list[int]]
    max_tokens: list[int]
    arrivals: list[float]  # seconds after start

    @property
    def output_tokens(self) -> int:
        return sum(self.max_tokens)


def make_workload(vocab: int, n: int, scale: float, *, shared_prefix: int = 0, rate: float | None = None, seed: int = 0) -> Workload:
    rng = np.random.default_rng(seed)
    prefix = list(rng.integers(3, vocab - 8, size=int(shared_prefix * scale)))
    lens = rng.integers(int(32 * scale) or 1, int(1024 * scale) + 1, size=n)
    outs = rng.integers(max(1, int(16 * scale)), int(256 * scale) + 1, size=n)
    prompts = [prefix + list(rng.integers(3, vocab - 8, size=int(k))) for k in lens]
    arrivals = list(np.cumsum(rng.exponential(1.0 / rate, size=n))) if rate else [0.0] * n
    return Workload([[int(t) for t in p] for p in prompts], [int(o) for o in outs], arrivals)


def run_engine(engine: LLMEngine, w: Workload) -> dict:
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in w.max_tokens]
    start = time.perf_counter()
    pending = list(range(len(w.prompts)))
    first_token: dict[str, float] = {}
    added: dict[str, float] = {}
    done = 0
    peak_running = 0
    while done < len(w.prompts):
        now = time.perf_counter() - start
        while pending and w.arrivals[pending[0]] <= now:
            i = pending.pop(0)
            engine.add_request(f"b{i}", w.prompts[i], params[i])
            added[f"b{i}"] = time.perf_counter()
        if not engine.has_unfinished:
            time.sleep(max(0.0, w.arrivals[pending[0]] - now))
            continue
        for out in engine.step():
            if out.request_id not in first_token and out.outputs[0].token_ids:
                first_token[out.request_id] = time.perf_counter() - added[out.request_id]
            done += out.finished
        peak_running = max(peak_running, len(engine.scheduler.running))
    elapsed = time.perf_counter() - start
    return {"seconds": elapsed, "tok_s": w.output_tokens / elapsed, "ttft_p50": float(np.median(list(first_token.values()))), "peak_running": peak_running}


def run_mlx_lm(model, w: Workload, batch: int) -> dict:
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, completion_batch_size=batch, prefill_batch_size=min(8, batch))
    start = time.perf_counter()
    pending = list(range(len(w.prompts)))
    added: dict[int, float] = {}
    first: dict[int, float] = {}
    done = active = 0
    while done < len(w.prompts):
        now = time.perf_counter() - start
        ready = []
        while pending and w.arrivals[pending[0]] <= now:
            ready.append(pending.pop(0))
        if ready:
            uids = gen.insert([w.prompts[i] for i in ready], [w.max_tokens[i] for i in ready])
            added.update({uid: time.perf_counter() for uid in uids})
            active += len(ready)
        if active == 0:
            time.sleep(max(0.0, w.arrivals[pending[0]] - now))
            continue
        _, responses = gen.next()
        for r in responses:
            first.setdefault(r.uid, time.perf_counter() - added[r.uid])
            if r.finish_reason is not None:
                done += 1
                active -= 1
    gen.close()
    elapsed = time.perf_counter() - start
    return {"seconds": elapsed, "tok_s": w.output_tokens / elapsed, "ttft_p50": float(np.median(list(first.values())))}


def step_overhead(engine: LLMEngine, batch: int, scale: float) -> float:
    """Share of step time outside the forward pass while `batch` sequences decode."""
    vocab = engine.model.vocab_size
    for i in range(batch):
        engine.add_request(f"o{i}", [3 + (i * 7 + j) % (vocab - 10) for j in range(int(64 * scale) or 4)], SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))
    while any(s.num_computed < s.num_prompt_tokens for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    c0 = (engine.counters.forward_seconds, engine.counters.step_seconds)
    for _ in range(24):
        engine.step()
    fwd = engine.counters.forward_seconds - c0[0]
    total = engine.counters.step_seconds - c0[1]
    for i in range(batch):
        engine.abort(f"o{i}")
    engine.step()
    return 1.0 - fwd / total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="orchard bench engine", description=__doc__)
    ap.add_argument("--model", default=None, help="model path; default: the large demo model")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--scale", type=float, default=1.0, help="multiply prompt/output lengths (1.0 = the issue's workload)")
    ap.add_argument("--rate", type=float, default=4.0, help="Poisson arrivals per second")
    ap.add_argument("--kv-budget-mb", type=float, default=256.0)
    ap.add_argument("--only", default="burst,poisson,prefix,capacity,overhead")
    args = ap.parse_args(argv)
    from mlx_lm import load

    from node.demo_model import default_demo_model_path

    path = args.model or str(default_demo_model_path("large"))
    console.print(f"model {path}; OpenBLAS preloaded: {'openblas' in os.environ.get('LD_PRELOAD', '')}; device {mx.default_device()}")
    model, _ = load(path)
    only = set(args.only.split(","))
    rows = []

    def engine(**kw) -> LLMEngine:
        return LLMEngine(EngineConfig(model=path, max_num_seqs=args.num_requests, **kw))

    base = engine(kv_memory_gb=2.0)
    vocab = base.model.vocab_size
    scenarios = [("burst", {}), ("poisson", {"rate": args.rate}), ("prefix", {"shared_prefix": 512})]
    for name, kw in scenarios:
        if name not in only:
            continue
        w = make_workload(vocab, args.num_requests, args.scale, **kw)
        console.print(f"[bold]{name}[/]: {len(w.prompts)} requests, {sum(map(len, w.prompts))} prompt tokens, {w.output_tokens} output tokens")
        ours = run_engine(engine(kv_memory_gb=2.0), w)
        peer = run_mlx_lm(model, w, batch=args.num_requests)
        rows.append((name, ours, peer))
        console.print(f"  orchard {ours['tok_s']:.1f} tok/s, mlx-lm {peer['tok_s']:.1f} tok/s")
    table = Table(title="orchard bench engine")
    for col in ("scenario", "orchard tok/s", "mlx-lm tok/s", "ratio", "orchard TTFT p50 s", "mlx-lm TTFT p50 s"):
        table.add_column(col)
    for name, ours, peer in rows:
        table.add_row(name, f"{ours['tok_s']:.1f}", f"{peer['tok_s']:.1f}", f"{ours['tok_s'] / peer['tok_s']:.2f}x", f"{ours['ttft_p50']:.2f}", f"{peer['ttft_p50']:.2f}")
    if "capacity" in only:
        eng = engine(kv_memory_gb=args.kv_budget_mb / 1024)
        w = make_workload(vocab, args.num_requests, args.scale)
        per_token = eng.kv.geometry.bytes_per_token
        budget = args.kv_budget_mb * 2**20
        workload_max = max(len(p) + m for p, m in zip(w.prompts, w.max_tokens))
        ours = run_engine(eng, w)
        for label, max_len in (("workload max", workload_max), ("model context", eng.max_model_len)):
            contiguous = int(budget // (max_len * per_token))
            table.add_row(
                f"capacity @ {args.kv_budget_mb:.0f} MB KV vs contiguous to {label} ({max_len})",
                f"paged peak {ours['peak_running']} seqs", f"contiguous {contiguous} seqs",
                f"{ours['peak_running'] / max(contiguous, 1):.2f}x", "", "",
            )
    if "overhead" in only:
        share = step_overhead(engine(kv_memory_gb=2.0), 32, args.scale)
        table.add_row("step time outside forward @ batch 32", f"{share * 100:.1f}%", "", "target < 10%", "", "")
    console.print(table)
    console.print(f"machine: {platform.platform()}, {os.cpu_count()} cores; date {time.strftime('%Y-%m-%d')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
