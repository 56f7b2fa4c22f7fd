"""The hub's egress rules (nftables), and libnftables to load them.

A worker with an uplink (`flyd --egress-via`) has netd join its hub to the uplink namespace
by a veth, `UPLINK` in the hub; what may cross it is this table, in the hub alone:

- `input`: the hub itself answers no one (machines, the uplink), only its own loopback;
- `forward`: a packet goes out to the uplink only from an egress machine: its veth and its own
  address, both (the set `egress`: a machine cannot borrow another's address), and never to
  the worker's own prefix; from the uplink only the replies of those flows come back. Nothing
  else crosses the hub: machine to machine, uplink to machine, are dropped (policy drop);
- `postrouting`: what leaves for the uplink is SNATed to the hub's uplink address, so no
  machine's address is ever seen beyond the hub.

A machine's egress is one element of the set, added when it comes up and removed when it goes
down: a start or a stop costs the same however many machines there are. The whole table is
written (atomically: one nft transaction) only when the uplink is made.

libnftables (Debian's libnftables1, which the `nftables` package brings) is called through
ctypes: a command takes ~0.1 ms, where running `nft` takes ~10 ms and a process of its own.
"""

from __future__ import annotations

import ctypes
import ipaddress
from collections.abc import Iterable
from typing import Any

__all__ = [
    "ROUTED",
    "ROUTES_TABLE",
    "TABLE",
    "UPLINK",
    "Nft",
    "drop_table",
    "element",
    "routes_table",
    "service_elements",
    "table",
]

TABLE = "nonomad"
UPLINK = "up0"
"""The hub's end of the uplink veth."""
ROUTES_TABLE = "nonomad_routes"
ROUTED = "rt0"
"""The hub's end of the veth to the host's namespace (flyd --route-machines)."""


class Nft:
    """A libnftables context; its commands act on the network namespace the calling thread
    is in (netlink sockets are opened per command batch there)."""

    def __init__(self) -> None:
        try:
            lib: Any = ctypes.CDLL("libnftables.so.1", use_errno=True)
        except OSError as e:
            raise OSError(
                f"libnftables is missing ({e}): egress needs Debian's nftables package"
            ) from None
        lib.nft_ctx_new.restype = ctypes.c_void_p
        lib.nft_ctx_new.argtypes = [ctypes.c_uint32]
        lib.nft_ctx_free.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_buffer_output.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_buffer_error.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_get_error_buffer.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_get_error_buffer.restype = ctypes.c_char_p
        lib.nft_run_cmd_from_buffer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        ctx = lib.nft_ctx_new(0)
        if not ctx:
            raise OSError("libnftables: cannot make a context")
        # Its output and errors go to buffers, not netd's stdout and stderr.
        lib.nft_ctx_buffer_output(ctx)
        lib.nft_ctx_buffer_error(ctx)
        self._lib, self._ctx = lib, ctx

    def run(self, commands: str) -> None:
        """Run `commands` (nft's syntax) as one transaction: all of them, or none and OSError
        with what nft said."""
        if self._lib.nft_run_cmd_from_buffer(self._ctx, commands.encode()) != 0:
            error = self._lib.nft_ctx_get_error_buffer(self._ctx) or b""
            raise OSError(f"nft: {error.decode(errors='replace').strip()}")

    def close(self) -> None:
        if self._ctx:
            self._lib.nft_ctx_free(self._ctx)
            self._ctx = None


def table(
    address: ipaddress.IPv4Address,
    prefix: ipaddress.IPv4Network,
    machines: Iterable[tuple[str, str]] = (),
) -> str:
    """The hub's table, replacing any it had, with `machines` (veth, address) given egress;
    `address` is the hub's on the uplink, `prefix` the worker's."""
    rules = _hub_table(
        TABLE,
        f"""\
  set egress {{ type ifname . ipv4_addr; }}
  chain forward {{
    type filter hook forward priority filter; policy drop;
    iifname "{UPLINK}" oifname != "{UPLINK}" ct state established,related accept
    iifname . ip saddr @egress oifname "{UPLINK}" ip daddr != {prefix} accept
  }}
  chain postrouting {{
    type nat hook postrouting priority srcnat; policy accept;
    oifname "{UPLINK}" snat to {address}
  }}
""",
    )
    return rules + "".join(element("add", veth, a) for veth, a in machines)


def element(op: str, veth: str, address: str) -> str:
    """The command that adds (`op` "add") or deletes ("delete") one machine's egress."""
    assert op in ("add", "delete")
    assert veth.isalnum()  # netd's own names (`v1a`): nothing to quote
    return f'{op} element ip {TABLE} egress {{ "{veth}" . {ipaddress.IPv4Address(address)} }}\n'


def routes_table(prefix: ipaddress.IPv4Network) -> str:
    """The hub's table when it routes machines' addresses to the host (`ROUTED`), replacing
    any it had: from the host only TCP to a machine's published service (the set `services`,
    address . port) crosses, and from a machine only the replies of those flows: a machine
    still starts nothing, and no machine reaches another. The hub itself answers no one."""
    return _hub_table(
        ROUTES_TABLE,
        f"""\
  set services {{ type ipv4_addr . inet_service; }}
  chain forward {{
    type filter hook forward priority filter; policy drop;
    iifname "{ROUTED}" ip daddr {prefix} ip daddr . tcp dport @services accept
    oifname "{ROUTED}" ct state established,related accept
  }}
""",
    )


def drop_table(name: str) -> str:
    """The commands that delete the hub's table `name`, whether it has one or not."""
    return f"table ip {name}\ndelete table ip {name}\n"


def _hub_table(name: str, body: str) -> str:
    """The hub's table `name` with `body` (its sets and chains), replacing any it had, and an
    input chain by which the hub itself answers no one (but its own loopback)."""
    return f"""\
{drop_table(name)}table ip {name} {{
{body}  chain input {{
    type filter hook input priority filter; policy drop;
    iifname "lo" accept
  }}
}}
"""


def service_elements(op: str, address: str, ports: Iterable[int]) -> str:
    """The commands that add (`op` "add") or delete ("delete") a machine's services."""
    assert op in ("add", "delete")
    a = ipaddress.IPv4Address(address)
    return "".join(
        f"{op} element ip {ROUTES_TABLE} services {{ {a} . {int(port)} }}\n"
        for port in sorted(ports)
    )
