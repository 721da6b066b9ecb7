"""One machine's edge to the cluster: the Ray actor, its output streams, the KV mover, the join agent.

    actor.py           the engine as a Ray actor: streams outputs, reports what it holds to the coordinator
    output_streams.py  a node's outputs to one receiver over Ray, coalesced into one message per step
    gateway_link.py    a gateway's requests in and each step's outputs out over a direct, authenticated connection,
                       written by the engine thread (Ray the fallback)
    stream_delta.py    what an output stream carries over the network: only what is new
    migration.py       KV block migration: export, pull-and-import, link probes
    kv_link.py         the direct KV data path between two nodes: listener and client
    direct_path.py     a node's two ends of the direct path: its listener, and pulls through a peer's
    link_auth.py       keys from the cluster's secret; the challenge-response a link opens with
    link_io.py         bytes on a link's socket: the listener, frames, payloads, the engine thread's frame sender
    agent.py           the join agent: keeps this machine in the cluster as a Ray worker node
    hardware.py        what a node says about its machine: chip and memory
"""
