"""A fleet named by DNS: every A and AAAA record of a name is one server (a Kubernetes headless service
answers with its ready pods' addresses), re-resolved on every discovery."""

from __future__ import annotations

import ipaddress
import urllib.parse

import dns.exception
import dns.resolver

from beam_rl.fleet.discovery import DiscoveryError


def resolver_for(nameserver: str | None, timeout_s: float) -> dns.resolver.Resolver:
    """The system's resolver (/etc/resolv.conf), or one asking only `nameserver` ("host:port" or "host")."""
    if nameserver is None:
        resolver = dns.resolver.Resolver()
    else:
        host, _, port = nameserver.rpartition(":") if nameserver.count(":") == 1 else (nameserver, "", "")
        resolver = dns.resolver.Resolver(configure=False)
        resolver.nameservers = [host.strip("[]")]
        resolver.port = int(port) if port else 53
    resolver.lifetime = timeout_s
    return resolver


def resolve_fleet(base_url: str, nameserver: str | None = None, timeout_s: float = 2.0) -> list[str]:
    """`base_url` with its host replaced by each address the host resolves to, sorted. DiscoveryError when
    the name does not exist, has no address, or no nameserver answers."""
    parts = urllib.parse.urlsplit(base_url)
    name = parts.hostname
    if not name:
        raise DiscoveryError(f"{base_url!r} names no host to resolve")
    resolver = resolver_for(nameserver, timeout_s)
    where = f"nameserver {nameserver}" if nameserver else "the system's resolver"
    addresses: set[str] = set()
    for rdtype in ("A", "AAAA"):
        try:
            answer = resolver.resolve(name, rdtype)
        except dns.resolver.NoAnswer:
            continue
        except dns.resolver.NXDOMAIN:
            raise DiscoveryError(f"{name} does not exist (NXDOMAIN from {where})") from None
        except (dns.exception.Timeout, dns.resolver.NoNameservers) as err:
            raise DiscoveryError(f"resolving {name}: {where} did not answer ({err})") from None
        addresses.update(record.address for record in answer)
    if not addresses:
        raise DiscoveryError(f"{name} resolves to no address ({where})")
    port = f":{parts.port}" if parts.port else ""
    return sorted(urllib.parse.urlunsplit(parts._replace(netloc=_host(a) + port)).rstrip("/") for a in addresses)


def _host(address: str) -> str:
    return f"[{address}]" if ipaddress.ip_address(address).version == 6 else address
