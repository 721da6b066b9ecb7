"""Files of the cold tier that only their owner may read: their records hold prompts' token ids
and the model's activations, so other local users must neither list nor open them."""

from __future__ import annotations

import fcntl
import logging
import os
from pathlib import Path

from orchard.kvcache.errors import ColdTierError

log = logging.getLogger(__name__)


def private_folder(folder: Path) -> None:
    """Make `folder` (or narrow it to) 0700 when this user owns it; warn when it is open to others."""
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    info = folder.stat()
    if info.st_uid == os.getuid() and info.st_mode & 0o077:
        os.chmod(folder, 0o700)
    elif info.st_mode & 0o077:
        log.warning("cold tier folder %s is open to other users and not ours to narrow", folder)


def open_locked(path: Path, owner: str) -> int:
    """Open `path` read-write (never through a symlink), 0600, with an exclusive lock: two
    processes writing one slot file would corrupt each other's slots. `owner` names the kind
    of store in the error."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as err:
        raise ColdTierError(f"cannot open cold tier file {path} (a symlink is refused): {err}") from err
    os.fchmod(fd, 0o600)  # a file an older version left world-readable
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as err:
        os.close(fd)
        raise ColdTierError(f"cold tier file {path} is in use by another {owner}") from err
    return fd
