"""The TCP ports processes listen on, read from /proc/net/tcp{,6} and the processes' open sockets (what
`ss -ltnp` shows, without needing it)."""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Iterable
from dataclasses import dataclass

_LISTEN = "0A"  # the TCP state column of a listening socket


@dataclass(frozen=True)
class Listener:
    address: str
    port: int
    owner: str  # the owning process's command line, shortened

    def __str__(self) -> str:
        return f"{self.address}:{self.port} ({self.owner})"

    @property
    def on_loopback(self) -> bool:
        ip = ipaddress.ip_address(self.address)
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped  # ::ffff:127.0.0.1, an IPv4 bind on a dual-stack socket
        return ip.is_loopback


def _address(field: str) -> tuple[str, int]:
    """`0100007F:1F90` (the kernel's bytes: each 32-bit word in host order) -> ("127.0.0.1", 8080)."""
    hex_ip, hex_port = field.split(":")
    raw = bytes.fromhex(hex_ip)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    family = socket.AF_INET if len(raw) == 4 else socket.AF_INET6
    return socket.inet_ntop(family, words), int(hex_port, 16)


def _listening_inodes() -> dict[int, tuple[str, int]]:
    inodes = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            next(f)
            for line in f:
                fields = line.split()
                if fields[3] == _LISTEN:
                    inodes[int(fields[9])] = _address(fields[1])
    return inodes


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:  # gone, or not ours
        return inodes
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(int(link[len("socket:["):-1]))
    return inodes


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:100]
    except OSError:
        return "?"


def listeners(pids: Iterable[int]) -> set[Listener]:
    """Every TCP port the processes `pids` listen on now."""
    table = _listening_inodes()
    found = set()
    for pid in pids:
        for inode in _socket_inodes(pid) & table.keys():
            found.add(Listener(*table[inode], _command(pid)))
    return found
