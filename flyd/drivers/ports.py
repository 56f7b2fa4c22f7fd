"""Host ports held for machines' published services.

A published port is never a guess: a port is "free" only when binding it succeeds, and the
bound socket is then kept (bound, not listening: a connection to it is refused; SO_REUSEADDR
cleared once bound, so no other socket can bind the port) until its machine is destroyed or
hands it on. `HeldPorts` keeps these sockets per machine; the
drivers decide what happens to them (the process driver lets its machine bind the port while
it runs and takes it back when it stops; the OCI driver hands them to netd, which forwards
them into the machine's namespace).
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
from collections.abc import Iterable

from model.errors import ResourceExhausted

__all__ = ["HeldPorts", "bind_address", "bind_port", "local_address"]


def bind_address(host: str) -> str:
    """Where the process driver holds a port published on `host`: a loopback host as it is
    (a single-host cluster's), any other on every address of the host, because its machine
    is a host process that binds the port itself, most often on 0.0.0.0: the port is free for
    it only when it is free on all of them. (The OCI driver binds `host` alone: netd, not the
    machine, listens there.)"""
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name: never a loopback the worker was told to advertise
        loopback = host == "localhost"
    return host if loopback else "0.0.0.0"


def local_address(host: str) -> str | None:
    """`host` (an IPv4 address, or a name, resolved here) as an address of this host, or None
    when it is not one: binding it fails (nothing is sent anywhere)."""
    try:
        address = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
    except (OSError, IndexError):
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as sock:
        try:
            sock.bind((address, 0))
        except OSError:
            return None
    return str(address)


def bind_port(host: str, port: int) -> socket.socket | None:
    """A socket bound to host:port, not listening, or None when the port is taken there.

    SO_REUSEADDR is set only for the bind, over connections of an earlier holder still in
    TIME_WAIT; cleared, it keeps any other socket from binding the port.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 0)
    except OSError:
        sock.close()
        return None
    return sock


class HeldPorts:
    """The bound (not listening) sockets this flyd holds, by machine and host port."""

    def __init__(self) -> None:
        self._held: dict[str, dict[int, socket.socket]] = {}

    def take(self, machine_id: str, host: str, candidates: Iterable[int], count: int) -> list[int]:
        """Bind `count` more ports on `host` for the machine, the first of `candidates` that
        are free there.

        Raises ResourceExhausted (resource "ports") when not enough are, holding none of them.
        """
        taken: list[int] = []
        held = self._held.setdefault(machine_id, {})
        if count > 0:
            for port in candidates:
                if port in held:
                    continue
                sock = bind_port(host, port)
                if sock is None:
                    continue
                held[port] = sock
                taken.append(port)
                if len(taken) == count:
                    return taken
            for port in taken:
                held.pop(port).close()
            raise ResourceExhausted("ports", f"no free host port among the {count} needed")
        return taken

    def keep(self, machine_id: str, host: str, ports: Iterable[int]) -> list[int]:
        """Hold exactly `ports` for the machine: bind those not held, close the others.

        Returns the ports that could not be bound (something else has them).
        """
        wanted = set(ports)
        held = self._held.setdefault(machine_id, {})
        for port in [p for p in held if p not in wanted]:
            held.pop(port).close()
        lost = []
        for port in sorted(wanted - held.keys()):
            sock = bind_port(host, port)
            if sock is None:
                lost.append(port)
            else:
                held[port] = sock
        return lost

    def holds(self, machine_id: str) -> list[int]:
        """The ports held for the machine."""
        return sorted(self._held.get(machine_id, ()))

    def hand_over(self, machine_id: str, port: int) -> socket.socket | None:
        """Stop holding the port and return its socket (the caller owns it now)."""
        return self._held.get(machine_id, {}).pop(port, None)

    def release(self, machine_id: str, ports: Iterable[int] | None = None) -> None:
        """Close the machine's held sockets (all of them when `ports` is None)."""
        held = self._held.get(machine_id, {})
        for port in list(held) if ports is None else list(ports):
            sock = held.pop(port, None)
            if sock is not None:
                sock.close()
        if not held:
            self._held.pop(machine_id, None)

    def close(self) -> None:
        """Close every held socket."""
        for machine_id in list(self._held):
            with contextlib.suppress(OSError):
                self.release(machine_id)
