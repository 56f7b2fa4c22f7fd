"""The few rtnetlink requests a worker's network needs, spoken directly on a netlink socket.

A netlink socket belongs to the network namespace it was opened in, whatever namespace its
process moves to afterwards; so `Rtnl` opened inside a namespace keeps configuring that one.
Requests: create a veth pair whose peer lands in another namespace, bring a link up, give a
link an address, route a /32 to a link, route everything through an on-link gateway, delete a
link, and find a link's index. Each request
waits for the kernel's acknowledgement and raises OSError with its errno on a refusal.

pyroute2 does all this and much more, but takes ~0.3 s to import; these five messages are
small enough to write by hand.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct

__all__ = ["Rtnl", "SockDiag"]

_NETLINK_ROUTE = 0
_NLMSG_ERROR = 2
_NLM_F_REQUEST = 0x1
_NLM_F_ACK = 0x4
_NLM_F_REPLACE = 0x100
_NLM_F_EXCL = 0x200
_NLM_F_CREATE = 0x400

_RTM_NEWLINK, _RTM_DELLINK, _RTM_GETLINK, _RTM_SETLINK = 16, 17, 18, 19
_RTM_NEWADDR = 20
_RTM_NEWROUTE = 24

_IFLA_IFNAME = 3
_IFLA_LINKINFO = 18
_IFLA_NET_NS_FD = 28
_IFLA_INFO_KIND = 1
_IFLA_INFO_DATA = 2
_VETH_INFO_PEER = 1
_IFF_UP = 0x1

_IFA_ADDRESS, _IFA_LOCAL = 1, 2
_RTA_DST, _RTA_OIF, _RTA_GATEWAY = 1, 4, 5
_RTNH_F_ONLINK = 4
_RT_SCOPE_UNIVERSE = 0
_RT_TABLE_MAIN = 254
_RTPROT_STATIC = 4
_RT_SCOPE_LINK = 253
_RTN_UNICAST = 1

_NLMSGHDR = struct.Struct("=IHHII")
_IFINFOMSG = struct.Struct("=BxHiII")
_IFADDRMSG = struct.Struct("=BBBBI")
_RTMSG = struct.Struct("=BBBBBBBBI")


def _attr(kind: int, payload: bytes) -> bytes:
    length = 4 + len(payload)
    return struct.pack("=HH", length, kind) + payload + b"\0" * (-length % 4)


def _name(name: str) -> bytes:
    return name.encode() + b"\0"


def _ifinfo(index: int = 0, flags: int = 0, change: int = 0) -> bytes:
    return _IFINFOMSG.pack(socket.AF_UNSPEC, 0, index, flags, change)


class Rtnl:
    """A route netlink socket in the calling thread's network namespace as of opening."""

    def __init__(self) -> None:
        self._sock = socket.socket(
            socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, _NETLINK_ROUTE
        )
        self._sock.bind((0, 0))
        self._seq = 0

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> Rtnl:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def add_veth(self, name: str, peer: str, peer_netns_fd: int) -> None:
        """Create veth `name` here with its peer `peer` in the namespace `peer_netns_fd`."""
        peer_info = _ifinfo() + _attr(_IFLA_IFNAME, _name(peer))
        peer_info += _attr(_IFLA_NET_NS_FD, struct.pack("=I", peer_netns_fd))
        info = _attr(_IFLA_INFO_KIND, b"veth")
        info += _attr(_IFLA_INFO_DATA, _attr(_VETH_INFO_PEER, peer_info))
        body = _ifinfo() + _attr(_IFLA_IFNAME, _name(name)) + _attr(_IFLA_LINKINFO, info)
        self._request(_RTM_NEWLINK, _NLM_F_CREATE | _NLM_F_EXCL, body)

    def set_up(self, name: str) -> None:
        """Bring the link named `name` up."""
        body = _ifinfo(flags=_IFF_UP, change=_IFF_UP) + _attr(_IFLA_IFNAME, _name(name))
        self._request(_RTM_SETLINK, 0, body)

    def delete_link(self, name: str) -> bool:
        """Delete the link named `name` (a veth takes its peer with it); False if none."""
        try:
            self._request(_RTM_DELLINK, 0, _ifinfo() + _attr(_IFLA_IFNAME, _name(name)))
        except OSError as e:
            if e.errno == 19:  # ENODEV
                return False
            raise
        return True

    def index(self, name: str) -> int:
        """The index of the link named `name`."""
        reply = self._request(_RTM_GETLINK, 0, _ifinfo() + _attr(_IFLA_IFNAME, _name(name)))
        _family, _type, index, _flags, _change = _IFINFOMSG.unpack_from(reply)
        return int(index)

    def add_address(
        self, name: str, address: ipaddress.IPv4Address, prefixlen: int, *, link_scope: bool = False
    ) -> None:
        """Give link `name` the address `address/prefixlen` (with `link_scope`, one the
        namespace never picks as the source of traffic leaving by another link)."""
        packed = address.packed
        scope = _RT_SCOPE_LINK if link_scope else _RT_SCOPE_UNIVERSE
        body = _IFADDRMSG.pack(socket.AF_INET, prefixlen, 0, scope, self.index(name))
        body += _attr(_IFA_LOCAL, packed) + _attr(_IFA_ADDRESS, packed)
        self._request(_RTM_NEWADDR, _NLM_F_CREATE | _NLM_F_EXCL, body)

    def add_host_route(self, address: ipaddress.IPv4Address, name: str) -> None:
        """Route `address/32` out of link `name` (on-link, no gateway), in place of any route
        to it there is.
        """
        body = _RTMSG.pack(
            socket.AF_INET,
            32,
            0,
            0,
            _RT_TABLE_MAIN,
            _RTPROT_STATIC,
            _RT_SCOPE_LINK,
            _RTN_UNICAST,
            0,
        )
        body += _attr(_RTA_DST, address.packed) + _attr(
            _RTA_OIF, struct.pack("=I", self.index(name))
        )
        self._request(_RTM_NEWROUTE, _NLM_F_CREATE | _NLM_F_REPLACE, body)

    def add_default_route(self, gateway: ipaddress.IPv4Address, name: str) -> None:
        """Route everything through `gateway`, reached directly on link `name` (on-link: the
        gateway need not be in a prefix of the link's), in place of any default route.
        """
        self.add_route(ipaddress.IPv4Network("0.0.0.0/0"), gateway, name)

    def add_route(
        self, prefix: ipaddress.IPv4Network, gateway: ipaddress.IPv4Address, name: str
    ) -> None:
        """Route `prefix` through `gateway`, reached directly on link `name` (on-link), in
        place of any route to it there is."""
        body = _RTMSG.pack(
            socket.AF_INET,
            prefix.prefixlen,
            0,
            0,
            _RT_TABLE_MAIN,
            _RTPROT_STATIC,
            _RT_SCOPE_UNIVERSE,
            _RTN_UNICAST,
            _RTNH_F_ONLINK,
        )
        if prefix.prefixlen:
            body += _attr(_RTA_DST, prefix.network_address.packed)
        body += _attr(_RTA_GATEWAY, gateway.packed)
        body += _attr(_RTA_OIF, struct.pack("=I", self.index(name)))
        self._request(_RTM_NEWROUTE, _NLM_F_CREATE | _NLM_F_REPLACE, body)

    def _request(self, kind: int, flags: int, body: bytes) -> bytes:
        """Send one request and return the payload of its answer (empty for a bare ack)."""
        self._seq += 1
        seq = self._seq
        header = _NLMSGHDR.pack(
            _NLMSGHDR.size + len(body), kind, _NLM_F_REQUEST | _NLM_F_ACK | flags, seq, 0
        )
        self._sock.send(header + body)
        payload = b""
        while True:
            data = self._sock.recv(65536)
            offset = 0
            while offset + _NLMSGHDR.size <= len(data):
                length, msg_type, _flags, msg_seq, _pid = _NLMSGHDR.unpack_from(data, offset)
                if length < _NLMSGHDR.size:
                    raise OSError(0, "netlink: malformed answer")
                start = offset + _NLMSGHDR.size
                offset += (length + 3) & ~3
                if msg_seq != seq:
                    continue
                if msg_type != _NLMSG_ERROR:
                    payload = data[start : start + length - _NLMSGHDR.size]
                    continue
                (error,) = struct.unpack_from("=i", data, start)
                if error:
                    raise OSError(-error, f"netlink: {os.strerror(-error)}")
                return payload


