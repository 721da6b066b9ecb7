"""What the HTTP front costs and what it delivers: `python -m orchard.cluster.bench.gateway`.

One run on one model measures, in order:

1. TTFT of single requests (one at a time, distinct prompts of the same length) by calling
   an in-process engine directly, then the same prompts as token ids through `orchard serve`
   (gateway + coordinator + one Ray node actor) over streaming HTTP. The difference of the
   medians is what the gateway and Ray add (target: under 5 ms).
2. Output tokens/s with `--clients` concurrent streaming clients through `orchard serve`,
   then through `mlx_lm.server` on the same model, with `orchard bench serve`'s load
   generator and the same seeded workload (target: 1.5x). The peer runs with its listen backlog
   raised (PEER_LAUNCHER) so that it answers every request. Each server first serves an
   unmeasured burst (`--warmup-requests`): GPU kernels and decode graphs compile on first use.

The servers serve their loads one after another: the peer alone, the Ray cluster stopped before
`orchard serve --no-ray`'s load (idle, Ray's processes and the node actor's heartbeat took a few
per cent of a 2-core machine), only an idle `--no-ray` server up beside the Ray one's. On Linux
the whole run (servers included) has OpenBLAS preloaded when it exists; the table says so.
With `--rounds N` part 2 runs N times, each round starting the servers afresh one after
another, and the table gives each round's ratio and their median: on a shared machine the
peer's own rate moves between runs minutes apart as much as a change to orchard does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from orchard.cluster.bench.server_process import ServerProcess, free_port

TTFT_TARGET_MS = 5.0
THROUGHPUT_TARGET = 1.5


@dataclass(frozen=True)
class GatewayBenchConfig:
    model: str | None = None  # None: the bundled demo model
    ttft_samples: int = 200
    ttft_warmup: int = 10
    ttft_prompt_tokens: int = 64
    clients: int = 32
    # 480 of 64 tokens: on the H200 a burst of 96 lasted about a second and moved 25 % from run to run
    requests: int = 480
    # A burst of this many requests, not measured, before each server's throughput run: a fresh server
    # compiles its GPU kernels and decode graphs on first use (seconds each on the H200), which is start-up, not serving.
    warmup_requests: int = 32
    input_tokens: int = 128
    output_tokens: int = 64
    max_model_len: int = 512
    kv_memory_gb: float = 0.25
    max_num_seqs: int = 64
    peer: bool = True  # also measure mlx_lm.server
    ray: bool = True  # also measure `orchard serve` over Ray (False: only `--no-ray`, for a host without Ray)
    compiled_decode: str = "auto"  # `orchard serve --compiled-decode`, also for the engine called directly
    async_scheduling: bool = True  # `orchard serve --[no-]async-scheduling`, likewise
    start_timeout_s: float = 600.0
    seed: int = 0
    rounds: int = 1  # times part 2 runs, each round every server afresh


# ---- prompts ---------------------------------------------------------------------------
def ttft_prompts(tokenizer, count: int, length: int, seed: int) -> list[list[int]]:
    """`count` prompts of exactly `length` tokens whose first blocks all differ (no prefix hits)."""
    from orchard.node.model.demo import corpus_text

    words = corpus_text().split()
    rng = random.Random(seed)
    prompts, seen = [], set()
    while len(prompts) < count:
        start = rng.randrange(0, max(1, len(words) - 4 * length))
        ids = list(tokenizer.encode(" ".join(words[start:start + 4 * length])))[:length]
        if len(ids) == length and tuple(ids[:16]) not in seen:
            seen.add(tuple(ids[:16]))
            prompts.append(ids)
    return prompts


# ---- 1. TTFT: the engine called directly, then through HTTP ------------------------------
def engine_config(cfg: GatewayBenchConfig):
    from orchard.node.engine import EngineConfig

    return EngineConfig(model=cfg.model, max_model_len=cfg.max_model_len, kv_memory_gb=cfg.kv_memory_gb,
                        max_num_seqs=cfg.max_num_seqs, compiled_decode={"on": True, "off": False}.get(cfg.compiled_decode),
                        async_scheduling=cfg.async_scheduling)


async def _engine_ttft(engine, prompts: list[list[int]]) -> list[float]:
    from orchard.node.types import SamplingParams

    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    samples = []
    for i, prompt in enumerate(prompts):
        t0 = time.perf_counter()
        first = None
        async for out in engine.generate(f"ttft-{i}", prompt, params):
            if first is None and out.outputs and out.outputs[0].token_ids_delta:
                first = time.perf_counter() - t0
        samples.append(first)
    return samples


def start_engine(cfg: GatewayBenchConfig):
    from orchard.node.async_engine import AsyncEngine

    return AsyncEngine.from_config(engine_config(cfg))


def direct_ttft(engine, prompts: list[list[int]]) -> list[float]:
    return asyncio.run(_engine_ttft(engine, prompts))


def http_ttft(base_url: str, model: str, prompts: list[list[int]]) -> list[float]:
    """TTFT of each prompt (token ids) sent alone to /v1/completions, streamed."""
    samples = []
    with httpx.Client(timeout=120) as http:
        for prompt in prompts:
            body = {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True,
                    "stream": True}
            t0 = time.perf_counter()
            first = None
            with http.stream("POST", base_url + "/v1/completions", json=body) as resp:
                resp.raise_for_status()
                for line in resp.iter_lines():
                    if first is None and line.startswith("data:") and '"text"' in line and "[DONE]" not in line:
                        first = time.perf_counter() - t0
            samples.append(first)
    return samples


# ---- 2. throughput under concurrent streaming clients ------------------------------------
def throughput(base_url: str, model: str, tokenizer_path: str, cfg: GatewayBenchConfig) -> dict:
    """`orchard bench serve`'s summary of one burst of `requests` at `clients` concurrency, after an
    unmeasured burst of `warmup_requests` (other prompts: no prefix of the measured ones is cached by it)."""
    from orchard.cluster.bench.loadgen import DatasetConfig, EndpointConfig, LengthRange, LoadConfig, ServeBenchConfig, run_bench

    def burst(requests: int, seed: int) -> dict:
        bench = ServeBenchConfig(
            endpoint=EndpointConfig(base_url, model, ignore_eos=True),
            dataset=DatasetConfig("random", LengthRange(cfg.input_tokens), LengthRange(cfg.output_tokens), seed=seed),
            load=LoadConfig(max_concurrency=cfg.clients, num_prompts=requests, seed=seed),
            tokenizer=tokenizer_path,
            progress=False,
        )
        return run_bench(bench)["runs"][0]["summary"]

    if cfg.warmup_requests:
        burst(cfg.warmup_requests, cfg.seed + 1)
    return burst(cfg.requests, cfg.seed)


# ---- servers -----------------------------------------------------------------------------
def orchard_server(cfg: GatewayBenchConfig, ray: bool = True) -> ServerProcess:
    port = free_port()
    cmd = [sys.executable, "-m", "orchard.cluster.cli", "serve", "--port", str(port), "--max-model-len", str(cfg.max_model_len),
           "--kv-memory", str(cfg.kv_memory_gb), "--max-num-seqs", str(cfg.max_num_seqs), "--grace", "5",
           "--compiled-decode", cfg.compiled_decode]
    if not ray:
        cmd.append("--no-ray")
    cmd.append("--async-scheduling" if cfg.async_scheduling else "--no-async-scheduling")
    if cfg.model:
        cmd += ["--model", cfg.model]
    return ServerProcess("orchard serve" + ("" if ray else " --no-ray"), cmd, port, "/health", cfg.start_timeout_s)


#: `mlx_lm.server` with its socket's listen backlog raised from the stdlib's 5 to 128: with the stock
#: backlog, 32 clients connecting at once overflow it and some connections die unanswered
#: (`httpx.ReadError`, 3-33 of 96 requests a run), so the peer's rate was over fewer requests.
PEER_LAUNCHER = ("import socketserver, sys; socketserver.TCPServer.request_queue_size = 128; "
                 "sys.argv[0] = 'mlx_lm.server'; from mlx_lm.server import main; main()")


def mlx_lm_server(cfg: GatewayBenchConfig, model_path: str) -> ServerProcess:
    port = free_port()
    cmd = [sys.executable, "-c", PEER_LAUNCHER, "--model", model_path, "--port", str(port),
           "--decode-concurrency", str(cfg.clients), "--log-level", "WARNING"]
    return ServerProcess("mlx_lm.server", cmd, port, "/v1/models", cfg.start_timeout_s)


# ---- the run -----------------------------------------------------------------------------
def p50_ms(samples: list[float | None]) -> float:
    return 1000.0 * statistics.median(s for s in samples if s is not None)


def interleaved_ttft(engine, urls: list[str], model: str, prompts: list[list[int]], warmup: int) -> list[list]:
    """TTFT of each prompt by every path (the engine called directly, then each URL), path
    after path request by request, so a change in the machine's load during the run shifts
    every series alike. Each path has its own prefix cache and sees each prompt once."""
    paths = [lambda ps: direct_ttft(engine, ps)] + [lambda ps, url=url: http_ttft(url, model, ps) for url in urls]
    for path in paths:
        path(prompts[:warmup])
    series: list[list] = [[] for _ in paths]
    for prompt in prompts[warmup:]:
        for samples, path in zip(series, paths):
            samples += path([prompt])
    return series


def run(cfg: GatewayBenchConfig, say=print) -> dict:
    say("loading the engine in this process")
    engine = start_engine(cfg)
    model, model_path = engine.model_name, str(engine.engine.model.path)
    prompts = ttft_prompts(engine.tokenizer, cfg.ttft_warmup + cfg.ttft_samples, cfg.ttft_prompt_tokens, cfg.seed)
    http, ours = [], None
    try:
        with orchard_server(cfg, ray=False) as gateway_only:
            with orchard_server(cfg) if cfg.ray else nullcontext() as orchard:
                say("1/4 TTFT: engine called directly, through orchard serve --no-ray (HTTP only)"
                    + (" and through orchard serve (HTTP, coordinator, Ray node actor)" if cfg.ray else "") + ", alternating")
                urls = [gateway_only.url] + ([orchard.url] if cfg.ray else [])
                direct, http_only, *http = interleaved_ttft(engine, urls, model, prompts, cfg.ttft_warmup)
                http = http[0] if http else []
                engine.shutdown()
                if cfg.ray:
                    say(f"2/4 {cfg.clients} streaming clients through orchard serve")
                    ours = throughput(orchard.url, model, model_path, cfg)
            say(f"3/4 {cfg.clients} streaming clients through orchard serve --no-ray")
            ours_no_ray = throughput(gateway_only.url, model, model_path, cfg)  # the Ray cluster stopped: it idles at a few % of a core
    finally:
        engine.shutdown()
    peer = peer_throughput(cfg, model_path, say, "4/4 ")
    rounds = [_rates(ours, ours_no_ray, peer)]
    for r in range(2, cfg.rounds + 1):
        say(f"round {r}/{cfg.rounds}: {cfg.clients} streaming clients through each server again")
        rounds.append(throughput_round(cfg, model, model_path, say))
    ms = lambda samples: [1000 * s for s in samples if s is not None]  # noqa: E731
    return {
        "config": asdict(cfg),
        "model": model,
        "machine": machine(),
        "ttft_direct_ms": ms(direct),
        "ttft_http_no_ray_ms": ms(http_only),
        "ttft_http_ms": ms(http),
        "ttft_direct_p50_ms": p50_ms(direct),
        "ttft_http_no_ray_p50_ms": p50_ms(http_only),
        "ttft_http_p50_ms": p50_ms(http) if http else None,
        "orchard": ours,
        "orchard_no_ray": ours_no_ray,
        "mlx_lm_server": peer,
        "rounds": rounds,
    }


def peer_throughput(cfg: GatewayBenchConfig, model_path: str, say, step: str = "") -> dict | None:
    if not cfg.peer:
        return None
    with mlx_lm_server(cfg, model_path) as server:
        say(f"{step}{cfg.clients} streaming clients through mlx_lm.server")
        return throughput(server.url, model_path, model_path, cfg)


def throughput_round(cfg: GatewayBenchConfig, model: str, model_path: str, say) -> dict:
    """Part 2 again with fresh servers, one after another: output tok/s of each."""
    ours = None
    if cfg.ray:
        with orchard_server(cfg) as orchard:
            ours = throughput(orchard.url, model, model_path, cfg)
    with orchard_server(cfg, ray=False) as gateway_only:
        ours_no_ray = throughput(gateway_only.url, model, model_path, cfg)
    return _rates(ours, ours_no_ray, peer_throughput(cfg, model_path, say))


def _rates(ours: dict | None, no_ray: dict, peer: dict | None) -> dict:
    rate = lambda summary: summary["output_throughput"] if summary else None  # noqa: E731
    return {"orchard": rate(ours), "orchard_no_ray": rate(no_ray), "mlx_lm_server": rate(peer)}


def machine() -> dict:
    from orchard.node.openblas import openblas_in_use

    return {"platform": platform.platform(), "cpus": os.cpu_count(), "openblas": openblas_in_use(),
            "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}


def table(result: dict) -> str:
    cfg = result["config"]
    rows = []
    if result["ttft_http_p50_ms"] is not None:
        added = result["ttft_http_p50_ms"] - result["ttft_direct_p50_ms"]
        rows.append(("TTFT p50, one request at a time", f"{result['ttft_http_p50_ms']:.1f} ms (HTTP)",
                     f"{result['ttft_direct_p50_ms']:.1f} ms (engine direct)",
                     f"{added:+.1f} ms", f"< {TTFT_TARGET_MS:.0f} ms: {'met' if added < TTFT_TARGET_MS else 'missed'}"))
    rows.append(("  the same, HTTP gateway alone (--no-ray)", f"{result['ttft_http_no_ray_p50_ms']:.1f} ms (HTTP)",
                 f"{result['ttft_direct_p50_ms']:.1f} ms (engine direct)",
                 f"{result['ttft_http_no_ray_p50_ms'] - result['ttft_direct_p50_ms']:+.1f} ms", ""))
    rows += _load_rows(result, cfg["clients"])
    rows += _round_rows(result.get("rounds", []))
    header = ("metric", "orchard serve", "reference", "difference", "target")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _load_rows(result: dict, clients: int) -> list[tuple]:
    """The throughput run's rows: `orchard serve` over Ray against mlx_lm.server (and `--no-ray` beside
    it), or `--no-ray` alone on a host without Ray."""
    ours, no_ray, peer = result["orchard"], result["orchard_no_ray"], result["mlx_lm_server"]
    served, name, label = (ours, "", "orchard") if ours is not None else (no_ray, ", orchard serve --no-ray", "orchard --no-ray")
    peer_rate = peer["output_throughput"] if peer else 0.0
    ratio = served["output_throughput"] / peer_rate if peer_rate else None
    rows = [(f"output tok/s, {clients} streaming clients{name}", f"{served['output_throughput']:.1f} ({label})",
             f"{peer_rate:.1f} (mlx_lm.server)" if peer else "not measured", f"{ratio:.2f}x" if ratio else "",
             f">= {THROUGHPUT_TARGET}x: {'met' if ratio >= THROUGHPUT_TARGET else 'missed'}" if ratio else "")]
    if not peer:
        return rows
    if ours is not None:
        rows.append(("  the same, orchard serve --no-ray", f"{no_ray['output_throughput']:.1f} (orchard --no-ray)",
                     f"{peer_rate:.1f} (mlx_lm.server)", f"{no_ray['output_throughput'] / peer_rate:.2f}x" if peer_rate else "", ""))
    rows.append(("TTFT p50 under that load", f"{served['ttft_ms']['p50']:.0f} ms", f"{peer['ttft_ms']['p50']:.0f} ms", "", ""))
    rows.append(("TPOT p50 under that load", f"{served['tpot_ms']['p50']:.1f} ms", f"{peer['tpot_ms']['p50']:.1f} ms", "", ""))
    rows.append(("completed / failed", f"{served['completed']} / {served['failed']}", f"{peer['completed']} / {peer['failed']}", "", ""))
    return rows


def _round_rows(rounds: list[dict]) -> list[tuple]:
    """With more than one round and a peer: each round's ratios and their median, the figure the target is read on."""
    if len(rounds) < 2 or rounds[0]["mlx_lm_server"] is None:
        return []
    rows = []
    for key, label in (("orchard", "orchard serve"), ("orchard_no_ray", "orchard serve --no-ray")):
        if rounds[0][key] is None:
            continue
        ratios = [r[key] / r["mlx_lm_server"] for r in rounds]
        median = statistics.median(ratios)
        rows.append((f"output tok/s ratio, {label}, median of {len(rounds)} rounds", f"{median:.3f}x",
                     "rounds: " + ", ".join(f"{x:.2f}x" for x in ratios), "",
                     f">= {THROUGHPUT_TARGET}x: {'met' if median >= THROUGHPUT_TARGET else 'missed'}"))
    return rows


