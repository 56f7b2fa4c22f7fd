"""Per-caller caps on long calls: one caller holding too many at once gets RESOURCE_EXHAUSTED.

A followed stream (a machine's log, a registry feed) or a long wait costs its server a task, a
queue or a poll for as long as the caller keeps it open, and nothing else bounds how many one
caller opens: a stolen certificate, or a token in a loop, could hold the server's memory and
descriptors. `CallerCaps` counts the calls each caller has open, by kind, and refuses one more
than `limit` with RESOURCE_EXHAUSTED naming the kind, the cap, the setting that raises it and
the caller, with an ErrorInfo (reason `STREAM_CAP`, metadata `kind`, `caller`, `limit`). The
calls already open go on; the next one fits again once one ends.

Who a caller is, is the service's to say (flyd: the certificate's name; flaps: the token's id);
`peer_host` names a caller the server cannot identify by its address's host, so every
connection from one host shares one count.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import grpc
from google.rpc import error_details_pb2

from runtime.endpoints import cluster_peer
from runtime.status import abort_with_details

__all__ = ["STREAM_CAP", "CallerCaps", "caller_name", "peer_host"]

STREAM_CAP = "STREAM_CAP"
"""The ErrorInfo reason of a refusal for too many open calls."""


class CallerCaps:
    """At most `limit` open calls of each kind per caller; `setting` names what raises it, and
    `domain` is the service's ErrorInfo domain."""

    def __init__(self, *, limit: int, setting: str, domain: str) -> None:
        if limit <= 0:
            raise ValueError("limit must be positive")
        self.limit = limit
        self.setting = setting
        self.domain = domain
        self._open: dict[tuple[str, str], int] = {}

    def open(self, kind: str, caller: str) -> int:
        """How many calls of `kind` the caller has open."""
        return self._open.get((kind, caller), 0)

    def holding(self, kind: str) -> dict[str, int]:
        """The callers with calls of `kind` open, and how many each."""
        return {caller: n for (k, caller), n in self._open.items() if k == kind}

    @contextlib.asynccontextmanager
    async def hold(self, context: Any, kind: str, caller: str) -> AsyncIterator[None]:
        """Count one open call of `kind` by `caller` while the block runs; abort the call with
        RESOURCE_EXHAUSTED instead when the caller already has `limit` of them open."""
        key = (kind, caller)
        count = self._open.get(key, 0)
        if count >= self.limit:
            await abort_with_details(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{caller} has {count} {kind} open, the most one caller may ({self.setting} "
                f"{self.limit}); end one first",
                error_details_pb2.ErrorInfo(
                    reason=STREAM_CAP,
                    domain=self.domain,
                    metadata={"kind": kind, "caller": caller, "limit": str(self.limit)},
                ),
            )
        self._open[key] = count + 1
        try:
            yield
        finally:
            left = self._open[key] - 1
            if left:
                self._open[key] = left
            else:
                del self._open[key]


def peer_host(context: Any) -> str:
    """The host part of the caller's address (`ipv4:127.0.0.1:5000` -> `127.0.0.1`); for a
    unix socket, the socket (`unix:/run/x.sock`)."""
    peer = str(context.peer() or "")
    scheme, _, rest = peer.partition(":")
    if scheme in ("ipv4", "ipv6"):
        host = rest.rpartition(":")[0]
        return host.strip("[]") or rest
    return peer or "an unknown caller"


def caller_name(context: Any) -> str:
    """Who calls, as a cap counts them: `certificate NAME` for a cluster part that presented
    one (mutual TLS), else `host HOST` (`peer_host`)."""
    name = cluster_peer(context)
    if name is not None:
        return f"certificate {name!r}"
    return f"host {peer_host(context)}"
