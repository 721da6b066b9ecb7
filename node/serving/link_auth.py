"""Keys derived from the cluster's secret, and the challenge-response a node-to-node link opens with.

Here rather than in `cluster.discovery` because the node side needs them and never imports
`cluster`; `cluster.discovery.cluster_token` derives its own keys with the same function.

The handshake proves both ends hold the link key without sending it, and binds each proof
to a nonce the other end just chose, so a recorded exchange replayed on a new connection
fails: the server speaks first with its nonce, the client answers with its own nonce and
an HMAC over both, and the server answers with an HMAC over both and its node id, so the
client also knows it reached the node it meant (a loopback address names a different
machine to every peer).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets

MAGIC = b"ORKVLNK1"
NONCE_SIZE = 32
PROOF_SIZE = 32
#: Where a node finds the secret when its config names none: Ray's token, itself derived from
#: the cluster token by `orchard head` / `orchard join` and the same on every machine.
SECRET_ENV = "RAY_AUTH_TOKEN"


def derive_key(secret: str, purpose: str) -> bytes:
    """A 32-byte key for one purpose; knowing it reveals neither the secret nor other keys."""
    return hmac.new(secret.encode(), b"mlx-orchard/" + purpose.encode(), hashlib.sha256).digest()


def link_key(secret: str | None, environ=None) -> bytes | None:
    """The KV link's key from `secret`, else from the environment's Ray token; None: no link."""
    secret = secret or (os.environ if environ is None else environ).get(SECRET_ENV)
    return derive_key(secret, "kv-link-v1") if secret else None


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_SIZE)


def client_proof(key: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(key, b"client" + server_nonce + client_nonce, hashlib.sha256).digest()


def server_proof(key: bytes, client_nonce: bytes, server_nonce: bytes, node_id: str) -> bytes:
    return hmac.new(key, b"server" + client_nonce + server_nonce + node_id.encode(), hashlib.sha256).digest()


def proofs_equal(a: bytes, b: bytes) -> bool:
    """Constant time, so timing does not reveal how much of a forged proof was right."""
    return hmac.compare_digest(a, b)
