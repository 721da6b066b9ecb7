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

from orchard.node.engine import EngineConfig, LLMEngine, build_step_input
from orchard.node.scheduler import ScheduledChunk
from orchard.node.types import SamplingParams

console = Console(width=160)


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


def _arrive(w: Workload, pending: list[int], start: float) -> list[int]:
    now = time.perf_counter() - start
    ready = []
    while pending and w.arrivals[pending[0]] <= now:
        ready.append(pending.pop(0))
    return ready


def _summary(w: Workload, elapsed: float, first: dict, all_first_at: float | None, end: float) -> dict:
    ttfts = np.array(list(first.values()))
    decode_tokens = w.output_tokens - len(w.prompts)
    decode_s = end - all_first_at if all_first_at is not None else float("nan")
    return {
        "seconds": elapsed,
        "tok_s": w.output_tokens / elapsed,
        "prompt_tok_s": sum(map(len, w.prompts)) / elapsed,
        "decode_tok_s": decode_tokens / decode_s if decode_s > 0 else float("nan"),
        "ttft_p50": float(np.median(ttfts)),
        "ttft_p99": float(np.percentile(ttfts, 99)),
    }


def run_engine(engine: LLMEngine, w: Workload) -> dict:
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in w.max_tokens]
    start = time.perf_counter()
    pending = list(range(len(w.prompts)))
    first_token: dict[str, float] = {}
    added: dict[str, float] = {}
    done = 0
    peak_running = 0
    all_first_at = None
    while done < len(w.prompts):
        for i in _arrive(w, pending, start):
            engine.add_request(f"b{i}", w.prompts[i], params[i])
            added[f"b{i}"] = time.perf_counter()
        if not engine.has_unfinished:
            time.sleep(max(0.0, w.arrivals[pending[0]] - (time.perf_counter() - start)))
            continue
        for out in engine.step():
            if out.request_id not in first_token and out.outputs[0].token_ids_delta:
                first_token[out.request_id] = time.perf_counter() - added[out.request_id]
            done += out.finished
        if all_first_at is None and len(first_token) == len(w.prompts):
            all_first_at = time.perf_counter()
        peak_running = max(peak_running, len(engine.scheduler.running))
    end = time.perf_counter()
    return {**_summary(w, end - start, first_token, all_first_at, end), "peak_running": peak_running}


def run_mlx_lm(model, w: Workload, batch: int) -> dict:
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, completion_batch_size=batch, prefill_batch_size=min(8, batch))
    start = time.perf_counter()
    pending = list(range(len(w.prompts)))
    added: dict[int, float] = {}
    first: dict[int, float] = {}
    done = active = 0
    all_first_at = None
    while done < len(w.prompts):
        ready = _arrive(w, pending, start)
        if ready:
            uids = gen.insert([w.prompts[i] for i in ready], [w.max_tokens[i] for i in ready])
            added.update({uid: time.perf_counter() for uid in uids})
            active += len(ready)
        if active == 0:
            time.sleep(max(0.0, w.arrivals[pending[0]] - (time.perf_counter() - start)))
            continue
        _, responses = gen.next()
        for r in responses:
            first.setdefault(r.uid, time.perf_counter() - added[r.uid])
            if r.finish_reason is not None:
                done += 1
                active -= 1
        if all_first_at is None and len(first) == len(w.prompts):
            all_first_at = time.perf_counter()
    gen.close()
    end = time.perf_counter()
    return _summary(w, end - start, first, all_first_at, end)


def step_overhead(engine: LLMEngine, batch: int, scale: float, steps: int = 24, rounds: int = 5) -> float:
    """Share of a decode step's wall time (at `batch` sequences) beyond the bare forward pass of the same batch.

    The bare forward is the runner alone on the same sequences (graph built and evaluated, no
    scheduling, sampling or bookkeeping); with overlapped steps the engine hides part of its
    host work behind the device, so the share can reach zero. Engine steps and bare forwards
    alternate for `rounds` rounds and the median round counts: a host that slows down for a
    moment slows one round of each, not the whole of one side.
    """
    shares = [_overhead_round(engine, batch, scale, steps) for _ in range(rounds)]
    print(f"  step overhead by round: {', '.join(f'{s * 100:.1f}%' for s in shares)}", flush=True)
    return float(np.median(shares))


