"""Which part of the cluster may call which RPC of a worker (runtime.access; default deny).

flaps is the one that changes machines: every machine operation, secrets included, reaches a
worker through it, after it checked the caller's token. So only flaps' certificate creates,
updates, starts, stops or destroys a machine here, and only it reads a machine's secrets
(RevealSecrets, copying them to a new machine of the app) or keeps one through an update
(`UpdateMachine` with a `<redacted>` value keeps the stored secret: a flaps-only path, since
nobody else may call UpdateMachine at all). The others read what they need and nothing more:

- every replica (flaps', the proxy's, the registry, the console's when it follows workers
  itself) follows a worker: `WatchEvents`, and `GetCapacity` to learn who is at an address;
- another worker, fencing a returning copy, reads the row of a member of its slot:
  `GetMachine` (flyd.fencing.GrpcPeers);
- the operator's CLI reads each worker's capacity (`nonomad status`): `GetCapacity`.

A machine's logs, events, leases and placement go through flaps too, where the token of
whoever asks is checked against the machine's app.
"""

from __future__ import annotations

from flyd.v1 import worker_pb2
from runtime.access import allow, table
from runtime.pki import OPERATOR

__all__ = ["WORKER_ACCESS"]

_FLAPS = allow("flaps")
_REPLICAS = ("flaps", "proxy", "registry", "console")

WORKER_ACCESS = table(
    worker_pb2.DESCRIPTOR.services_by_name["WorkerService"],
    {
        "CreateMachine": _FLAPS,
        "StartMachine": _FLAPS,
        "StopMachine": _FLAPS,
        "RestartMachine": _FLAPS,
        "SignalMachine": _FLAPS,
        "DestroyMachine": _FLAPS,
        "UpdateMachine": _FLAPS,
        "SupersedeMachine": _FLAPS,
        "AcquireLease": _FLAPS,
        "ReleaseLease": _FLAPS,
        "CordonWorker": _FLAPS,
        "RevealSecrets": _FLAPS,
        "GetMachine": allow("flaps", "flyd"),
        "ListMachines": _FLAPS,
        "WaitMachine": _FLAPS,
        "ListMachineEvents": _FLAPS,
        "GetMachineLogs": _FLAPS,
        "GetPlacement": _FLAPS,
        "GetCapacity": allow(*_REPLICAS, OPERATOR),
        "WatchEvents": allow(*_REPLICAS),
    },
)
"""Every RPC of flyd.v1.WorkerService, and the roles that may call it."""