def parse_args(argv: list[str] | None) -> tuple[GatewayBenchConfig, str | None]:
    d = GatewayBenchConfig()
    p = argparse.ArgumentParser(prog="python -m orchard.cluster.bench.gateway", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=d.model, help="mlx-lm model path (default: the bundled demo model)")
    p.add_argument("--ttft-samples", type=int, default=d.ttft_samples)
    p.add_argument("--ttft-prompt-tokens", type=int, default=d.ttft_prompt_tokens)
    p.add_argument("--clients", type=int, default=d.clients, help="concurrent streaming clients")
    p.add_argument("--requests", type=int, default=d.requests, help="requests in the throughput run")
    p.add_argument("--warmup-requests", type=int, default=d.warmup_requests,
                   help="requests of an unmeasured burst before each server's throughput run (0: none)")
    p.add_argument("--input-tokens", type=int, default=d.input_tokens)
    p.add_argument("--output-tokens", type=int, default=d.output_tokens)
    p.add_argument("--max-model-len", type=int, default=d.max_model_len)
    p.add_argument("--kv-memory", type=float, default=d.kv_memory_gb, metavar="GB")
    p.add_argument("--no-peer", action="store_true", help="skip mlx_lm.server")
    p.add_argument("--no-ray", action="store_true", help="only `orchard serve --no-ray` (a host without Ray)")
    p.add_argument("--compiled-decode", default=d.compiled_decode, choices=("auto", "on", "off"),
                   help="orchard's decode graphs (`orchard serve --compiled-decode`)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=d.async_scheduling,
                   help="orchard's overlapped steps (`orchard serve --[no-]async-scheduling`; default: on)")
    p.add_argument("--rounds", type=int, default=d.rounds,
                   help="times the throughput part runs, every server afresh each round; the table adds each round's ratio and their median")
    p.add_argument("--json", metavar="PATH", help="also write the full result here")
    a = p.parse_args(argv)
    cfg = GatewayBenchConfig(
        model=a.model, ttft_samples=a.ttft_samples, ttft_prompt_tokens=a.ttft_prompt_tokens, clients=a.clients,
        requests=a.requests, warmup_requests=a.warmup_requests, input_tokens=a.input_tokens, output_tokens=a.output_tokens,
        max_model_len=a.max_model_len, kv_memory_gb=a.kv_memory, max_num_seqs=max(d.max_num_seqs, a.clients),
        peer=not a.no_peer, ray=not a.no_ray, compiled_decode=a.compiled_decode, async_scheduling=a.async_scheduling,
        rounds=max(1, a.rounds),
    )
    return cfg, a.json


def main(argv: list[str] | None = None) -> int:
    from orchard.node.openblas import reexec_with_openblas

    reexec_with_openblas()
    cfg, json_path = parse_args(argv)
    result = run(cfg, say=lambda what: print(what, file=sys.stderr, flush=True))
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=2))
    m = result["machine"]
    print(f"model {result['model']}; {m['platform']}, {m['cpus']} CPUs, OpenBLAS preloaded: "
          f"{'yes' if m['openblas'] else 'no'}, load average {m['load_average']}")
    print(table(result))
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # MLX's native threads can abort interpreter teardown
