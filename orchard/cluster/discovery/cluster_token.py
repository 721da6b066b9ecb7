"""The cluster token: the one secret that lets a machine into a cluster.

A head creates it on first start, prints it once and keeps it in a file only its user can
read. Every other secret is derived from it per purpose (the key that signs zeroconf
advertisements, the bearer token Ray's own authentication checks), so a secret that leaks
from one place, e.g. Ray's token sent in clear on the wire, cannot forge another.
"""

from __future__ import annotations

import hmac
import os
import re
import secrets
import stat
import sys
from pathlib import Path

from orchard.node.serving.link_auth import derive_key as _derive_key

CONFIG_DIR_ENV = "ORCHARD_CONFIG_DIR"
TOKEN_ENV = "ORCHARD_CLUSTER_TOKEN"
MIN_TOKEN_CHARS = 32
_CLUSTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]{0,62}")


class ClusterTokenError(RuntimeError):
    """Base class for token problems; the message says what to do."""


class TokenNotFound(ClusterTokenError):
    pass


class InsecureTokenFile(ClusterTokenError):
    """The token file can be read by other users, so it is not trusted."""


class WeakToken(ClusterTokenError):
    pass


class InvalidClusterName(ValueError):
    pass


def validate_cluster_name(name: str) -> str:
    """Names go into DNS-SD instance names and file names: letters, digits and dashes."""
    if not _CLUSTER_NAME.fullmatch(name):
        raise InvalidClusterName(f"cluster name {name!r}: use 1-63 letters, digits or dashes, starting alphanumeric")
    return name


def config_dir() -> Path:
    """$ORCHARD_CONFIG_DIR, else the platform's per-user config folder."""
    override = os.environ.get(CONFIG_DIR_ENV)
    if override:
        return Path(override).expanduser()
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Application Support" / "mlx-orchard"
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "mlx-orchard"


def token_path(cluster: str) -> Path:
    return config_dir() / f"{validate_cluster_name(cluster)}.token"


def new_token() -> str:
    """256 random bits, URL-safe, so it can be pasted into a shell or an env file."""
    return secrets.token_urlsafe(32)


def check_strength(token: str) -> str:
    token = token.strip()
    if len(token) < MIN_TOKEN_CHARS:
        raise WeakToken(f"cluster token has {len(token)} characters; at least {MIN_TOKEN_CHARS} are required")
    return token


def save_token(cluster: str, token: str) -> Path:
    """Write atomically with mode 0600; the folder is made 0700."""
    path = token_path(cluster)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(check_strength(token) + "\n")
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def load_token_file(path: Path) -> str:
    """Read a token file, refusing one that group or others may read (as ssh does)."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError as exc:
        raise TokenNotFound(f"no cluster token at {path}") from exc
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise InsecureTokenFile(f"{path} is accessible by other users (mode {oct(mode & 0o777)}); run chmod 600 {path}")
    return check_strength(path.read_text())


def load_token(cluster: str) -> str:
    """The token from $ORCHARD_CLUSTER_TOKEN, else this cluster's file in the config folder."""
    from_env = os.environ.get(TOKEN_ENV)
    if from_env:
        return check_strength(from_env)
    path = token_path(cluster)
    try:
        return load_token_file(path)
    except TokenNotFound as exc:
        raise TokenNotFound(
            f"no token for cluster {cluster!r}: copy it from the head into {path} (mode 600), "
            f"set ${TOKEN_ENV}, or pass --token-file"
        ) from exc


def load_or_create_token(cluster: str) -> tuple[str, bool]:
    """(token, created): the head's first start creates and stores one."""
    try:
        return load_token(cluster), False
    except TokenNotFound:
        token = new_token()
        save_token(cluster, token)
        return token, True


def tokens_equal(a: str, b: str) -> bool:
    """Constant-time comparison, so timing does not reveal how much of a guess was right."""
    return hmac.compare_digest(a.encode(), b.encode())


def derive_key(token: str, purpose: str) -> bytes:
    """A 32-byte key for one purpose; knowing it reveals neither the token nor other keys."""
    return _derive_key(token, purpose)


def advert_key(token: str) -> bytes:
    return derive_key(token, "zeroconf-advert-v1")


def ray_auth_token(token: str) -> str:
    """The bearer token for Ray (RAY_AUTH_TOKEN), in Ray's own format: 64 hex digits."""
    return derive_key(token, "ray-auth-v1").hex()
