"""Who the client is, as the edge tells a machine: the forwarding headers (`Forwarding`).

A machine may believe X-Forwarded-For and its kin (proxy.wire.FORWARDED) about who its client
is, so the edge never passes a client's: it writes X-Forwarded-For, X-Real-IP,
X-Forwarded-Proto, X-Forwarded-Host and Forwarded (RFC 7239) from the connection it accepted.
A connection from a hop the operator trusts (`--trusted-proxies`: a load balancer or CDN in
front of the edge) keeps its chain, as one proxy behind another does: the edge appends the
hop's address to X-Forwarded-For and its own element to Forwarded, keeps the scheme and host
the hop says the client used, and names as X-Real-IP the nearest address of the chain that is
not a trusted hop (nginx's `real_ip_recursive`). The other forwarding headers such a hop sends
pass on as it sent them.
"""

from __future__ import annotations

from collections.abc import Iterable
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network, ip_address
from typing import Final

Network = IPv4Network | IPv6Network

XFF: Final = b"x-forwarded-for"
RFC7239: Final = b"forwarded"
XFP: Final = b"x-forwarded-proto"
XFH: Final = b"x-forwarded-host"
REAL_IP: Final = b"x-real-ip"
WRITTEN: Final = frozenset({XFF, RFC7239, XFP, XFH, REAL_IP})
"""The forwarding headers the edge writes on every request: a trusted hop's are chained or
kept by the edge (`Forwarding.chained`), never passed on beside the edge's own."""
CHAINED: Final = frozenset({XFF, RFC7239})
"""Lists: a hop's lines are joined (with ", ") and the edge's own entry goes last."""

_HOST_LINE: Final = b'"\r\nX-Forwarded-Host: '


class Forwarding:
    """The edge's forwarding headers, given the hops it trusts (none by default)."""

    __slots__ = ("trusted",)

    def __init__(self, trusted: Iterable[Network] = ()) -> None:
        self.trusted: tuple[Network, ...] = tuple(trusted)

    def trusts(self, address: str) -> bool:
        """Whether `address` (a peer's, or an entry of a hop's X-Forwarded-For) is a trusted
        hop's. Anything that is not an address is not trusted."""
        if not self.trusted:
            return False
        try:
            ip: IPv4Address | IPv6Address = ip_address(address.strip())
        except ValueError:
            return False
        if isinstance(ip, IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped  # a dual-stack listener sees IPv4 clients so
        return any(ip in net for net in self.trusted)

    @staticmethod
    def lines(peer: bytes) -> bytes:
        """The forwarding lines for a client at `peer` that is no trusted hop, up to the host
        of Forwarded: the request's Host, then `host_line(host)`, complete them. Made once per
        connection."""
        return (
            b"X-Forwarded-For: " + peer + b"\r\nX-Real-IP: " + peer
            + b"\r\nX-Forwarded-Proto: http\r\nForwarded: for=" + _node(peer)
            + b';proto=http;host="'
        )  # fmt: skip

    @staticmethod
    def host_line(host: bytes) -> bytes:
        """What follows the request's Host in `lines`: X-Forwarded-Host's."""
        return _HOST_LINE + host + b"\r\n"

    def chained(self, peer: bytes, hop: dict[bytes, bytes], host: bytes) -> bytes:
        """The forwarding lines for a request from the trusted hop at `peer`, which sent the
        forwarding headers `hop` (lowercased name: value; the lists joined)."""
        chain = hop.get(XFF)
        xff = peer if chain is None else chain + b", " + peer
        real = peer
        if chain is not None:
            entries = [e.strip() for e in chain.split(b",")]
            real = entries[0]
            for entry in reversed(entries):
                if not self.trusts(entry.decode("latin-1")):
                    real = entry
                    break
        element = b"for=" + _node(peer) + b';proto=http;host="' + host + b'"'
        earlier = hop.get(RFC7239)
        return b"".join(
            (
                b"X-Forwarded-For: ", xff, b"\r\nX-Real-IP: ", real,
                b"\r\nX-Forwarded-Proto: ", hop.get(XFP, b"http"),
                b"\r\nForwarded: ", element if earlier is None else earlier + b", " + element,
                b"\r\nX-Forwarded-Host: ", hop.get(XFH, host), b"\r\n",
            )
        )  # fmt: skip


def _node(peer: bytes) -> bytes:
    """A peer as RFC 7239 names a node: IPv6 in brackets and quotes."""
    return b'"[' + peer + b']"' if b":" in peer else peer
