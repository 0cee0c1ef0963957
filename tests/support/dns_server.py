"""A DNS server on loopback whose records a test sets: what a Kubernetes headless service's name would
answer, for the fleet's DNS discovery."""

from __future__ import annotations

import ipaddress
import socket
import threading

import dns.message
import dns.rcode
import dns.rdatatype
import dns.rrset


class LoopbackDNS:
    """Answers A and AAAA queries from `records` (name -> addresses); NXDOMAIN for a name it lacks."""

    def __init__(self) -> None:
        self.records: dict[str, list[str]] = {}
        self.queries = 0
        self._closing = False
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.bind(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._sock.getsockname()[1]}"
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                data, peer = self._sock.recvfrom(4096)
            except OSError:
                return  # closed
            if self._closing:
                return
            self.queries += 1
            query = dns.message.from_wire(data)
            response = dns.message.make_response(query)
            question = query.question[0]
            addresses = self.records.get(question.name.to_text(omit_final_dot=True))
            if addresses is None:
                response.set_rcode(dns.rcode.NXDOMAIN)
            else:
                version = 4 if question.rdtype == dns.rdatatype.A else 6
                matching = [a for a in addresses if ipaddress.ip_address(a).version == version]
                if matching:
                    response.answer.append(dns.rrset.from_text_list(question.name, 5, "IN", question.rdtype, matching))
            self._sock.sendto(response.to_wire(), peer)

    def close(self) -> None:
        self._closing = True
        # Closing the socket does not wake a thread blocked in recvfrom on it (each test waited out the
        # join's 5 s): a datagram does.
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as wake:
            wake.sendto(b"", self._sock.getsockname())
        self._thread.join(timeout=5)
        self._sock.close()
