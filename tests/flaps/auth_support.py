"""flaps in-process as flaps.main wires it, guarded by flaps.auth, over TLS with a cluster port
(the fixture `flaps`), and the table of a harmless request for every RPC (`CALLS`): what
test_auth.py and test_scope.py stand on."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from flaps import auth, placement
from flaps.auth import Authorizer, TokenVerifier
from flaps.errors import map_error
from flaps.service import Exchange, MachinesServicer, PlatformServicer, Workers
from flaps.v1 import machines_pb2 as m
from flaps.v1 import machines_pb2_grpc, platform_pb2, platform_pb2_grpc, tokens_pb2, tokens_pb2_grpc
from flaps.verify import TOKEN_ACCESS, TokenServicer
from flyd.v1 import machine_pb2 as pb
from model.tokens import Keyring, new_key_line
from nonomad.security import ClusterSecurity
from registry.replica import Replica
from registry.service import serve_replica
from registry.v1 import registry_pb2_grpc
from runtime import Service, ServiceSettings, access
from runtime.pki import ClusterMembers
from tests.flaps.support import FakeFleet, fake_fleet
from tests.flyd.support import config
from tests.harness import channel
from tests.servicers import T, seconds, serving

DENIED = grpc.StatusCode.PERMISSION_DENIED
KEY = new_key_line("k1")


@dataclass
class Flaps:
    """flaps in-process: its addresses, the fleet behind it, machines A (app a) and B (b)."""

    address: str
    cluster_address: str
    fleet: FakeFleet
    security: ClusterSecurity
    keyring: list[Keyring]  # [the keys flaps verifies with]: a test may rotate them
    revoked: list[frozenset[str]]  # [the ids flaps refuses]: a test may revoke tokens
    replica: Replica  # flaps' own replica (the one its registry service serves)
    a: str = ""
    b: str = ""

    def mint(self, *texts: str, keys: str = KEY) -> str:
        return Keyring.parse(keys).mint(texts)

    def stub(self, cls: Any, token: str | None) -> Any:
        return cls(channel(self.address, self.security.client_tls(), token))


@pytest.fixture
async def flaps(tmp_path: Path, security: ClusterSecurity) -> AsyncIterator[Flaps]:
    async with fake_fleet(tmp_path, {"w1": "ams", "w2": "ams"}) as fleet:
        workers = Workers(fleet.replica)
        exchange = Exchange(fleet.replica, workers, placement.Pipeline())
        keyring = [Keyring.parse(KEY)]
        revoked: list[frozenset[str]] = [frozenset()]
        tokens = TokenVerifier(lambda: keyring[0], lambda: revoked[0])
        authorizer = Authorizer(tokens, exchange.app_of, ClusterMembers(security.ca))
        cert = security.cert("flaps")
        service = Service(
            "flaps",
            ServiceSettings(
                tls_cert=cert.cert,
                tls_key=cert.key,
                cluster_ca=security.ca,
                cluster_listen="127.0.0.1:0",
                grace_period=1,
            ),
        )
        for servicer, add, descriptor in (
            (
                MachinesServicer(exchange),
                machines_pb2_grpc.add_MachinesServiceServicer_to_server,
                m.DESCRIPTOR.services_by_name["MachinesService"],
            ),
            (
                PlatformServicer(exchange),
                platform_pb2_grpc.add_PlatformServiceServicer_to_server,
                platform_pb2.DESCRIPTOR.services_by_name["PlatformService"],
            ),
        ):
            auth.guard(servicer, descriptor, authorizer)
            service.add(servicer, add, descriptor, map_error)
        # Its own replica, knowing a worker: a Follow call has a snapshot to answer with.
        replica = Replica()
        replica.add_worker(fleet.workers["w1"].worker.info())
        serve_replica(service, replica, [])
        access.add(
            service,
            TOKEN_ACCESS,
            TokenServicer(tokens),
            tokens_pb2_grpc.add_TokenServiceServicer_to_server,
            tokens_pb2.DESCRIPTOR.services_by_name["TokenService"],
            map_error,
        )
        async with serving(service) as address:
            assert service.cluster_address is not None
            f = Flaps(address, service.cluster_address, fleet, security, keyring, revoked, replica)
            admin = f.stub(machines_pb2_grpc.MachinesServiceStub, f.mint())
            for app in ("a", "b"):
                request = m.CreateMachineRequest(app=app, region="ams", config=config())
                made = await admin.CreateMachine(request, timeout=T)
                setattr(f, app, made.machine.id)
                await fleet.seen(made.machine.id)
            yield f
        await workers.close()


# -- the table: every RPC, a harmless request on app a's or app b's machine ----------------------

Call = tuple[str, str, Callable[[str, str], Any]]  # (service, rpc, request(machine id, app))
MACHINES, PLATFORM, REGISTRY, TOKENS = "machines", "platform", "registry", "tokens"
BAD_SIGNAL = "SIGNOPE"

CALLS: list[Call] = [
    (MACHINES, "CreateMachine", lambda mid, app: m.CreateMachineRequest(
        app=app, region="ams", config=config(memory=-1))),
    (MACHINES, "GetMachine", lambda mid, app: m.GetMachineRequest(machine_id=mid)),
    (MACHINES, "ListMachines", lambda mid, app: m.ListMachinesRequest(app=app)),
    (MACHINES, "UpdateMachine", lambda mid, app: m.UpdateMachineRequest(
        machine_id=mid, config=config(memory=-1))),
    (MACHINES, "StartMachine", lambda mid, app: m.StartMachineRequest(machine_id=mid)),
    (MACHINES, "StopMachine", lambda mid, app: m.StopMachineRequest(
        machine_id=mid, signal=BAD_SIGNAL)),
    (MACHINES, "RestartMachine", lambda mid, app: m.RestartMachineRequest(
        machine_id=mid, signal=BAD_SIGNAL)),
    (MACHINES, "SignalMachine", lambda mid, app: m.SignalMachineRequest(
        machine_id=mid, signal=BAD_SIGNAL)),
    (MACHINES, "DestroyMachine", lambda mid, app: m.DestroyMachineRequest(machine_id=mid)),
    (MACHINES, "WaitMachine", lambda mid, app: m.WaitMachineRequest(
        machine_id=mid, state=pb.MACHINE_STATE_STARTED, timeout=seconds(1))),
    (MACHINES, "AcquireLease", lambda mid, app: m.AcquireLeaseRequest(
        machine_id=mid, ttl=seconds(-1))),
    (MACHINES, "ReleaseLease", lambda mid, app: m.ReleaseLeaseRequest(
        machine_id=mid, nonce="not-the-nonce")),
    (MACHINES, "ListMachineEvents", lambda mid, app: m.ListMachineEventsRequest(machine_id=mid)),
    (MACHINES, "GetMachineLogs", lambda mid, app: m.GetMachineLogsRequest(machine_id=mid)),
    # The primary named is another object the call names: here the machine itself.
    (MACHINES, "SupersedeMachine", lambda mid, app: m.SupersedeMachineRequest(
        machine_id=mid, generation=0, primary=mid)),
    (MACHINES, "GetPlacement", lambda mid, app: m.GetPlacementRequest(machine_id=mid)),
    (PLATFORM, "ListRegions", lambda mid, app: platform_pb2.ListRegionsRequest()),
    (PLATFORM, "ListWorkers", lambda mid, app: platform_pb2.ListWorkersRequest()),
    (PLATFORM, "SimulatePlacement", lambda mid, app: platform_pb2.SimulatePlacementRequest(
        app=app, region="ams", config=config())),
    (PLATFORM, "WatchPlacements", lambda mid, app: platform_pb2.WatchPlacementsRequest()),
    (PLATFORM, "CordonWorker", lambda mid, app: platform_pb2.CordonWorkerRequest(
        worker_id="no-such-worker", cordoned=True)),
]  # fmt: skip
STUBS: dict[str, Any] = {
    MACHINES: machines_pb2_grpc.MachinesServiceStub,
    PLATFORM: platform_pb2_grpc.PlatformServiceStub,
    REGISTRY: registry_pb2_grpc.RegistryServiceStub,
    TOKENS: tokens_pb2_grpc.TokenServiceStub,
}
