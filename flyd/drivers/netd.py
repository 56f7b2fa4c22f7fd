"""netd: the process that holds a worker's machine networking, so it outlives flyd.

One netd per OCI driver run root, started by flyd (`python -m flyd.drivers.netd`) and left
running across flyd restarts, like the machines. It lives in a network namespace of its own,
the worker's *hub*, and for each machine it:

- makes the machine's user namespace (container root is a host uid range of its own) and its
  network namespace, which that user namespace owns: loopback up, any port bindable by any of
  the machine's users, IPv6 off,
  and a veth pair whose `eth0` end is the machine's only other link, with the machine's own
  address (a /32 of the worker's prefix) routed to it in the hub. The hub forwards nothing:
  machines cannot reach each other, the host, or anything beyond; the hub's routes are where
  a later cross-host network plugs in. Nothing is ever added to the host's own namespace;
- with an uplink (a network namespace the operator names, `flyd --egress-via`): joins the hub
  to it by a veth (`up0` in the hub, with the address `prefix + 1`; `nn<that address in hex>`
  in the uplink, with the link-local gateway address 169.254.0.1, and a route back to the
  hub's address), and lets each machine whose config asks for egress out through it: a
  default route in its namespace, and an element of the hub's nftables set (`flyd.drivers.nft`:
  forwarded to the uplink only from that veth and address, SNATed to the hub's address,
  replies back; everything else dropped);
- with `routes` (`flyd --route-machines`): joins the hub to the host's namespace by a veth
  (`rt0` in the hub, with the address `prefix + 1`; `nr<that address in hex>` on the host,
  with the link-local address 169.254.0.1 and the route of the worker's prefix through the
  hub), so a machine's own address is reached from the host and from any host that routes
  the prefix to this one: the hub forwards to a machine only TCP to its published services
  (the nftables set `services` of address . port, `flyd.drivers.nft.routes_table`) and the
  replies back, nothing a machine starts; each machine gets a default route to the hub;
- holds the sockets of the machine's published host ports (flyd binds them on its machine
  host alone, 127.0.0.1 by default, and hands them over), for the machine's whole life,
  running or not: a published port is never free for someone else to take. A port listens
  exactly while the machine's service does (netd asks the machine's namespace through
  sock_diag, connecting to nothing): otherwise it refuses connections, as a host port nobody
  listens on does, so a TCP check or the proxy sees the service as it is;
- forwards each connection accepted on such a port, within the machine's budget of
  connections at once (`flyd.drivers.forward`: one machine's flood cannot take the
  descriptors the others need), to the service's port on the loopback of the machine's
  namespace (an app listening on 127.0.0.1 or 0.0.0.0 alike), through a socket
  it opens inside that namespace. From the host namespace, traffic only ever goes to
  127.0.0.1; the machine sees its client as 127.0.0.1.

crun joins the namespaces netd made through `/proc/<netd pid>/fd/<n>`; netd keeps them until
flyd says the machine is down. The network namespace is the machine's user namespace's, not
the host's, because that owner decides what the machine sees of the host (tried both ways):
owned by the host, the kernel refuses crun a fresh sysfs and crun binds the host's /sys instead
(every host device listed, a read-write mount), and the host's kernel uevents reach any
NETLINK_KOBJECT_UEVENT socket in it (they go to every network namespace the initial user
namespace owns). Masking /sys would hide the first and leave the uevents; owned by the
machine, its sysfs is its own (lo and eth0 alone in /sys/class/net, mounted read-only) and no
host uevent reaches it. flyd speaks to netd over a SOCK_SEQPACKET unix socket in the
run root: one JSON request per datagram, listening sockets passed alongside as SCM_RIGHTS, one
JSON answer each (`{"ok": ...}` or `{"error": "..."}`, with the request's `id` if it had one):

- `hello` -> netd's pid and what it holds (after a flyd restart, flyd picks up from there)
- `publish {machine, ports: [[host_port, internal_port], ...]}` + the listening sockets of the
  ports netd does not hold yet: the machine's published ports are exactly these
- `up {machine, address, uid, uids, netns?, ports?, egress?}` -> `{netns, userns}` paths for
  crun; `netns` adopts a running machine's namespace (after netd itself restarted) instead of a
  new one; `ports` (and sockets) as for `publish`, in the same round trip; `egress` lets it out
  through the uplink (refused without one); `next {uid, uids}` names the user namespace
  flyd expects to ask for next, which netd makes ahead, once it has answered (see `Spares`)
- `uplink {netns, address, prefix}`: the worker's uplink is this namespace (made anew only if
  it changed), the hub's address on it and the worker's prefix; `{netns: null}`: none (an
  uplink there was goes, and with it every machine's egress)
- `routes {prefix, address}`: route the machines of `prefix` to the host through the hub's
  `address` (made anew only if it changed); `{prefix: null}`: not (the link goes). Refused
  with an uplink: both would be the hub's default route
- `down {machine}`: drop its namespaces (it stopped); `forget {machine}`: and its ports
- `limits {connections_per_machine}`: each machine's budget of forwarded connections at once
  (see `flyd.drivers.forward`; `hello` says the limits and, per machine, its connections now
  and how many went over its budget, reset)

It imports nothing but the standard library and four small siblings (no flyd runtime;
`flyd.drivers.forward` forwards the connections), so it starts in ~0.1 s.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import ipaddress
import json
import os
import signal
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from flyd.drivers import namespaces
from flyd.drivers.fdlimit import raise_nofile
from flyd.drivers.forward import Forwarder
from flyd.drivers.netlink import Rtnl, SockDiag
from flyd.drivers.nft import (
    ROUTED,
    ROUTES_TABLE,
    TABLE,
    UPLINK,
    Nft,
    drop_table,
    element,
    routes_table,
    service_elements,
    table,
)

__all__ = ["PROTOCOL", "main", "unix_address"]

PROTOCOL = 1
MAX_MESSAGE = 64 << 10
_MAX_FDS = 64
_SPARE_USERNS = 2  # user (and their network) namespaces made ahead, for the uid ranges next
_SPARE_DELAY_S = 0.01  # after an answer: the start it answered is busy making its container
# The uplink end's address, the hub's gateway: link-local, the same in every hub (a route to
# each hub's own address tells them apart in a shared uplink).
_GATEWAY = ipaddress.IPv4Address("169.254.0.1")


def _log(event: str, **fields: object) -> None:
    record = {"time": round(time.time(), 3), "service": "netd", "event": event, **fields}
    print(json.dumps(record), file=sys.stderr, flush=True)


def _sysctl(path: str, value: str) -> None:
    """Write a sysctl of the namespace the calling thread is in (read at open time)."""
    with open(f"/proc/sys/{path}", "w") as f:
        f.write(value)


@dataclass(eq=False)
class _Port:
    host_port: int
    internal_port: int
    sock: socket.socket  # bound to the host port; listening only while it serves
    server: asyncio.AbstractServer | None = None  # while it serves


@dataclass(eq=False)
class _Machine:
    machine_id: str
    ports: dict[int, _Port] = field(default_factory=dict)
    netns: int | None = None  # descriptor of its network namespace while it is up
    userns: int | None = None
    veth: str | None = None
    address: str | None = None
    diag: SockDiag | None = None  # asks its namespace which ports listen
    watch: asyncio.Task[None] | None = None  # until each published port serves
    egress: bool = False  # while up: its veth and address are in the hub's egress set
    routed: frozenset[int] = frozenset()  # its ports in the hub's `services` set (while up)


@dataclass(frozen=True)
class _Routes:
    address: ipaddress.IPv4Address  # the hub's on `rt0`: machines' gateway, the host's next hop
    prefix: ipaddress.IPv4Network  # the worker's, routed by the host into the hub


@dataclass(frozen=True)
class _Uplink:
    netns: str
    inode: tuple[int, int]  # st_dev, st_ino of the namespace: a new one at the path is new
    address: ipaddress.IPv4Address  # the hub's, which machines' traffic leaves from
    prefix: ipaddress.IPv4Network  # the worker's, never reached through the uplink


class Netd:
    """The daemon's state; see the module docstring."""

    def __init__(self, host_netns: int, hub_netns: int, hub_rtnl: Rtnl, *, nofile: int) -> None:
        self.host_netns = host_netns  # where published ports are: a socket lives in the
        self.hub_netns = hub_netns  # namespace its maker was in when it made it
        self.rtnl = hub_rtnl
        self.machines: dict[str, _Machine] = {}
        self.forwarder = Forwarder(self._in, _log, nofile=nofile)
        self.links = 0  # veths made: each gets a new name
        self.pid = os.getpid()
        self.uplink: _Uplink | None = None
        self.routes: _Routes | None = None
        self._nft: Nft | None = None  # made with the first uplink, in the hub
        # Made ahead of need (`_make_spares`), so an `up` mostly only plumbs: user namespaces
        # by uid range (never one a machine has used: a user namespace keeps its users'
        # keyrings), each with the network namespace it owns.
        self._spare_userns: dict[tuple[int, int], tuple[int, int]] = {}  # -> (userns, netns)
        self._wanted_userns: tuple[int, int] | None = None
        self._making: asyncio.TimerHandle | None = None

    # -- requests -----------------------------------------------------------------------------

    async def handle(self, request: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        op = request.get("op")
        if op == "hello":
            return {
                "pid": self.pid,
                "protocol": PROTOCOL,
                "machines": {
                    mid: {
                        "ports": sorted(m.ports),
                        "up": m.netns is not None,
                        "egress": m.egress,
                        "connections": self.forwarder.open.get(mid, 0),
                        "refused": self.forwarder.refused.get(mid, 0),
                    }
                    for mid, m in self.machines.items()
                },
                "uplink": None if self.uplink is None else self.uplink.netns,
                "routes": None if self.routes is None else str(self.routes.prefix),
                "limits": {
                    "nofile": self.forwarder.nofile,
                    "connections_per_machine": self.forwarder.per_machine,
                },
            }
        if op == "limits":
            per_machine = request.get("connections_per_machine")
            if not isinstance(per_machine, int) or isinstance(per_machine, bool) or per_machine < 1:
                raise ValueError("connections_per_machine: a positive number")
            self.forwarder.per_machine = per_machine
            return {}
        if op == "uplink":
            self._set_uplink(request)
            return {}
        if op == "routes":
            self._set_routes(request)
            return {}
        machine_id = request.get("machine")
        if not isinstance(machine_id, str) or not machine_id:
            raise ValueError("a request names its machine")
        if op == "publish":
            await self._publish(machine_id, request.get("ports"), fds)
            return {}
        if op == "up":
            answer = self._up(machine_id, request)
            if "ports" in request:  # and its ports, in the same request
                await self._publish(machine_id, request["ports"], fds)
            self._route_services(self.machines[machine_id])
            with contextlib.suppress(TypeError, ValueError, KeyError):  # a hint, no more
                wanted = request.get("next")
                self._wanted_userns = (int(wanted["uid"]), int(wanted["uids"]))  # type: ignore[index]
            self._schedule_spares()  # runs once this answer is sent
            return answer
        if op == "down":
            m = self.machines.get(machine_id)
            if m is not None:
                self._down(m)
            return {}
        if op == "forget":
            m = self.machines.pop(machine_id, None)
            self.forwarder.forget(machine_id)
            if m is not None:
                self._down(m)
                for port in m.ports.values():
                    await self._close_port(port)
            return {}
        raise ValueError(f"unknown request {op!r}")

    async def _publish(self, machine_id: str, ports: object, fds: list[int]) -> None:
        if not isinstance(ports, list) or not all(
            isinstance(p, list) and len(p) == 2 and all(isinstance(x, int) for x in p)
            for p in ports
        ):
            raise ValueError("ports: a list of [host_port, internal_port]")
        m = self.machines.setdefault(machine_id, _Machine(machine_id))
        wanted = {host: internal for host, internal in ports}
        new = [host for host in wanted if host not in m.ports]
        if len(new) != len(fds):
            raise ValueError(f"{len(new)} new ports but {len(fds)} sockets")
        for host, fd in zip(new, fds, strict=True):
            sock = socket.socket(fileno=fd)
            if sock.type != socket.SOCK_STREAM or sock.getsockname()[1] != host:
                sock.close()
                raise ValueError(f"the socket for port {host} is not a TCP socket on it")
            m.ports[host] = _Port(host, wanted[host], sock)
        fds.clear()
        for host in [h for h in m.ports if h not in wanted]:
            await self._close_port(m.ports.pop(host))
        for port in m.ports.values():
            if port.internal_port != wanted[port.host_port]:
                port.internal_port = wanted[port.host_port]
                self._unserve(port)
        self._watch(m)
        self._route_services(m)

    def _up(self, machine_id: str, request: dict[str, Any]) -> dict[str, Any]:
        address = ipaddress.IPv4Address(str(request["address"]))
        uid, uids = int(request["uid"]), int(request["uids"])
        adopt = request.get("netns")
        egress = request.get("egress") is True
        if egress and self.uplink is None:
            raise ValueError("config.network.egress: this worker has no uplink (--egress-via)")
        m = self.machines.setdefault(machine_id, _Machine(machine_id))
        self._down(m)
        userns = None
        try:
            if adopt is not None:
                netns = os.open(str(adopt), os.O_RDONLY | os.O_CLOEXEC)
                with contextlib.suppress(OSError):  # its old eth0 went with the old hub
                    self._in(netns, lambda: Rtnl().close())
            elif uids:
                spare = self._spare_userns.pop((uid, uids), None)
                userns, netns = spare if spare is not None else self._new_sandbox(uid, uids)
            else:  # no user namespace of its own: the network namespace is the host's users'
                netns = self._new_netns()
            try:
                self.links += 1  # a name of its own: the last run's may still be going away
                veth = f"v{self.links:x}"
                self._plumb(netns, veth, address, egress=egress)
                if egress:
                    self._rules(element("add", veth, str(address)))
            except BaseException:
                os.close(netns)
                raise
        except BaseException:
            if userns is not None:
                os.close(userns)
            raise
        m.netns, m.userns, m.veth, m.address = netns, userns, veth, str(address)
        m.egress = egress
        m.diag = self._in(netns, SockDiag)
        self._watch(m)
        return {
            "netns": f"/proc/{self.pid}/fd/{netns}",
            "userns": f"/proc/{self.pid}/fd/{userns}" if userns is not None else None,
        }

    def _new_netns(self) -> int:
        """A network namespace of the hub's owner (the host's user namespace), set up."""
        namespaces.unshare(namespaces.CLONE_NEWNET)
        try:
            fd = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        finally:
            namespaces.setns(self.hub_netns, namespaces.CLONE_NEWNET)
        try:
            self._in(fd, _set_up_netns)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _new_sandbox(self, uid: int, uids: int) -> tuple[int, int]:
        """A machine's user namespace (`uid`.. for its `uids`) and a network namespace it owns,
        set up: see `namespaces.new_user_and_network_namespaces` for why its own."""
        userns, netns = namespaces.new_user_and_network_namespaces(uid, uids)
        try:
            self._in(netns, _set_up_netns)
        except BaseException:
            os.close(userns)
            os.close(netns)
            raise
        return userns, netns

    def _schedule_spares(self) -> None:
        if self._making is None:
            loop = asyncio.get_running_loop()
            self._making = loop.call_later(_SPARE_DELAY_S, self._make_spares)

    def _make_spares(self) -> None:
        """Make what the next `up` will want: the user namespace of the uid range flyd named,
        and the network namespace it owns. A failure only means the next `up` makes its own."""
        self._making = None
        try:
            wanted = self._wanted_userns
            if wanted is not None and wanted not in self._spare_userns:
                if len(self._spare_userns) >= _SPARE_USERNS:
                    oldest = next(iter(self._spare_userns))
                    for fd in self._spare_userns.pop(oldest):
                        os.close(fd)
                self._spare_userns[wanted] = self._new_sandbox(*wanted)
        except OSError as e:
            _log("spares_failed", error=str(e))

    def _in(self, netns: int, work: Any) -> Any:
        namespaces.setns(netns, namespaces.CLONE_NEWNET)
        try:
            return work()
        finally:
            namespaces.setns(self.hub_netns, namespaces.CLONE_NEWNET)

    def _plumb(
        self, netns: int, veth: str, address: ipaddress.IPv4Address, *, egress: bool
    ) -> None:
        """A veth from the hub into the machine's namespace, `address` on its end (its route
        replaces one of an earlier run whose veth is still going away). With `egress`, the
        machine's default route is the hub's uplink address; without, it has none: anything
        beyond its own address is unreachable before a packet leaves it.
        """
        machine_rtnl: Rtnl = self._in(netns, Rtnl)
        try:
            self.rtnl.add_veth(veth, "eth0", netns)
            self.rtnl.set_up(veth)
            self.rtnl.add_host_route(address, veth)
            machine_rtnl.add_address("eth0", address, 32)
            machine_rtnl.set_up("eth0")
            if egress:
                assert self.uplink is not None
                machine_rtnl.add_default_route(self.uplink.address, "eth0")
            elif self.routes is not None:  # its replies to other hosts go through the hub
                machine_rtnl.add_default_route(self.routes.address, "eth0")
        finally:
            machine_rtnl.close()

    # -- the uplink: egress for the machines that ask ---------------------------------------

    def _rules(self, commands: str) -> None:
        if self._nft is None:
            self._nft = Nft()  # here, in the hub: its netlink sockets are the hub's
        self._nft.run(commands)

    def _set_uplink(self, request: dict[str, Any]) -> None:
        path = request.get("netns")
        if path is None:
            self._drop_uplink()
            return
        if self.routes is not None:
            raise ValueError("egress_via: not with route_machines (each is the hub's way out)")
        path = str(path)
        address = ipaddress.IPv4Address(str(request["address"]))
        prefix = ipaddress.IPv4Network(str(request["prefix"]))
        # Checked from the host's namespace: the host's own is refused (nothing is ever added
        # to it), as is anything but a network namespace.
        problem = self._in(self.host_netns, lambda: namespaces.network_namespace_problem(path))
        if problem is not None:
            raise ValueError(f"egress_via: {problem}")
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            hub = os.fstat(self.hub_netns)
            if (st.st_dev, st.st_ino) == (hub.st_dev, hub.st_ino):
                raise ValueError("egress_via: that is the worker's hub itself")
            wanted = _Uplink(path, (st.st_dev, st.st_ino), address, prefix)
            if wanted == self.uplink and self._has_link(UPLINK):
                return  # as it is (a flyd restart): its machines keep their flows
            self._drop_uplink()
            self._make_uplink(fd, wanted)
        finally:
            os.close(fd)
        self.uplink = wanted
        _log("uplink", netns=path, address=str(address))

    def _make_uplink(self, fd: int, uplink: _Uplink) -> None:
        peer = "nn" + uplink.address.packed.hex()  # unique in an uplink shared by workers
        uplink_rtnl: Rtnl = self._in(fd, Rtnl)
        try:
            # One an earlier hub of this worker left, if its namespace is still going away.
            uplink_rtnl.delete_link(peer)
            self.rtnl.add_veth(UPLINK, peer, fd)
            try:
                self.rtnl.add_address(UPLINK, uplink.address, 32)
                self.rtnl.set_up(UPLINK)
                uplink_rtnl.add_address(peer, _GATEWAY, 32, link_scope=True)
                uplink_rtnl.set_up(peer)
                uplink_rtnl.add_host_route(uplink.address, peer)
                self.rtnl.add_default_route(_GATEWAY, UPLINK)
                egress = [
                    (m.veth, m.address)
                    for m in self.machines.values()
                    if m.egress and m.veth is not None and m.address is not None
                ]
                self._rules(table(uplink.address, uplink.prefix, egress))
                # Only now, with the table deciding what crosses the hub.
                _sysctl("net/ipv4/ip_forward", "1")
            except BaseException:
                self.rtnl.delete_link(UPLINK)
                raise
        finally:
            uplink_rtnl.close()

    def _close_way_out(self, table_name: str, link: str) -> None:
        """Take one of the hub's ways out down (the uplink or the routes to the host):
        forwarding off first, so nothing crosses while it goes, then its table, then its veth
        (its peer and the route through it go with it)."""
        _sysctl("net/ipv4/ip_forward", "0")
        self._rules(drop_table(table_name))
        self.rtnl.delete_link(link)

    def _drop_uplink(self) -> None:
        if self.uplink is None:
            return
        self._close_way_out(TABLE, UPLINK)  # (its peer in the uplink goes with it)
        self.uplink = None
        _log("uplink_dropped")

    # -- routes: machines' own addresses reached from the host (and hosts beyond) -----------

    def _set_routes(self, request: dict[str, Any]) -> None:
        if request.get("prefix") is None:
            self._drop_routes()
            return
        wanted = _Routes(
            ipaddress.IPv4Address(str(request["address"])),
            ipaddress.IPv4Network(str(request["prefix"])),
        )
        if self.uplink is not None:
            raise ValueError("route_machines: not with an uplink (each is the hub's way out)")
        if wanted == self.routes and self._has_link(ROUTED):
            return  # as it is (a flyd restart): connections to machines carry on
        self._drop_routes()
        self._make_routes(wanted)
        _log("routes", prefix=str(wanted.prefix), address=str(wanted.address))

    def _make_routes(self, routes: _Routes) -> None:
        peer = "nr" + routes.address.packed.hex()  # unique among the host's workers
        host_rtnl: Rtnl = self._in(self.host_netns, Rtnl)
        try:
            host_rtnl.delete_link(peer)  # one an earlier netd of this worker left
            self.rtnl.add_veth(ROUTED, peer, self.host_netns)
            try:
                self.rtnl.add_address(ROUTED, routes.address, 32)
                self.rtnl.set_up(ROUTED)
                host_rtnl.add_address(peer, _GATEWAY, 32, link_scope=True)
                host_rtnl.set_up(peer)
                host_rtnl.add_route(routes.prefix, routes.address, peer)
                self.rtnl.add_default_route(_GATEWAY, ROUTED)
                self.routes = routes
                for m in self.machines.values():
                    m.routed = frozenset()
                self._rules(routes_table(routes.prefix))
                for m in self.machines.values():
                    self._route_services(m)
                _sysctl("net/ipv4/ip_forward", "1")  # only now, with the table deciding
            except BaseException:
                self.routes = None
                self.rtnl.delete_link(ROUTED)
                raise
        finally:
            host_rtnl.close()

    def _drop_routes(self) -> None:
        if self.routes is None:
            return
        self._close_way_out(ROUTES_TABLE, ROUTED)  # (its peer on the host goes with it)
        self.routes = None
        for m in self.machines.values():
            m.routed = frozenset()
        _log("routes_dropped")

    def _route_services(self, m: _Machine) -> None:
        """The hub forwards to the machine exactly its published services while it is up."""
        if self.routes is None or m.address is None:
            wanted: frozenset[int] = frozenset()
        else:
            wanted = frozenset(port.internal_port for port in m.ports.values())
        if wanted == m.routed:
            return
        commands = ""
        if m.routed and m.address is not None:
            commands += service_elements("delete", m.address, m.routed - wanted)
        if wanted and m.address is not None:
            commands += service_elements("add", m.address, wanted - m.routed)
        if commands:
            self._rules(commands)
        m.routed = wanted

    def _has_link(self, name: str) -> bool:
        try:
            self.rtnl.index(name)
        except OSError:
            return False
        return True

    def _down(self, m: _Machine) -> None:
        if m.watch is not None:
            m.watch.cancel()
            m.watch = None
        for port in m.ports.values():
            self._unserve(port)
        if m.diag is not None:
            m.diag.close()
            m.diag = None
        if m.egress and self.uplink is not None and m.veth is not None and m.address is not None:
            try:
                self._rules(element("delete", m.veth, m.address))
            except OSError as e:  # its veth goes with its namespace: nothing can use it after
                _log("egress_not_removed", machine=m.machine_id, error=str(e))
        m.egress = False
        if m.routed and self.routes is not None and m.address is not None:
            try:
                self._rules(service_elements("delete", m.address, m.routed))
            except OSError as e:  # its address is unreachable once its veth goes anyway
                _log("services_not_removed", machine=m.machine_id, error=str(e))
        m.routed = frozenset()
        # Not deleted here: deleting a veth waits for the kernel's network clean-up (~20 ms
        # here). The machine's namespace dies with the last descriptor of it (the machine is
        # gone), and with it the veth pair and its route: the kernel does that on its own time.
        for fd in (m.netns, m.userns):
            if fd is not None:
                os.close(fd)
        m.netns = m.userns = None
        m.veth = m.address = None

    async def _close_port(self, port: _Port) -> None:
        if port.server is not None:
            port.server.close()  # closes the listening socket
            port.server = None
        else:
            port.sock.close()

    # -- serving: a published port listens exactly while the machine's service does ----------

    def _watch(self, m: _Machine) -> None:
        """Make sure something waits for the machine's services to listen, if any does not."""
        if m.netns is None or m.diag is None or (m.watch is not None and not m.watch.done()):
            return
        if all(port.server is not None for port in m.ports.values()):
            return
        m.watch = asyncio.ensure_future(self._until_serving(m))
        m.watch.add_done_callback(_retrieve)

    async def _until_serving(self, m: _Machine) -> None:
        """Poll the machine's namespace (sock_diag, nothing connects) until every published
        port's service listens, serving each as it does: every 10 ms for the first 5 s (an
        app booting), then less often for a service that does not come.
        """
        loop = asyncio.get_running_loop()
        started = loop.time()
        while m.diag is not None:
            waiting = [port for port in m.ports.values() if port.server is None]
            if not waiting:
                return
            listening = m.diag.listening()
            for port in waiting:
                if port.internal_port in listening:
                    await self._serve(m, port)
            age = loop.time() - started
            await asyncio.sleep(0.01 if age < 5 else 0.1 if age < 60 else 1.0)

    async def _serve(self, m: _Machine, port: _Port) -> None:
        if port.server is None:
            # listen() checks the port again, TIME_WAITs of earlier connections included:
            # SO_REUSEADDR lets it; once it listens, no other socket can bind the port anyway.
            port.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            port.server = await asyncio.get_running_loop().create_server(
                functools.partial(self._accepted, m, port), sock=port.sock, backlog=1024
            )

    def _accepted(self, m: _Machine, port: _Port) -> asyncio.Protocol:
        """A connection on one of the machine's published ports: forwarded into its namespace
        while it is up; when the service is found gone, the port stops listening until it
        is back."""

        def gone() -> None:
            self._unserve(port)
            self._watch(m)

        return self.forwarder.accepted(
            m.machine_id, lambda: m.netns, port.internal_port, gone, machines=len(self.machines)
        )

    def _unserve(self, port: _Port) -> None:
        """Stop listening, keeping the port: connections are refused, as by a host whose
        service is down, and nobody else can bind it.
        """
        if port.server is None:
            return
        address = port.sock.getsockname()
        port.server.close()
        port.server = None
        try:
            port.sock = self._in(self.host_netns, lambda: _bind_held(address))
        except OSError as e:
            _log("port_lost", port=port.host_port, error=str(e))


def _set_up_netns() -> None:
    """Ready the network namespace the calling thread is in for a machine: loopback up, IPv6
    off, any port bindable by any of its users (as on a host of its own)."""
    with Rtnl() as rtnl:
        rtnl.set_up("lo")
    _sysctl("net/ipv4/ip_unprivileged_port_start", "0")
    _sysctl("net/ipv6/conf/default/disable_ipv6", "1")


def _bind_held(address: tuple[str, int]) -> socket.socket:
    """A socket bound to `address`, not listening: it refuses connections and, without
    SO_REUSEADDR once bound, keeps anyone else from binding the port.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # over TIME_WAITs
        sock.bind(address)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 0)
    except OSError:
        sock.close()
        raise
    return sock


def _retrieve(task: asyncio.Future[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        _log("forward_failed", error=repr(task.exception()))


async def _serve(control: socket.socket, netd: Netd, stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    clients: set[socket.socket] = set()

    def on_client() -> None:
        try:
            conn, _ = control.accept()
        except BlockingIOError:
            return
        conn.setblocking(False)
        clients.add(conn)
        loop.add_reader(conn, lambda: asyncio.ensure_future(on_request(conn)))

    busy: set[socket.socket] = set()

    async def on_request(conn: socket.socket) -> None:
        if conn in busy:
            return
        busy.add(conn)
        try:
            try:
                data, ancdata, _flags, _ = conn.recvmsg(
                    MAX_MESSAGE, socket.CMSG_SPACE(_MAX_FDS * 4)
                )
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:
                loop.remove_reader(conn)
                clients.discard(conn)
                conn.close()
                return
            fds: list[int] = []
            for level, kind, payload in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    usable = len(payload) - len(payload) % 4
                    fds.extend(
                        int.from_bytes(payload[i : i + 4], "little") for i in range(0, usable, 4)
                    )
            ident: object = None
            try:
                request = json.loads(data)
                if not isinstance(request, dict):
                    raise ValueError("a request is a JSON object")
                ident = request.get("id")
                answer: dict[str, Any] = {"ok": await netd.handle(request, fds)}
            except Exception as e:
                _log("request_failed", request=data[:200].decode("utf-8", "replace"), error=repr(e))
                answer = {"error": f"{type(e).__name__}: {e}"}
            finally:
                for fd in fds:
                    os.close(fd)
            if ident is not None:
                answer["id"] = ident  # which request this answers (see netclient.Netd.submit)
            with contextlib.suppress(OSError):
                conn.setblocking(True)
                conn.send(json.dumps(answer).encode())
                conn.setblocking(False)
        finally:
            busy.discard(conn)

    control.setblocking(False)
    loop.add_reader(control, on_client)
    await stop.wait()
    loop.remove_reader(control)
    for conn in clients:
        loop.remove_reader(conn)
        conn.close()


def _write_handle(path: str) -> None:
    """Who this netd is, so whoever tears the worker down can end it (and only it)."""
    # A `flyd.drivers.base.Handle`, written without importing it (that would pull in flyd's
    # runtime, and netd starts in a tenth of the time without it).
    with open("/proc/self/stat", "rb") as f:
        stat = f.read()
    start_time = int(stat[stat.rindex(b")") + 2 :].split()[19])
    with open("/proc/sys/kernel/random/boot_id") as f:
        boot_id = f.read().strip()
    with open(path + ".tmp", "w") as f:
        f.write(json.dumps({"pid": os.getpid(), "start_time": start_time, "boot_id": boot_id}))
    os.replace(path + ".tmp", path)


def _hub() -> tuple[int, int, Rtnl]:
    """Enter a new network namespace, the hub, and make it ready; descriptors of the host's
    namespace and the hub's, and a netlink socket in the hub.
    """
    host = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    namespaces.unshare(namespaces.CLONE_NEWNET)
    fd = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    rtnl = Rtnl()
    rtnl.set_up("lo")
    _sysctl("net/ipv6/conf/default/disable_ipv6", "1")
    _sysctl("net/ipv4/ip_forward", "0")  # the default; said out loud: machines reach no one
    return host, fd, rtnl


UNIX_PATH_MAX = 107  # sun_path holds 108 bytes, the last a NUL


@contextlib.contextmanager
def unix_address(path: str) -> Iterator[str]:
    """`path` as a unix socket address. A deep data dir (a test's tmp dir, a long checkout)
    gives a path longer than sun_path holds; such a path is named through a descriptor of its
    directory (`/proc/self/fd/N/NAME`), which the kernel resolves like the directory itself."""
    if len(os.fsencode(path)) <= UNIX_PATH_MAX:
        yield path
        return
    directory, name = os.path.split(path)
    fd = os.open(directory, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield f"/proc/self/fd/{fd}/{name}"
    finally:
        os.close(fd)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flyd.drivers.netd", description=__doc__)
    parser.add_argument("--socket", required=True, help="the control socket to listen on")
    parser.add_argument("--ready-fd", type=int, help="write one byte here once listening")
    parser.add_argument("--handle", help="write netd's process handle (JSON) here first")
    args = parser.parse_args(argv)
    os.umask(0o077)
    nofile = raise_nofile()
    host_netns, hub_netns, rtnl = _hub()
    netd = Netd(host_netns, hub_netns, rtnl, nofile=nofile)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(args.socket)
    control = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    with unix_address(args.socket) as address:
        control.bind(address)
    control.listen(16)
    if args.handle:
        _write_handle(args.handle)
    _log("ready", pid=netd.pid, socket=args.socket, nofile=nofile)
    if args.ready_fd is not None:
        os.write(args.ready_fd, b"1")
        os.close(args.ready_fd)

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await _serve(control, netd, stop)

    asyncio.run(run())
    _log("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
