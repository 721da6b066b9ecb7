"""The cluster's question: when does pulling KV blocks over the network beat recomputing them?

Moving a block costs encode (wire format) + transfer + decode + import into the pool;
recomputing costs a prefill of its tokens. This script measures, here:

- plain-socket TCP throughput over loopback (the software ceiling of this machine's
  stack; a real link is slower, so link rates are also tabulated at nominal speeds);
- `orchard.kvcache.wire` encode and decode per block, and `KVCache.import_blocks` per block;
- the demo model's prefill time per block (recompute);

and from them the break-even: the prefill rate (tokens/s) below which moving wins on a
link of a given speed, for public model shapes, and the same for the SSD tier.

    python -m experiments.network_vs_recompute [--mib 256] [--blocks 16] [--prefill-tokens 512]
"""

from __future__ import annotations

import argparse
import socket
import threading
import time

import numpy as np

from experiments.common import best_time, gigabytes_per_s, markdown_table, print_header, save_results
from experiments.models import DEMO_LARGE, PUBLIC_SHAPES, load_demo, prefill_seconds
from orchard.kvcache import CacheConfig, KVCache
from orchard.kvcache.hashing import block_hashes, root_hash
from orchard.kvcache.wire import KVBlockData, decode_blocks, encode_blocks

#: Nominal signalling rates; IP over these links delivers less.
LINKS_GB_S = {"1 GbE": 0.125, "10 GbE": 1.25, "Thunderbolt 4 (40 Gb/s nominal)": 5.0,
              "Thunderbolt 5 (80 Gb/s nominal)": 10.0}


