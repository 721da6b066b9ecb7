"""Where an engine step's wall time goes on a device, phase by phase, over a bench workload.

`python -m experiments.step_phases --shape 1b --workload decode` runs `orchard bench engine`'s
warm-up and then one of its workloads through an overlapped engine, with a timer around each
host phase of a step (scheduling, packing, the forward's graph, sampling's graph, the launch,
waiting for the previous step's tokens, turning tokens into outputs). It prints the mean ms per
step of each phase and the spread of whole-step times, so a stall (a kernel compiled mid-run)
shows apart from a step that is slow every time.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import mlx.core as mx
import numpy as np

import orchard.node.engine as engine_module
from orchard import kernels
from orchard.cluster.bench.engine import SCENARIOS, run_engine, warm_up_workload
from orchard.node import sampling
from orchard.node.engine import EngineConfig, LLMEngine
from orchard.node.model import runner as model_runner
from orchard.node.model.random_weights import random_llama


class PhaseTimers:
    """Wall seconds per named phase, summed over the run."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - t0
        return timed


def instrument(engine: LLMEngine, timers: PhaseTimers) -> None:
    """Time the engine's phases in place (module functions, bound methods and mx.async_eval)."""
    engine.scheduler.schedule = timers.wrap("schedule", engine.scheduler.schedule)
    engine_module.build_step_input = timers.wrap("pack (build_step_input)", engine_module.build_step_input)
    engine.runner.forward = timers.wrap("forward graph (plan + layers)", engine.runner.forward)
    engine._sample_on_device = timers.wrap("sampling graph", engine._sample_on_device)
    engine_module.mx.async_eval = timers.wrap("async_eval (launch)", mx.async_eval)
    sampling.DeviceSample.resolve = timers.wrap("wait for tokens (resolve)", sampling.DeviceSample.resolve)
    engine._resolve_token = timers.wrap("stop rules + detokenize", engine._resolve_token)
    engine._request_output = timers.wrap("request outputs", engine._request_output)


def record_plans(plans: list) -> None:
    """Keep what each step's attention plan chose (the kernel variants it launches), in step order."""
    plan_varlen = kernels.plan_varlen

    def recorded(starts, lengths, tables, **kw):
        plan = plan_varlen(starts, lengths, tables, **kw)
        plans.append(_variants(plan, starts))
        return plan
    model_runner.kernels = _KernelsWith(recorded)


class _KernelsWith:
    """The kernels module with plan_varlen replaced."""

    def __init__(self, plan_varlen):
        self.plan_varlen = plan_varlen

    def __getattr__(self, name):
        return getattr(kernels, name)


def _variants(plan, starts) -> str:
    q_lens = np.diff(np.asarray(starts))
    k = plan.kernel
    if k is None:
        return f"{int(starts[-1])} tokens, {q_lens.size} seqs (reference)"
    d = k.decode
    decode = f"decode {d.host_rows.size} rows partition {d.plan.partition_size} x{d.plan.num_partitions}" if d is not None else "no decode"
    chunks = f"{int((q_lens > 1).sum())} chunks (longest {int(q_lens.max())}), {k.num_units} units, split {k.split_rows is not None}"
    return f"{int(starts[-1])} tokens: {chunks}; {decode}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", default="1b")
    ap.add_argument("--num-layers", type=int, default=None)
    ap.add_argument("--workload", default="decode", choices=sorted(SCENARIOS))
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--rate", type=float, default=4.0)
    ap.add_argument("--kv-memory-gb", type=float, default=4.0)
    args = ap.parse_args(argv)
    loaded = random_llama(args.shape, num_layers=args.num_layers)
    engine = LLMEngine(EngineConfig(max_num_seqs=args.num_requests, kv_memory_gb=args.kv_memory_gb), loaded=loaded)
    run_engine(engine, warm_up_workload(loaded.vocab_size, args.scale, args.num_requests))
    timers = PhaseTimers()
    instrument(engine, timers)
    step_times: list[float] = []
    plans: list[str] = []
    record_plans(plans)
    engine.step = _timed_steps(engine.step, step_times)
    result = run_engine(engine, SCENARIOS[args.workload](loaded.vocab_size, args))
    steps = np.array(step_times) * 1e3
    print(f"{args.shape} shape, workload {args.workload}, {mx.default_device()}: {len(steps)} steps, "
          f"{result['tok_s']:.1f} tok/s, decode {result['decode_tok_s']:.1f} tok/s")
    print(f"  step ms: p50 {np.median(steps):.2f}, p90 {np.percentile(steps, 90):.2f}, p99 {np.percentile(steps, 99):.2f}, "
          f"max {steps.max():.2f}; {int((steps > 3 * np.median(steps)).sum())} steps over 3x the median")
    for i in np.argsort(-steps)[:4]:
        launched, before = (plans[j] if 0 <= j < len(plans) else "-" for j in (i, i - 1))
        print(f"  slow step {i}: {steps[i]:.1f} ms, launched {launched}; the step before: {before}")
    for name, seconds in timers.seconds.items():
        print(f"  {name:32s} {seconds / len(steps) * 1e3:8.3f} ms/step")
    print(f"  {'whole step':32s} {steps.mean():8.3f} ms/step")
    return 0


def _timed_steps(step, times: list[float]):
    def timed():
        t0 = time.perf_counter()
        out = step()
        times.append(time.perf_counter() - t0)
        return out
    return timed


if __name__ == "__main__":
    raise SystemExit(main())
