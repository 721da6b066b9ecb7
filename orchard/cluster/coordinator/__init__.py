"""The head's brain, testable without Ray: which node holds which prefix and where a request goes.

    coordinator.py       `Coordinator`, a plain class
    service.py           `CoordinatorActor`: the coordinator as the named Ray actor, with the route link's listener
    route_link.py        `route` over a gateway's direct, authenticated connection, and the gateway's end
    membership.py        which nodes exist, their load and rates, when one is dead; `NodeId`
    prefix_index.py      block hash -> the nodes (and tiers) holding it, fed by KV events
    pending_prefixes.py  prefixes a node is about to hold: routed to but not yet stored
    router.py            ranks nodes for a request (cached prefix vs load), plans a migration
    replication.py       copying hot blocks ahead of demand
    link_cost.py         what a transfer over one link costs, fitted to past transfers
"""