_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_DUMP = 0x300
_NLMSG_DONE = 3
_TCP_LISTEN = 10
_INET_DIAG_REQ = struct.Struct("=BBBxI48x")


class SockDiag:
    """A sock_diag netlink socket, in the namespace it was opened in: which TCP ports listen
    there, asked of the kernel without connecting to anything.
    """

    def __init__(self) -> None:
        self._sock = socket.socket(
            socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, _NETLINK_SOCK_DIAG
        )
        self._sock.bind((0, 0))
        self._seq = 0

    def close(self) -> None:
        self._sock.close()

    def listening(self) -> set[int]:
        """The TCP ports something listens on (any address, IPv4 or IPv6)."""
        ports: set[int] = set()
        for family in (socket.AF_INET, socket.AF_INET6):
            self._seq += 1
            body = _INET_DIAG_REQ.pack(family, socket.IPPROTO_TCP, 0, 1 << _TCP_LISTEN)
            header = _NLMSGHDR.pack(
                _NLMSGHDR.size + len(body),
                _SOCK_DIAG_BY_FAMILY,
                _NLM_F_REQUEST | _NLM_F_DUMP,
                self._seq,
                0,
            )
            self._sock.send(header + body)
            ports |= self._dump(self._seq)
        return ports

    def _dump(self, seq: int) -> set[int]:
        ports: set[int] = set()
        while True:
            data = self._sock.recv(65536)
            offset = 0
            while offset + _NLMSGHDR.size <= len(data):
                length, msg_type, _flags, msg_seq, _pid = _NLMSGHDR.unpack_from(data, offset)
                if length < _NLMSGHDR.size:
                    raise OSError(0, "sock_diag: malformed answer")
                start = offset + _NLMSGHDR.size
                offset += (length + 3) & ~3
                if msg_seq != seq:
                    continue
                if msg_type == _NLMSG_DONE:
                    return ports
                if msg_type == _NLMSG_ERROR:
                    (error,) = struct.unpack_from("=i", data, start)
                    raise OSError(-error, f"sock_diag: {os.strerror(-error)}")
                # inet_diag_msg: family, state, timer, retrans, then the socket id (sport first,
                # in network order).
                (port,) = struct.unpack_from("!H", data, start + 4)
                ports.add(port)
