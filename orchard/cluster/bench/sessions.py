"""Multi-turn agent sessions on a hybrid model: how much of each resent conversation the prefix
cache serves, and what that does to time to first token, against prefix caching off.

`python -m orchard.cluster.bench.sessions [--sessions 16 --turns 10] [--plot out.png]` builds a random-weight
Qwen3-Next-style model (Gated DeltaNet layers, one full-attention layer in four; mlx-lm's own
class, the demo tokenizer) and runs every session closed-loop on one engine: each turn resends
the system prompt and the whole history plus a new user message and asks for a short answer;
the next turn starts when the answer is complete. Hit rate = prompt tokens served from the
cache / prompt tokens; its ideal is everything but the new message. Prints one table.
"""

from __future__ import annotations

import argparse
import platform
import time
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from orchard.node.engine import EngineConfig, LLMEngine
from orchard.node.model.random_weights import random_model
from orchard.node.types import SamplingParams

#: A small Qwen3-Next: 8 layers (6 Gated DeltaNet, 2 attention), hidden 512, dense MLPs.
HYBRID_SHAPE = dict(
    model_type="qwen3_next", hidden_size=512, num_hidden_layers=8, intermediate_size=1024, num_attention_heads=8,
    num_key_value_heads=2, head_dim=64, linear_num_value_heads=8, linear_num_key_heads=4, linear_key_head_dim=64,
    linear_value_head_dim=64, linear_conv_kernel_dim=4, full_attention_interval=4, num_experts=0,
    num_experts_per_tok=0, decoder_sparse_step=1, shared_expert_intermediate_size=0, mlp_only_layers=[],
    moe_intermediate_size=0, rms_norm_eps=1e-6, vocab_size=32000, rope_theta=1_000_000.0, partial_rotary_factor=0.25,
    max_position_embeddings=8192, tie_word_embeddings=False,
)


@dataclass
class Session:
    history: list[int]
    turn: int = 0
    pending: str | None = None
    sent_at: float = 0.0
    message_len: int = 0
    records: list[tuple[int, int, int, float]] = field(default_factory=list)  # (turn, prompt, cached, ttft)


def _tokens(rng: np.random.Generator, n: int) -> list[int]:
    return [int(t) for t in rng.integers(10, HYBRID_SHAPE["vocab_size"] - 10, n)]


def run_sessions(engine: LLMEngine, args, seed: int = 0) -> list[Session]:
    rng = np.random.default_rng(seed)
    system = _tokens(rng, args.system)
    sessions = [Session(list(system)) for _ in range(args.sessions)]
    params = SamplingParams(temperature=0.0, max_tokens=args.answer, ignore_eos=True)
    by_id: dict[str, Session] = {}

    def send(i: int, s: Session) -> None:
        message = _tokens(rng, args.message)
        s.history += message
        s.message_len = len(message)
        s.pending, s.sent_at = f"s{i}t{s.turn}", time.perf_counter()
        by_id[s.pending] = s
        engine.add_request(s.pending, list(s.history), params)

    for i, s in enumerate(sessions):
        send(i, s)
    first: set[str] = set()
    while engine.has_unfinished:
        for out in engine.step():
            s = by_id[out.request_id]
            if out.request_id not in first and out.outputs[0].token_ids:
                first.add(out.request_id)
                s.records.append((s.turn, len(s.history), out.num_cached_tokens, time.perf_counter() - s.sent_at))
            if out.finished:
                s.history += out.outputs[0].token_ids
                s.turn += 1
                if s.turn < args.turns:
                    send(sessions.index(s), s)
    return sessions


def summary(sessions: list[Session], args) -> dict:
    prompt = sum(p for s in sessions for _, p, _, _ in s.records)
    cached = sum(c for s in sessions for _, _, c, _ in s.records)
    ideal = prompt - args.message * args.turns * len(sessions)
    ttft = [float(np.median([s.records[t][3] for s in sessions])) for t in range(args.turns)]
    return dict(hit=cached / prompt, ideal=ideal / prompt, ttft=ttft)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--system", type=int, default=256, help="system prompt tokens")
    parser.add_argument("--message", type=int, default=32, help="tokens of each new user message")
    parser.add_argument("--answer", type=int, default=16, help="tokens of each answer")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--plot", default=None, help="write TTFT p50 per turn, cache on and off, to this PNG")
    args = parser.parse_args()
    loaded = random_model(HYBRID_SHAPE, "random-qwen3-next-small", dtype=mx.float16 if mx.default_device() == mx.gpu else mx.float32)
    results = {}
    for caching in (True, False):
        engine = LLMEngine(EngineConfig(block_size=args.block_size, enable_prefix_caching=caching, kv_memory_gb=1.0,
                                        max_num_seqs=args.sessions), loaded=loaded)
        t0 = time.perf_counter()
        results[caching] = summary(run_sessions(engine, args), args) | {"seconds": time.perf_counter() - t0}
        r = results[caching]
        print(f"prefix caching {'on' if caching else 'off'}: {r['seconds']:.1f} s, hit rate {r['hit']:.1%}, "
              f"TTFT p50 turn 1 {r['ttft'][0] * 1e3:.0f} ms, turn {args.turns} {r['ttft'][-1] * 1e3:.0f} ms", flush=True)
        del engine
    on, off = results[True], results[False]
    print(f"hybrid sessions: {args.sessions} x {args.turns} turns, system {args.system}, message {args.message}, "
          f"answer {args.answer} tokens, block {args.block_size}; {mx.default_device()}, {platform.platform()}")
    print(f"prefix hit rate {on['hit']:.1%} of prompt tokens; ideal {on['ideal']:.1%}; "
          f"{on['hit'] / on['ideal']:.1%} of the ideal (caching off: {off['hit']:.1%})")
    print("turn  TTFT p50 cache on  cache off")
    for t in range(args.turns):
        print(f"{t + 1:4d}  {on['ttft'][t] * 1e3:14.1f} ms  {off['ttft'][t] * 1e3:7.1f} ms")
    print(f"turn {args.turns} / turn 1 TTFT p50: cache on {on['ttft'][-1] / on['ttft'][0]:.2f}x, off {off['ttft'][-1] / off['ttft'][0]:.2f}x")
    if args.plot:
        _plot(args.plot, on["ttft"], off["ttft"])


def _plot(path: str, on: list[float], off: list[float]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    turns = range(1, len(on) + 1)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(turns, [t * 1e3 for t in on], marker="o", label="prefix caching on (state snapshots)")
    ax.plot(turns, [t * 1e3 for t in off], marker="s", label="prefix caching off")
    ax.set_xlabel("turn")
    ax.set_ylabel("TTFT p50 (ms)")
    ax.set_title("hybrid model, multi-turn sessions")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
