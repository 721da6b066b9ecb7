"""mlx-orchard: a set of Macs serving LLMs as one endpoint. Four packages, depending one way:

    cluster/   many machines as one: the gateway, the coordinator, Ray, discovery, the CLI, the benchmarks
    node/      one machine: the engine loop, the model runner, the Ray actor, the KV mover
    kvcache/   KV memory: block pool, block manager, prefix hashes, cold tier, wire format
    kernels/   attention over the paged pool, and the KV writes that fill it

`cluster` imports `node`, `node` imports `kvcache` and `kernels`, never back. They live under one
import name because a top-level package called `kernels` (or `node`, `cluster`) is a name other
distributions install too: transformers, which mlx-lm needs, brings one called `kernels`.
"""
