"""What a landing's check that the pool's buffers stayed put costs, read two ways.

Before a pull's landed blocks are listed as cached, `orchard.kvcache.block_landing` checks that no layer's K or
V buffer moved since the blocks were reserved (a step that wrote a layer out of place would leave the landed KV
in a buffer the pool no longer uses). It compares where each buffer begins with where the views taken at the
reservation begin. This times reading those addresses through numpy views of every layer
(`KVPool.layer_views`, as the check did) and through each array's buffer with no view made
(`KVPool.buffer_addresses`, as it does), for pools of a few layer counts and dtypes.

    python -m experiments.pool_addresses [--shapes 16:float16,16:bfloat16,32:bfloat16] [--repeats 300]

Prints the median microseconds of each. The numbers go to experiments/results/pool_addresses.json.
"""

from __future__ import annotations

import argparse

from experiments.common import markdown_table, median_time, print_header, save_results
from orchard.kvcache.geometry import KVGeometry
from orchard.kvcache.pool import KVPool


def view_addresses(views) -> list[int]:
    """Where each of `KVPool.layer_views`' views begins, every K view's then every V view's: the check's reading
    before `KVPool.buffer_addresses`."""
    return [view.__array_interface__["data"][0] for part in views for view in part]


def measure(layers: int, dtype: str, repeats: int, num_blocks: int = 512) -> dict:
    """Median seconds of each way for a pool of `layers` layers of `dtype` (8 KV heads of 64, blocks of 16)."""
    pool = KVPool(KVGeometry("addresses", layers, 8, 64, 16, dtype), num_blocks)
    if pool.buffer_addresses() != view_addresses(pool.layer_views()):
        raise RuntimeError("the two ways read different addresses")
    return {
        "layers": layers, "dtype": dtype,
        "views_s": median_time(lambda: view_addresses(pool.layer_views()), repeats),
        "buffers_s": median_time(pool.buffer_addresses, repeats),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="16:float16,16:bfloat16,32:bfloat16", help="layers:dtype, comma-separated")
    parser.add_argument("--repeats", type=int, default=300)
    args = parser.parse_args()
    print_header("a landing's buffer check: addresses through numpy views against through the buffers")
    rows = [measure(int(layers), dtype, args.repeats)
            for layers, dtype in (shape.split(":") for shape in args.shapes.split(","))]
    print(markdown_table(["layers", "dtype", "through views, us", "through buffers, us"],
                         [[r["layers"], r["dtype"], f"{r['views_s'] * 1e6:.0f}", f"{r['buffers_s'] * 1e6:.0f}"]
                          for r in rows]))
    save_results("pool_addresses", {"repeats": args.repeats, "rows": rows})


if __name__ == "__main__":
    main()
