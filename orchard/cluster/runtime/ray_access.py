"""Who may talk to the Ray that orchard starts, and on which addresses it listens.

Ray's ports run code for whoever reaches them, so every Ray orchard starts requires a
bearer token (Ray's `RAY_AUTH_MODE=token`), and a Ray meant for this machine alone
listens on loopback only. Ray decides both from its environment, read when its modules
are imported and inherited by every process it spawns, so they are set here, in
`os.environ`, before the first `import ray` of the process that starts it.

Loopback: Ray's GCS and raylet bind 127.0.0.1 only when their node address is exactly
127.0.0.1, and Ray rewrites a loopback address into the machine's LAN address unless
`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` (the setting behind Ray's own single-machine mode on
macOS) is in force. With a LAN address Ray 2.60 binds all interfaces whatever it is told;
then the token is the only guard.
"""

from __future__ import annotations

import os
import secrets
import sys

AUTH_MODE_ENV = "RAY_AUTH_MODE"
AUTH_TOKEN_ENV = "RAY_AUTH_TOKEN"
AUTH_TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"
#: "0" makes Ray keep a loopback node address instead of replacing it with the LAN one.
MULTI_HOST_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
LOOPBACK = "127.0.0.1"


class RayAlreadyImported(RuntimeError):
    """Ray was imported before its access settings were made, so they would not apply."""


class UnauthenticatedRay(RuntimeError):
    """A driver was asked to attach to Ray without token authentication."""


def new_ray_token() -> str:
    """A random bearer token in Ray's own format (64 hex digits), for a Ray that lives only as long as its starter."""
    return secrets.token_hex(32)


def access_environment(ray_token: str, *, loopback: bool) -> dict[str, str]:
    """The variables that turn Ray's token authentication on (and keep it on loopback)."""
    env = {AUTH_MODE_ENV: "token", AUTH_TOKEN_ENV: ray_token}
    if loopback:
        env[MULTI_HOST_ENV] = "0"
    return env


def require_token_auth(ray_token: str, *, loopback: bool) -> None:
    """Set this process's (and so its children's) Ray access; must run before Ray is imported.

    The token file path is removed so that `~/.ray/auth_token` or a stale path never
    replaces the token given here.
    """
    if "ray" in sys.modules and os.environ.get(AUTH_TOKEN_ENV) != ray_token:
        raise RayAlreadyImported("Ray's access settings must be made before Ray is imported")
    os.environ.update(access_environment(ray_token, loopback=loopback))
    os.environ.pop(AUTH_TOKEN_PATH_ENV, None)


def check_driver_has_token(environ: dict[str, str]) -> None:
    """A driver attaching to an existing Ray must speak its token, or that Ray has none."""
    if environ.get(AUTH_MODE_ENV, "").lower() != "token":
        raise UnauthenticatedRay(
            f"{AUTH_MODE_ENV} is not 'token': the Ray cluster would run code for anyone who reaches it. Start Ray "
            f"with {AUTH_MODE_ENV}=token (deploy/cluster.yaml does) and set it, with the token in {AUTH_TOKEN_ENV} "
            f"or ~/.ray/auth_token, for this driver too; or pass --allow-unauthenticated-ray"
        )
