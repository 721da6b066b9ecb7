"""Which TCP ports a process tree listens on, read from /proc (Linux), for exposure tests."""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

_LISTEN = "0A"


@dataclass(frozen=True)
class Listener:
    pid: int
    process: str
    address: ipaddress.IPv4Address | ipaddress.IPv6Address
    port: int

    @property
    def loopback(self) -> bool:
        mapped = getattr(self.address, "ipv4_mapped", None)
        return (mapped or self.address).is_loopback


def descendants(root: int) -> set[int]:
    """`root` and every process below it."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo.extend(children.get(pid, []))
    return found


def _decode(hex_address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """/proc/net/tcp{,6} write each 32-bit word of the address in host (little-endian) order."""
    raw = bytes.fromhex(hex_address)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(words)


def _listening_inodes() -> dict[str, tuple]:
    table = {}
    for name in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{name}").read_text().splitlines()[1:]:
            parts = line.split()
            if parts[3] == _LISTEN:
                host, port = parts[1].split(":")
                table[parts[9]] = (_decode(host), int(port, 16))
    return table


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    try:
        for fd in os.scandir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(fd.path)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    except OSError:
        pass
    return inodes


def _name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def listeners(root: int) -> list[Listener]:
    """Every listening TCP socket held by `root` or a process below it."""
    table = _listening_inodes()
    found = []
    for pid in sorted(descendants(root)):
        for inode in _socket_inodes(pid):
            if inode in table:
                found.append(Listener(pid, _name(pid), *table[inode]))
    return found
