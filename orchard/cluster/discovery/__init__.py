"""Finding the head on the local network.

    cluster_token.py  the one secret of a cluster, and the keys derived from it (Ray's token, advert signing)
    adverts.py        signed zeroconf adverts of the head (`_orchard._tcp.local.`), browsed and verified by nodes
"""
