"""Where the ports a run opens listen: on loopback, unless a setting opens one beyond it on purpose
(`runner.bind_host`, `logging.prometheus_host`); then one warning per port names it and what anyone who
reaches it gets. On a shared host or network a job service or a worker pool open to all is code execution
as the orchestrator's user."""

from __future__ import annotations

import ipaddress
import logging

_LOG = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"  # where every port of a run listens unless a setting says otherwise


def is_loopback(host: str) -> bool:
    """Whether `host` is this machine's loopback alone: localhost, 127.0.0.0/8 or ::1. Every other address,
    a wildcard ("0.0.0.0", "::", "") and any other name reach beyond it."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def host_port(host: str, port: int) -> str:
    """`host:port` as gRPC and URLs spell it (an IPv6 address in brackets)."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def local_name(host: str) -> str:
    """The name a process on this machine reaches a listener on `host` by: localhost for a wildcard."""
    return "localhost" if host.strip("[]") in ("", "0.0.0.0", "::") else host.strip("[]")


def reach(host: str, port: int) -> str:
    """The `host:port` a process on this machine reaches a listener on `host` at."""
    return host_port(local_name(host), port)


def warn_if_open(host: str, port: int, what: str, setting: str) -> None:
    """One warning when `host` puts `port` beyond loopback: the port, the address, what it exposes and the
    setting that opened it."""
    if not is_loopback(host):
        _LOG.warning("port %d listens on %s, beyond loopback (%s): %s", port, host or "every interface", setting, what)
