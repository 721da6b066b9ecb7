"""Every benchmark in one place, from a kernel to the whole cluster; each benchmark runs as
`python -m orchard.cluster.bench.NAME`, most also as `orchard bench ...` (orchard/cluster/cli/bench.py).

    kernels.py         paged attention kernels against dense SDPA, decode rows (`orchard bench kernels`)
    kernels_varlen.py  the varlen kernel's mixed-step rows of that table (`--only varlen`)
    kernel_timing.py   what both kernel benchmarks share: a row, the device-time clock, the table
    engine.py          one node's engine against mlx-lm's BatchGenerator, offline (`orchard bench engine`)
    grammar.py         what structured output's masks cost a decode step (`orchard bench grammar`)
    sessions.py        multi-turn sessions on a hybrid model: prefix cache on against off
    kvcache.py         KV block bookkeeping, memory waste and the cold tier (`orchard bench kv`)
    cluster.py         routing policies across nodes, prefix-aware vs round robin (`orchard bench cluster`)
    migration.py       KV block migration between two nodes vs recomputing (`orchard bench migration`)
    migration_netns.py the same over a tc-shaped link between two network namespaces (`--link`)
    netns.py           the namespace rig: hosts on a private bridge, tc shaping, raw TCP between hosts
    netns_node.py      a node process in one of the rig's namespaces, driven over a pipe
    gateway.py         what the HTTP front costs; orchard serve vs mlx_lm.server (`orchard bench gateway`)
    stream.py          node -> gateway transport over Ray: a generator per request vs the coalesced stream
    loadgen/           the load generator behind `orchard bench serve`, for any OpenAI-compatible endpoint

Benchmarks are drivers, not libraries: orchard/kvcache/, orchard/kernels/ and orchard/node/ never import from here.
"""
