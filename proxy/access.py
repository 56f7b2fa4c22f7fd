"""Which part of the cluster may call which RPC of the edge's admin API (runtime.access;
default deny).

Reading how the edge routes (its routes, its counters) is for the console's pages and the
operator. Draining a worker moves every app's traffic off it: a fleet operation, the
operator's alone (a console or a stolen part's certificate draining every worker would take
every app down). The replica the proxy serves beside it has the registry's table
(registry.access).
"""

from __future__ import annotations

from proxy.v1 import proxy_pb2
from runtime.access import allow, table
from runtime.pki import OPERATOR

__all__ = ["PROXY_ACCESS"]

PROXY_ACCESS = table(
    proxy_pb2.DESCRIPTOR.services_by_name["ProxyService"],
    {
        "ListRoutes": allow("console", OPERATOR),
        "GetStats": allow("console", OPERATOR),
        "DrainWorker": allow(OPERATOR),
    },
)
"""Every RPC of proxy.v1.ProxyService, and the roles that may call it."""