def loopback_gb_s(total: int, chunk: int = 1 << 20) -> float:
    """Bytes per second through a TCP connection on 127.0.0.1, plain sendall/recv_into."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    received = []

    def sink():
        conn, _ = server.accept()
        buf = bytearray(chunk)
        got = 0
        with conn:
            while got < total:
                n = conn.recv_into(buf)
                if not n:
                    break
                got += n
        received.append(got)

    thread = threading.Thread(target=sink)
    thread.start()
    payload = bytes(chunk)
    with socket.create_connection(("127.0.0.1", port)) as client:
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        start = time.perf_counter()
        for _ in range(total // chunk):
            client.sendall(payload)
        client.shutdown(socket.SHUT_WR)
        thread.join()
        seconds = time.perf_counter() - start
    server.close()
    assert received == [total // chunk * chunk]
    return gigabytes_per_s(total, seconds)


def wire_costs(shape, n_blocks: int, repeats: int) -> dict:
    """Best-of seconds per block to encode, decode, and import (decode + pool write) a payload of `n_blocks`."""
    g = shape.geometry()
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 30000, size=n_blocks * g.block_size).tolist()
    root = root_hash(g.model_fingerprint)
    hashes = block_hashes(tokens, g.block_size, root)
    dtype = g.numpy_storage_dtype
    blocks = []
    for i, h in enumerate(hashes):
        kv = rng.integers(0, 1 << 16, size=(2, g.num_layers, *g.block_shape), dtype=np.uint16).view(dtype) \
            if dtype == np.uint16 else rng.standard_normal((2, g.num_layers, *g.block_shape)).astype(dtype)
        blocks.append(KVBlockData(h, hashes[i - 1] if i else root, tuple(tokens[i * 16:(i + 1) * 16]), kv[0], kv[1]))
    payload = encode_blocks(g, blocks)
    encode = best_time(lambda: encode_blocks(g, blocks), repeats)
    decode = best_time(lambda: decode_blocks(payload, g), repeats)
    kv = KVCache(g, CacheConfig(block_size=g.block_size, num_blocks=n_blocks + 2, watermark=0.0))

    def import_once():
        assert kv.import_blocks(payload) == n_blocks
        kv.manager.allocate("flush", list(range(10**8, 10**8 + (n_blocks + 1) * g.block_size)))  # evict them again
        kv.manager.free("flush")

    import_s = best_time(import_once, repeats)
    flush = best_time(lambda: (kv.manager.allocate("f", list(range(10**8, 10**8 + (n_blocks + 1) * g.block_size))),
                                 kv.manager.free("f")), repeats)
    kv.close()
    return {"model": shape.name, "block_bytes": g.bytes_per_block, "payload_bytes": len(payload),
            "encode_s": encode / n_blocks, "decode_s": decode / n_blocks, "import_s": max(import_s - flush, 0) / n_blocks}


def break_even_prefill_rate(bytes_per_token: float, link_gb_s: float, overhead_s_per_token: float) -> float:
    """Prefill tokens/s below which moving a token's KV is faster than recomputing it."""
    move = bytes_per_token / (link_gb_s * 1e9) + overhead_s_per_token
    return 1.0 / move


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.network_vs_recompute", description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256, help="bytes pushed through loopback TCP")
    ap.add_argument("--blocks", type=int, default=4, help="blocks per wire payload for the per-block costs")
    ap.add_argument("--payload-sweep", default="1,4,8,16", help="2 MiB blocks per payload for the size sweep")
    ap.add_argument("--prefill-tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3, help="best of this many runs per timing")
    ap.add_argument("--ssd-gb-s", type=float, default=None,
                    help="cold-tier read rate for the SSD row (default: experiments/results/ssd_streaming.json, else 1.0)")
    args = ap.parse_args(argv)
    print_header(__doc__.splitlines()[0])
    loop = float(np.median([loopback_gb_s(args.mib << 20) for _ in range(args.repeats)]))
    print(f"loopback TCP, plain sockets, 1 MiB sendall: {loop:.2f} GB/s")
    shapes = [DEMO_LARGE, next(s for s in PUBLIC_SHAPES if s.name == "Llama-3.1-8B")]
    costs = [wire_costs(s, args.blocks, args.repeats) for s in shapes]
    print(markdown_table(["block shape", "block KiB", "encode µs/block", "decode µs/block", "import µs/block",
                          "encode GB/s", "decode+import GB/s"],
                         [[c["model"], c["block_bytes"] // 1024, f"{c['encode_s'] * 1e6:.0f}", f"{c['decode_s'] * 1e6:.0f}",
                           f"{c['import_s'] * 1e6:.0f}", f"{c['block_bytes'] / c['encode_s'] / 1e9:.2f}",
                           f"{c['block_bytes'] / c['import_s'] / 1e9:.2f}"] for c in costs]))
    sweep = [wire_costs(shapes[1], int(n), args.repeats) for n in args.payload_sweep.split(",")]
    print("\npayload size sweep (Llama-3.1-8B-shaped blocks):")
    print(markdown_table(["payload MiB", "encode GB/s", "decode GB/s"],
                         [[f"{c['payload_bytes'] / 2**20:.0f}", f"{c['block_bytes'] / c['encode_s'] / 1e9:.2f}",
                           f"{c['block_bytes'] / c['decode_s'] / 1e9:.2f}"] for c in sweep]))
    model = load_demo("large")
    prefill, _ = prefill_seconds(model, args.prefill_tokens, repeats=args.repeats)
    per_block = prefill / (args.prefill_tokens / 16)
    demo = costs[0]
    links = {"loopback TCP (measured)": loop, **LINKS_GB_S}
    print(f"\ndemo-large recompute: {prefill * 1e3:.0f} ms for {args.prefill_tokens} tokens = {per_block * 1e3:.1f} ms/block "
          f"({args.prefill_tokens / prefill:.0f} tokens/s prefill)")
    rows = []
    for label, rate in links.items():
        move = demo["encode_s"] + demo["block_bytes"] / (rate * 1e9) + demo["import_s"]
        rows.append([label, f"{rate:.3g}", f"{move * 1e3:.2f}", f"{per_block * 1e3:.1f}", f"{per_block / move:.0f}x"])
    print(markdown_table(["link", "GB/s", "move ms/block (encode+wire+import)", "recompute ms/block", "move faster by"], rows))
    ssd = args.ssd_gb_s or _measured_ssd()
    big = costs[1]
    per_byte = (big["encode_s"] + big["import_s"]) / big["block_bytes"]
    print(f"\nbreak-even prefill rate: moving wins whenever the receiver prefills slower than this (tokens/s). "
          f"Move = bytes/link + measured encode+import ({per_byte * 1e9:.2f} ns/byte here; the SSD column pays import only):")
    tiers = {**links, f"cold tier read here ({ssd:.2f} GB/s)": ssd}
    table = []
    for shape in (*PUBLIC_SHAPES, DEMO_LARGE):
        bpt = shape.kv_bytes_per_token
        table.append([shape.name, bpt // 1024, *(
            f"{break_even_prefill_rate(bpt, r, bpt * (per_byte if 'cold' not in k else big['import_s'] / big['block_bytes'])):,.0f}"
            for k, r in tiers.items())])
    table.append(["(no software overhead: link only) Llama-3.1-8B", 128,
                  *(f"{break_even_prefill_rate(128 * 1024, r, 0.0):,.0f}" for r in tiers.values())])
    print(markdown_table(["model", "KV KiB/token", *tiers], table))
    save_results("network_vs_recompute", {"loopback_gb_s": loop, "wire": costs, "prefill_s": prefill,
                                          "prefill_tokens": args.prefill_tokens, "move_rows": rows, "break_even": table,
                                          "payload_sweep": sweep,
                                          "ssd_gb_s": ssd})
    return 0


def _measured_ssd() -> float:
    import json

    from experiments.common import RESULTS_DIR

    path = RESULTS_DIR / "ssd_streaming.json"
    return json.loads(path.read_text())["cold_tier_read_gb_s"] if path.exists() else 1.0


if __name__ == "__main__":
    raise SystemExit(main())
