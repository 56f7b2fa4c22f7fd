"""Which part of the cluster may call which RPC of a replica (runtime.access; default deny).

The same table holds wherever a replica is served: the standalone registry, the proxy's gRPC
port and flaps' cluster port (`registry.service.serve_replica`).

An announcement says where a worker is: whoever may announce a worker may send every replica
that follows it to any address (and the edge's traffic with it). So a worker announces only
itself: the worker id of the announcement must be the one its certificate is named for
(`flyd-<worker id>`). A replica that follows an upstream one (a standalone registry, or a
flaps following a registry) passes on the announcements it accepted, under its own
certificate (`Replica._forward_announce`): those two roles may announce any worker, and what
they pass on was checked by this same table when the worker announced itself to them. No
other part announces anything: not the proxy, the edge, whose certificate is the one most
exposed; a proxy that follows an upstream hears of workers from it.

Reading a replica (its members, its stream of rows, a slot's members) is for the parts that
run one of their own or fence with it: replicas merge each other's members and follow an
upstream's stream (flaps, the proxy, the registry, the console), and a returning worker asks
who else is in its slots (`ListSlot`).
"""

from __future__ import annotations

from typing import Any

from registry.v1 import registry_pb2
from runtime.access import allow, table
from runtime.pki import Identity

__all__ = ["REGISTRY_ACCESS", "announces_itself"]

_REPLICAS = ("flaps", "proxy", "registry", "console")


def announces_itself(caller: Identity, request: Any) -> str | None:
    """A worker's certificate announces the worker it is named for, and nothing else."""
    if caller.role != "flyd":
        return None  # a relay: what it passes on, it accepted from the worker
    announced = request.worker.id
    if caller.worker_id is None or announced != caller.worker_id:
        mine = caller.worker_id or "none"
        return f"a worker announces only itself (worker {announced!r}; this one is {mine!r})"
    return None


REGISTRY_ACCESS = table(
    registry_pb2.DESCRIPTOR.services_by_name["RegistryService"],
    {
        "Announce": allow("flyd", "registry", "flaps", when=announces_itself),
        "ListMembers": allow(*_REPLICAS),
        "Follow": allow(*_REPLICAS),
        "ListSlot": allow("flyd"),
    },
)
"""Every RPC of registry.v1.RegistryService, and the roles that may call it."""
