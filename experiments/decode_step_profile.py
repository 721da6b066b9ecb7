"""Where a paged decode step's time goes on a device: the whole step, the forward alone, and the
forward with the KV write or the attention taken out, beside mlx-lm's own decode step.

`python -m experiments.decode_step_profile --shape 1b --batch 64` prints one line per variant
(ms per step, median of --steps). Taking a piece out gives wrong tokens; only times are read.
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx
import numpy as np

from orchard import kernels
from orchard.node.engine import EngineConfig, LLMEngine, build_step_input
from orchard.node.model import runner as model_runner
from orchard.node.model.random_weights import random_llama
from orchard.node.types import SamplingParams


def _median_ms(fn, steps: int) -> float:
    fn()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times) * 1e3)


def decoding_engine(loaded, batch: int, prompt: int, kv_gb: float, budget: int | None = None,
                    compiled_decode: bool | None = None, settle_in_thread: bool | None = None) -> LLMEngine:
    budget = budget or max(2048, batch * prompt)
    config = EngineConfig(max_num_seqs=batch + 1, max_num_batched_tokens=budget, kv_memory_gb=kv_gb, compiled_decode=compiled_decode,
                          settle_in_thread=settle_in_thread)
    engine = LLMEngine(config, loaded=loaded)
    for i in range(batch):
        engine.add_request(f"p{i}", [3 + (i * 7 + j) % 1000 for j in range(prompt)], SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True))
    while any(s.num_computed < s.num_prompt_tokens for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    engine.step()  # settles the step in flight, so the scheduler below sees host-known tokens
    engine.config.async_scheduling = False
    engine.step()
    return engine


def forward_variants(engine: LLMEngine, steps: int) -> dict[str, float]:
    """The eager forward and its variants; the compiled decode graph first, when the runner has one."""
    sched = engine.scheduler.schedule()
    step = build_step_input(sched.chunks, engine.kv, engine.config.block_size)
    runner = engine.runner
    out = {}
    if runner.compiled_decode is not None:
        print(f"orchard compiled decode step graph: {graph_ops(runner.forward(step))} primitives")
        out["compiled forward (graph + device)"] = _median_ms(lambda: mx.eval(runner.forward(step)), steps)
        out["compiled forward, launch only"] = _median_ms(lambda: runner.forward(step), steps)
    compiled, runner.compiled_decode = runner.compiled_decode, None
    print(f"orchard decode step graph: {graph_ops(runner.forward(step))} primitives")
    out["forward (graph + device)"] = _median_ms(lambda: mx.eval(runner.forward(step)), steps)
    out["graph build only"] = _median_ms(lambda: runner.forward(step), steps)
    real_write = kernels.write_kv
    model_runner.kernels.write_kv = lambda k, v, *_: (k, v)
    out["forward without KV write"] = _median_ms(lambda: mx.eval(runner.forward(step)), steps)
    model_runner.kernels.write_kv = real_write
    # attend_packed is the call both wirings make (mlx-lm's modules through `attend`, the fused layers directly)
    real_attend = model_runner.PagedLayerCache.attend_packed
    model_runner.PagedLayerCache.attend_packed = lambda self, q, scale, *_, **__: q
    out["forward without attention"] = _median_ms(lambda: mx.eval(runner.forward(step)), steps)
    model_runner.kernels.write_kv = lambda k, v, *_: (k, v)
    out["forward without KV write and attention"] = _median_ms(lambda: mx.eval(runner.forward(step)), steps)
    model_runner.kernels.write_kv = real_write
    model_runner.PagedLayerCache.attend_packed = real_attend
    runner.compiled_decode = compiled
    return out


def graph_ops(*outputs) -> int:
    """Primitives in the lazy graph behind `outputs` (each one a kernel launch at most; views launch none)."""
    import io

    dot = io.StringIO()
    mx.export_to_dot(dot, *outputs)
    return dot.getvalue().count("shape=rectangle")


def mlx_lm_step(model, batch: int, prompt: int, steps: int) -> float:
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    tokens = mx.array(np.full((batch, prompt), 5, dtype=np.int32))
    mx.eval(model(tokens, cache=cache))
    y = mx.array(np.full((batch, 1), 7, dtype=np.int32))
    print(f"mlx-lm decode step graph: {graph_ops(model(y, cache=cache))} primitives")
    return _median_ms(lambda: mx.eval(model(y, cache=cache)), steps)


def host_profile(engine: LLMEngine, steps: int, top: int = 25) -> None:
    """cProfile over `steps` overlapped engine steps: which host functions the step's time goes to."""
    import cProfile
    import pstats

    engine.config.async_scheduling = True
    engine.step()
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(steps):
        engine.step()
    profile.disable()
    engine.step()
    engine.config.async_scheduling = False
    engine.step()  # settled again: forward_variants schedules host-known tokens
    pstats.Stats(profile).sort_stats("tottime").print_stats(top)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", default="1b")
    ap.add_argument("--model", default=None, help="a model path (e.g. the demo model) instead of --shape")
    ap.add_argument("--num-layers", type=int, default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--kv-memory-gb", type=float, default=4.0)
    ap.add_argument("--mixed-prompt", type=int, default=0, help="add one request of this many prompt tokens: the step mixes its chunk with the decodes")
    ap.add_argument("--budget", type=int, default=512, help="token budget of the mixed step")
    ap.add_argument("--compiled-decode", default="auto", choices=("auto", "on", "off"))
    ap.add_argument("--cprofile", type=int, default=0, metavar="N", help="also print the host functions taking most time over N whole steps")
    args = ap.parse_args(argv)
    if args.model:
        from orchard.node.model.loader import load_model

        loaded = load_model(args.model)
    else:
        loaded = random_llama(args.shape, dtype=getattr(mx, args.dtype), num_layers=args.num_layers)
    compiled = {"on": True, "off": False}.get(args.compiled_decode)
    engine = decoding_engine(loaded, args.batch, args.prompt, args.kv_memory_gb, args.budget if args.mixed_prompt else None, compiled)
    rows = {}
    if args.mixed_prompt:
        engine.add_request("long", [5 + j % 900 for j in range(args.mixed_prompt)], SamplingParams(temperature=0.0, max_tokens=1))
    else:
        rows["engine.step() (whole step)"] = _median_ms(engine.step, args.steps)
        if engine.runner.compiled_decode is not None:
            compiled, engine.runner.compiled_decode = engine.runner.compiled_decode, None
            rows["engine.step() (whole step), eager decode"] = _median_ms(engine.step, args.steps)
            engine.runner.compiled_decode = compiled
    if args.cprofile:
        host_profile(engine, args.cprofile)
    rows.update(forward_variants(engine, args.steps))
    rows["mlx-lm decode step (contiguous cache)"] = mlx_lm_step(loaded.model, args.batch, args.prompt, args.steps)
    mixed = f", plus a {args.mixed_prompt}-token prompt's chunk (budget {args.budget})" if args.mixed_prompt else ""
    what = args.model or f"{args.shape} shape"
    print(f"{what}, batch {args.batch}, context ~{args.prompt}{mixed}, {mx.default_device()}, backend {engine.runner.attention_backend}")
    for name, ms in rows.items():
        print(f"  {name:45s} {ms:8.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
