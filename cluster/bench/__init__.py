"""Every benchmark of the cluster in one place; each module runs as `python -m cluster.bench.NAME`
and through `orchard bench NAME`.

    cluster.py    routing policies across nodes (prefix-aware vs round robin)
    migration.py  KV block migration between two nodes vs recomputing
    gateway.py    what the HTTP front costs; orchard serve vs mlx_lm.server
    kvcache.py    KV block bookkeeping, memory waste and the cold tier
    loadgen/      the load generator behind `orchard bench serve`, for any OpenAI-compatible endpoint

The engine's and the kernels' benchmarks stay beside their code (`node.bench`, `kernels.bench`).
"""
