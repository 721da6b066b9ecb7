"""Ray under orchard: the cluster's processes and where they run.

    ray_access.py   Ray's token authentication, set before Ray is first imported
    ray_cluster.py  connecting; the coordinator actor on the head; one node actor pinned to each
                    serving machine; `LocalCluster`, several real raylets on this machine
    placement.py    the one loop that gives machines joining later their node actor
    head.py         supervising a head: the Ray head process, `orchard serve`, the placer, the advert
"""
