"""Keys derived from the cluster's secret, and the challenge-response a node-to-node link opens with.

Here rather than in `orchard.cluster.discovery` because the node side needs them and never imports
`cluster`; `orchard.cluster.discovery.cluster_token` derives its own keys with the same function.

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
import socket

from orchard.node.serving.link_io import recv_exact

MAGIC = b"ORKVLNK1"  # the KV link's; another link over the same handshake opens with its own
NONCE_SIZE = 32
PROOF_SIZE = 32
#: Where a node finds the secret when its config names none: Ray's token, itself derived from
#: the cluster token by `orchard head` / `orchard join` and the same on every machine.
SECRET_ENV = "RAY_AUTH_TOKEN"


def derive_key(secret: str, purpose: str) -> bytes:
    """A 32-byte key for one purpose; knowing it reveals neither the secret nor other keys."""
    return hmac.new(secret.encode(), b"mlx-orchard/" + purpose.encode(), hashlib.sha256).digest()


def link_key(secret: str | None, environ=None, purpose: str = "kv-link-v1") -> bytes | None:
    """A link's key (the KV link's unless `purpose` names another) from `secret`, else from the
    environment's Ray token; None: no link."""
    secret = secret or (os.environ if environ is None else environ).get(SECRET_ENV)
    return derive_key(secret, purpose) if secret else None


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_SIZE)


def client_proof(key: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(key, b"client" + server_nonce + client_nonce, hashlib.sha256).digest()


def server_proof(key: bytes, client_nonce: bytes, server_nonce: bytes, node_id: str) -> bytes:
    return hmac.new(key, b"server" + client_nonce + server_nonce + node_id.encode(), hashlib.sha256).digest()


def proofs_equal(a: bytes, b: bytes) -> bool:
    """Constant time, so timing does not reveal how much of a forged proof was right."""
    return hmac.compare_digest(a, b)


class LinkRefused(ConnectionError):
    """The peer is not the orchard link we meant, does not hold our key, or is not the node we meant."""


HANDSHAKE_TIMEOUT_S = 5.0
CONNECT_TIMEOUT_S = 2.0


def answer_handshake(conn: socket.socket, key: bytes, node_id: str, magic: bytes = MAGIC,
                     timeout_s: float = HANDSHAKE_TIMEOUT_S) -> bool:
    """The listener's side, on a freshly accepted blocking socket (given `timeout_s` and no Nagle delay
    here): whether the peer proved `key` (we then proved it and named `node_id`)."""
    conn.settimeout(timeout_s)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    nonce = new_nonce()
    conn.sendall(magic + nonce)
    answer = recv_exact(conn, NONCE_SIZE + PROOF_SIZE)
    if answer is None:
        return False
    theirs, proof = answer[:NONCE_SIZE], answer[NONCE_SIZE:]
    if not proofs_equal(proof, client_proof(key, nonce, theirs)):
        return False
    name = node_id.encode()
    conn.sendall(server_proof(key, theirs, nonce, node_id) + bytes([len(name)]) + name)
    return True


def open_handshake(sock: socket.socket, key: bytes, expected_node: str, address: str, magic: bytes = MAGIC) -> None:
    """The connecting side, on a blocking socket; raises `LinkRefused` unless `expected_node` proved `key`."""
    hello = recv_exact(sock, len(magic) + NONCE_SIZE)
    if hello is None or hello[: len(magic)] != magic:
        raise LinkRefused(f"{address} is not the link we meant")
    server_nonce, nonce = hello[len(magic) :], new_nonce()
    sock.sendall(nonce + client_proof(key, server_nonce, nonce))
    reply = recv_exact(sock, PROOF_SIZE + 1)
    name = recv_exact(sock, reply[-1]) if reply is not None else None
    if name is None or name.decode(errors="replace") != expected_node:
        raise LinkRefused(f"{address} refused our key, or is not node {expected_node!r}")
    if not proofs_equal(reply[:PROOF_SIZE], server_proof(key, nonce, server_nonce, expected_node)):
        raise LinkRefused(f"{address} does not hold the cluster's key")


def dial(address: str, key: bytes, expected_node: str, magic: bytes = MAGIC, connect_timeout_s: float = CONNECT_TIMEOUT_S,
         handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S) -> socket.socket:
    """A blocking connection to `expected_node` at "host:port" that has proved `key` both ways (run it in a
    thread); raises OSError or `LinkRefused`. Left with the handshake's timeout: the caller sets its own."""
    host, _, port = address.rpartition(":")
    sock = socket.create_connection((host, int(port)), timeout=connect_timeout_s)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(handshake_timeout_s)
        open_handshake(sock, key, expected_node, address, magic)
        return sock
    except BaseException:
        sock.close()
        raise