def _overhead_round(engine: LLMEngine, batch: int, scale: float, steps: int) -> float:
    vocab = engine.model.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"o{i}", [3 + (i * 7 + j) % (vocab - 10) for j in range(int(64 * scale) or 4)], params)
    while any(s.num_computed < s.num_prompt_tokens for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    for _ in range(3):
        engine.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    step_s = (time.perf_counter() - t0) / steps
    overlap, engine.config.async_scheduling = engine.config.async_scheduling, False
    engine.step()  # settles the step in flight
    engine.config.async_scheduling = overlap
    chunks = [ScheduledChunk(s, 1) for s in engine.scheduler.running]
    for c in chunks:
        engine.kv.ensure_slots(c.seq.seq_id, c.seq.num_computed + 1)
    step = build_step_input(chunks, engine.kv, engine.config.block_size)
    mx.eval(engine.runner.forward(step))
    t0 = time.perf_counter()
    for _ in range(steps):
        mx.eval(engine.runner.forward(step))
    forward_s = (time.perf_counter() - t0) / steps
    for i in range(batch):
        engine.abort(f"o{i}")
    engine.step()
    return max(0.0, 1.0 - forward_s / step_s)


def phase_workload(name: str, vocab: int, scale: float, seed: int = 1) -> Workload:
    """prefill: 16 prompts of 1,024 tokens, one output token each; decode: 64 short prompts, 256 tokens each."""
    rng = np.random.default_rng(seed)
    n, prompt, out = (16, 1024, 1) if name == "prefill" else (64, 32, 256)
    prompt, out = max(1, int(prompt * scale)), max(2 if name == "decode" else 1, int(out * scale))
    prompts = [[int(t) for t in rng.integers(3, vocab - 8, size=prompt)] for _ in range(n)]
    return Workload(prompts, [out] * n, [0.0] * n)


def warm_up_workload(vocab: int, scale: float, batch: int) -> Workload:
    """A few requests of the workloads' prompt lengths, so steps of every shape (chunks, decodes,
    long contexts) have compiled their kernels before anything is timed."""
    rng = np.random.default_rng(99)
    lengths = [max(1, int(n * scale)) for n in (1024, 700, 300, 33, 17, 1)]
    lengths += [max(1, int(32 * scale))] * (batch - len(lengths))  # decode steps as wide as the workloads'
    prompts = [[int(t) for t in rng.integers(3, vocab - 8, size=n)] for n in lengths]
    outputs = [16 if i % 2 else 4 for i in range(len(prompts))]  # the batch narrows as some finish
    return Workload(prompts, outputs, [0.0] * len(prompts))


def profile_row(engine: LLMEngine) -> str:
    """Where the engine's step time went: shares of scheduling, packing, graph building, device wait, the rest."""
    c = engine.counters
    parts = {"schedule": c.schedule_seconds, "pack": c.pack_seconds, "graph": c.graph_seconds, "device": c.device_seconds}
    rest = c.step_seconds - sum(parts.values())
    total = c.step_seconds or 1.0
    shares = ", ".join(f"{k} {v / total * 100:.0f}%" for k, v in {**parts, "sample+rest": rest}.items())
    return f"{c.steps} steps, {c.step_seconds / max(c.steps, 1) * 1e3:.2f} ms/step: {shares}"


SCENARIOS = {
    "burst": lambda vocab, args: make_workload(vocab, args.num_requests, args.scale),
    "poisson": lambda vocab, args: make_workload(vocab, args.num_requests, args.scale, rate=args.rate),
    "prefix": lambda vocab, args: make_workload(vocab, args.num_requests, args.scale, shared_prefix=512),
    "prefill": lambda vocab, args: phase_workload("prefill", vocab, args.scale),
    "decode": lambda vocab, args: phase_workload("decode", vocab, args.scale),
}


def load_bench_model(args):
    """(LoadedModel, label): a random model of a real shape, or a checkpoint on disk (the large demo model by default)."""
    if args.shape:
        from orchard.node.model.random_weights import random_llama

        dtype = getattr(mx, args.dtype)
        return random_llama(args.shape, dtype=dtype, num_layers=args.num_layers), f"random Llama {args.shape} shape, {args.dtype}"
    from orchard.node.model.demo import default_demo_model_path
    from orchard.node.model.loader import load_model

    path = args.model or str(default_demo_model_path("large"))
    return load_model(path), path


def _free(engine) -> None:
    import gc

    engine.close()
    del engine
    gc.collect()
    mx.clear_cache()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="orchard bench engine", description=__doc__)
    ap.add_argument("--model", default=None, help="model path; default: the large demo model")
    ap.add_argument("--shape", choices=("1b", "3b", "8b"), default=None, help="random-weight Llama of this real shape instead of --model")
    ap.add_argument("--dtype", default="bfloat16", help="weights dtype for --shape")
    ap.add_argument("--num-layers", type=int, default=None, help="fewer layers for --shape (quick checks of the code path)")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--scale", type=float, default=1.0, help="multiply prompt/output lengths (1.0 = the issue's workload)")
    ap.add_argument("--rate", type=float, default=4.0, help="Poisson arrivals per second")
    ap.add_argument("--kv-budget-mb", type=float, default=256.0, help="KV budget of the capacity scenario")
    ap.add_argument("--kv-memory-gb", type=float, default=4.0, help="KV pool of the throughput scenarios")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="engine token budget per step (default: the device's)")
    ap.add_argument("--block-size", type=int, default=None, help="tokens per KV block (default: the engine's)")
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                    help="overlap host work with the device (default: the engine's, on)")
    ap.add_argument("--compiled-decode", default="auto", choices=("auto", "on", "off"),
                    help="decode-only steps from compiled graphs (auto: where attention runs a compiled kernel)")
    ap.add_argument("--only", default="burst,poisson,prefix,prefill,decode,capacity,overhead")
    args = ap.parse_args(argv)
    loaded, label = load_bench_model(args)
    console.print(f"model {label}; OpenBLAS preloaded: {'openblas' in os.environ.get('LD_PRELOAD', '')}; device {mx.default_device()}")
    only = args.only.split(",")
    vocab = loaded.vocab_size

    def engine(**kw) -> LLMEngine:
        flags = {"max_num_batched_tokens": args.max_num_batched_tokens, "block_size": args.block_size}
        overrides = {key: value for key, value in flags.items() if value}  # unset: the engine's own default
        if args.async_scheduling is not None:  # unset: the engine's default
            overrides["async_scheduling"] = args.async_scheduling
        compiled = {"on": True, "off": False}.get(args.compiled_decode)
        config = {"max_num_seqs": args.num_requests, "compiled_decode": compiled, **overrides, **kw}
        eng = LLMEngine(EngineConfig(**config), loaded=loaded)
        eng.warm_up()  # as a serving node does before its first request
        return eng

    table = Table(title=f"orchard bench engine: {label}, {mx.default_device()}")
    for col in ("scenario", "orchard", "mlx-lm", "ratio", "TTFT p50 s orchard / mlx-lm", "TTFT p99 s orchard / mlx-lm"):
        table.add_column(col)
    for name in [n for n in only if n in SCENARIOS]:
        w = SCENARIOS[name](vocab, args)
        console.print(f"[bold]{name}[/]: {len(w.prompts)} requests, {sum(map(len, w.prompts))} prompt tokens, {w.output_tokens} output tokens")
        eng = engine(kv_memory_gb=args.kv_memory_gb)
        warm = warm_up_workload(vocab, args.scale, args.num_requests)
        run_engine(eng, warm)  # compile the kernels of every step shape outside the timing
        eng.counters = type(eng.counters)()  # the profile row covers the timed run only
        ours = run_engine(eng, w)
        console.print(f"  orchard profile: {profile_row(eng)}")
        _free(eng)
        run_mlx_lm(loaded.model, warm, batch=args.num_requests)  # the same warm-up
        peer = run_mlx_lm(loaded.model, w, batch=args.num_requests)
        key, unit = {"prefill": ("prompt_tok_s", "prompt tok/s"), "decode": ("decode_tok_s", "decode tok/s")}.get(name, ("tok_s", "tok/s"))
        console.print(f"  orchard {ours[key]:.1f} {unit}, mlx-lm {peer[key]:.1f} {unit}")
        table.add_row(
            name, f"{ours[key]:.1f} {unit}", f"{peer[key]:.1f}", f"{ours[key] / peer[key]:.2f}x",
            f"{ours['ttft_p50']:.2f} / {peer['ttft_p50']:.2f}", f"{ours['ttft_p99']:.2f} / {peer['ttft_p99']:.2f}",
        )
    if "capacity" in only:
        eng = engine(kv_memory_gb=args.kv_budget_mb / 1024)
        w = make_workload(vocab, args.num_requests, args.scale)
        per_token = eng.kv.geometry.bytes_per_token
        budget = args.kv_budget_mb * 2**20
        workload_max = max(len(p) + m for p, m in zip(w.prompts, w.max_tokens))
        ours = run_engine(eng, w)
        for cap_label, max_len in (("workload max", workload_max), ("model context", eng.max_model_len)):
            contiguous = int(budget // (max_len * per_token))
            table.add_row(
                f"capacity @ {args.kv_budget_mb:.0f} MB KV vs contiguous to {cap_label} ({max_len})",
                f"paged peak {ours['peak_running']} seqs", f"contiguous {contiguous} seqs",
                f"{ours['peak_running'] / max(contiguous, 1):.2f}x", "", "",
            )
        _free(eng)
    if "overhead" in only:
        # every one of the batch must run at once: the step loop waits for all of them to be prefilled
        eng = engine(kv_memory_gb=args.kv_memory_gb, max_num_seqs=max(args.num_requests, 32))
        share = step_overhead(eng, 32, args.scale)
        table.add_row("step time outside forward @ batch 32", f"{share * 100:.1f}%", "", "target < 5%", "", "")
        console.print(f"  overhead profile: {profile_row(eng)}")
        _free(eng)
    console.print(table)
    console.print(f"machine: {platform.platform()}, {os.cpu_count()} cores; date {time.strftime('%Y-%m-%d')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
