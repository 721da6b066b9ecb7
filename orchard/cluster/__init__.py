"""Many machines serving as one endpoint, in rooms that depend one way:

    cli/          the `orchard` command: one module per subcommand
    gateway/      the OpenAI-compatible HTTP front and the backends it drives
    coordinator/  the head's brain: membership, prefix index, router, replication, link cost
    runtime/      Ray: connecting, the coordinator actor, node actor placement, head supervision
    discovery/    finding the head on the local network: signed zeroconf adverts, the cluster token
    bench/        the benchmarks of the cluster and of kvcache, and the load generator

Imports run one way, top to bottom: `cli`, `bench`, `gateway`, `runtime`, then
`coordinator` and `discovery`, which use only `node`, `kvcache` and the standard library.
"""
