"""Who may call what between the parts: every RPC of every service has a row in its table
(runtime.access), and each role gets exactly its rows, over real mutual TLS.

The worker, the replica and the edge's admin API are served in-process as their mains serve
them (`access.add` over TLS), on fakes (flyd's Worker on the fake driver, a Replica, the
Router over fakes), with the server certificate of their part. Every certificate of the
session's CA then calls every RPC with a request that is harmless when allowed: what is
checked is whether the call got past its role, not what it did. flaps' own cluster port
(PEER_ACCESS, TOKEN_ACCESS) is tests/flaps/test_auth.py's.

Then the attacks of issue 27 that a stolen part's certificate made, each refused and
nothing changed: a secret printed through a worker's UpdateMachine (2), another worker's
address announced (3), every worker drained at the edge (7).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf.descriptor import ServiceDescriptor

from flaps.auth import PEER_ACCESS
from flaps.v1 import machines_pb2, platform_pb2, tokens_pb2
from flaps.verify import TOKEN_ACCESS
from flyd.access import WORKER_ACCESS
from flyd.fakes import FakeHost
from flyd.secrets import SecretBox
from flyd.service import LIMITS, WorkerServicer
from flyd.service import map_error as flyd_errors
from flyd.store import MemoryMachineLog
from flyd.v1 import machine_pb2 as pb
from flyd.v1 import worker_pb2 as w
from flyd.v1 import worker_pb2_grpc
from nonomad.security import ClusterSecurity
from proxy.access import PROXY_ACCESS
from proxy.service import ProxyServicer
from proxy.service import map_error as proxy_errors
from proxy.v1 import proxy_pb2 as p
from proxy.v1 import proxy_pb2_grpc
from registry.access import REGISTRY_ACCESS
from registry.replica import Replica
from registry.service import RegistryServicer
from registry.service import map_error as registry_errors
from registry.v1 import registry_pb2 as r
from registry.v1 import registry_pb2_grpc
from runtime import CLUSTER_NAME, ChannelTLS, Service, ServiceSettings, access
from runtime.clock import ManualClock
from runtime.pki import ClusterCA, part_role
from tests.flyd.support import boot, config, image_cache, image_source
from tests.harness import channel, error_info
from tests.proxy.support import fleet, machine, world
from tests.roles import legacy_certificate
from tests.servicers import T, serving

DENIED = grpc.StatusCode.PERMISSION_DENIED
SECRET = "s3cret-value-of-attack-2"

# -- every RPC has a row -------------------------------------------------------------------------

TABLES: list[tuple[ServiceDescriptor, access.Table]] = [
    (w.DESCRIPTOR.services_by_name["WorkerService"], WORKER_ACCESS),
    (r.DESCRIPTOR.services_by_name["RegistryService"], REGISTRY_ACCESS),
    (p.DESCRIPTOR.services_by_name["ProxyService"], PROXY_ACCESS),
    (machines_pb2.DESCRIPTOR.services_by_name["MachinesService"], PEER_ACCESS),
    (platform_pb2.DESCRIPTOR.services_by_name["PlatformService"], PEER_ACCESS),
    (tokens_pb2.DESCRIPTOR.services_by_name["TokenService"], TOKEN_ACCESS),
]


def test_every_rpc_of_every_service_has_a_row_in_its_table() -> None:
    from tests.contract import SERVICES

    assert {s.full_name for s, _ in TABLES} == {s.full_name for s in SERVICES}
    for service, rows in TABLES:
        for method in service.methods:
            assert f"/{service.full_name}/{method.name}" in rows, method.full_name
    rows_of = {name for _, rows in TABLES for name in rows}
    methods = {f"/{s.full_name}/{m.name}" for s, _ in TABLES for m in s.methods}
    assert rows_of == methods  # no row for an RPC that does not exist either


def test_a_table_without_a_row_for_an_rpc_is_refused() -> None:
    service = p.DESCRIPTOR.services_by_name["ProxyService"]
    with pytest.raises(ValueError, match=r"no row for \['DrainWorker'\]"):
        access.table(service, {"ListRoutes": access.NOBODY, "GetStats": access.NOBODY})
    with pytest.raises(ValueError, match="unknown roles"):
        access.allow("root")


# -- each role x each RPC, over mutual TLS ------------------------------------------------------

PARTS = ["flaps", "proxy", "registry", "flyd-w1", "console", "cli"]
"""A certificate of each role (cli: the operator's), and one made before roles (legacy)."""
LEGACY = "legacy"
REPLICAS = {"flaps", "proxy", "registry", "console"}


def expected_worker(rpc: str) -> set[str]:
    """flyd.access, restated: flaps does everything; the replicas follow; another worker
    reads a member's row while it fences; the operator reads capacity."""
    if rpc == "WatchEvents":
        return REPLICAS
    if rpc == "GetCapacity":
        return REPLICAS | {"operator"}
    if rpc == "GetMachine":
        return {"flaps", "flyd"}
    return {"flaps"}


EXPECTED: dict[str, Callable[[str], set[str]]] = {
    "flyd.v1.WorkerService": expected_worker,
    "registry.v1.RegistryService": lambda rpc: {
        "Announce": {"flyd", "registry", "flaps"},
        "ListMembers": REPLICAS,
        "Follow": REPLICAS,
        "ListSlot": {"flyd"},
    }[rpc],
    "proxy.v1.ProxyService": lambda rpc: (
        {"operator"} if rpc == "DrainWorker" else {"console", "operator"}
    ),
}

# Harmless requests where an empty one would not do: Announce names w1 (the flyd-w1
# certificate's own worker, where it already is).
REQUESTS: dict[str, Callable[[], Any]] = {
    "Announce": lambda: r.AnnounceRequest(worker=W1),
}
W1 = pb.WorkerInfo(id="w1", region="ams", address="127.0.0.1:1", boot_id="boot")


def tls_of(security: ClusterSecurity, part: str) -> ChannelTLS:
    if part == LEGACY:
        old = legacy_certificate(security.ca.parent, "flaps")
        return ChannelTLS(ca=security.ca, cert=old.cert, key=old.key, server_name=CLUSTER_NAME)
    return security.member_tls(part)


@pytest.fixture(scope="module")
def certificates(security: ClusterSecurity) -> ClusterSecurity:
    ca = ClusterCA.ensure(security.ca.parent)
    for part in PARTS:
        ca.issue(part, part_role(part))
    return security


@dataclass
class Served:
    address: str
    security: ClusterSecurity

    def stub(self, cls: type, part: str) -> Any:
        return cls(channel(self.address, tls_of(self.security, part)))


@contextlib.asynccontextmanager
async def served(
    security: ClusterSecurity,
    part: str,
    rows: access.Table,
    servicer: Any,
    add: Callable[[Any, Any], None],
    service: ServiceDescriptor,
    mapper: Any,
    limits: Any = None,
) -> AsyncIterator[Served]:
    """`servicer` served as its main serves it: mutual TLS, `part`'s certificate, `rows`."""
    cert = security.cert(part)
    settings = ServiceSettings(
        tls_cert=cert.cert,
        tls_key=cert.key,
        tls_client_ca=security.ca,
        cluster_ca=security.ca,
        grace_period=1,
    )
    running = Service(part, settings)
    if limits is None:
        access.add(running, rows, servicer, add, service, mapper)
    else:
        access.add(running, rows, servicer, add, service, mapper, limits)
    async with serving(running) as address:
        yield Served(address, security)


async def outcome(stub: Any, method: Any, request: Any) -> grpc.aio.AioRpcError | None:
    """The call's error if its role refused it; None if it got past (whatever it answered)."""
    call = getattr(stub, method.name)(request, timeout=T)
    try:
        if method.server_streaming:
            await call.read()
            call.cancel()
        else:
            await call
    except grpc.aio.AioRpcError as err:
        info = error_info(err)
        if err.code() == DENIED and info is not None and info[0] == access.REASON:
            return err
    return None


async def check_every_role(target: Served, service: ServiceDescriptor, stub_cls: type) -> None:
    expected = EXPECTED[service.full_name]
    request_type = {m.name: m.input_type for m in service.methods}
    for part in [*PARTS, LEGACY]:
        role = None if part == LEGACY else part_role(part)
        stub = target.stub(stub_cls, part)
        for method in service.methods:
            make = REQUESTS.get(method.name)
            request = make() if make else _message(request_type[method.name])
            err = await outcome(stub, method, request)
            if role in expected(method.name):
                assert err is None, (part, method.name, err and err.details())
                continue
            assert err is not None, (part, method.name)
            info = error_info(err)
            assert info is not None
            details = err.details() or ""
            if role is None:
                assert "names no role" in details, (part, method.name, details)
            else:
                assert info[2]["role"] == role, (part, method.name)
                assert f"(role {role})" in details, (part, method.name, details)
            assert info[2]["method"] == f"/{service.full_name}/{method.name}"


def _message(descriptor: Any) -> Any:
    from google.protobuf import message_factory

    return message_factory.GetMessageClass(descriptor)()


@pytest.fixture
async def worker(tmp_path: Path) -> AsyncIterator[Any]:
    """Worker w1 on the fake driver, its secrets sealed, as flyd's main builds it."""
    clock = ManualClock()
    images = image_cache(tmp_path, image_source(tmp_path))
    flyd = boot(
        store=MemoryMachineLog(),
        host=FakeHost(clock),
        clock=clock,
        images=images,
        secret_box=SecretBox.load(tmp_path / "secrets.key"),
    )
    flyd.worker.recover()
    yield flyd.worker
    await flyd.kill()


@contextlib.asynccontextmanager
async def worker_served(security: ClusterSecurity, worker: Any) -> AsyncIterator[Served]:
    service = w.DESCRIPTOR.services_by_name["WorkerService"]
    servicer = WorkerServicer(worker, heartbeat_interval=0.2, draining=asyncio.Event())
    add = worker_pb2_grpc.add_WorkerServiceServicer_to_server
    async with served(
        security, "flyd-w1", WORKER_ACCESS, servicer, add, service, flyd_errors, LIMITS
    ) as target:
        yield target


async def test_each_role_calls_exactly_its_rows_of_a_worker(
    certificates: ClusterSecurity, worker: Any
) -> None:
    async with worker_served(certificates, worker) as target:
        service = w.DESCRIPTOR.services_by_name["WorkerService"]
        await check_every_role(target, service, worker_pb2_grpc.WorkerServiceStub)


@contextlib.asynccontextmanager
async def replica_served(security: ClusterSecurity, part: str) -> AsyncIterator[Served]:
    """A replica that knows w1, served as `part` serves it (the registry, the proxy's port)."""
    replica = Replica()
    replica.add_worker(W1)
    async with served(
        security,
        part,
        REGISTRY_ACCESS,
        RegistryServicer(replica),
        registry_pb2_grpc.add_RegistryServiceServicer_to_server,
        r.DESCRIPTOR.services_by_name["RegistryService"],
        registry_errors,
    ) as target:
        target.replica = replica  # type: ignore[attr-defined]
        yield target


async def test_each_role_calls_exactly_its_rows_of_a_replica(
    certificates: ClusterSecurity,
) -> None:
    async with replica_served(certificates, "registry") as target:
        service = r.DESCRIPTOR.services_by_name["RegistryService"]
        await check_every_role(target, service, registry_pb2_grpc.RegistryServiceStub)


@contextlib.asynccontextmanager
async def edge_served(security: ClusterSecurity) -> AsyncIterator[tuple[Served, Any]]:
    rows = fleet(machine("web-a", worker="w1"), machine("web-b", worker="w2"))
    async with (
        world(rows) as edge,
        served(
            security,
            "proxy",
            PROXY_ACCESS,
            ProxyServicer(edge.router, edge.stats),
            proxy_pb2_grpc.add_ProxyServiceServicer_to_server,
            p.DESCRIPTOR.services_by_name["ProxyService"],
            proxy_errors,
        ) as target,
    ):
        yield target, edge


async def test_each_role_calls_exactly_its_rows_of_the_edge(
    certificates: ClusterSecurity,
) -> None:
    async with edge_served(certificates) as (target, _):
        service = p.DESCRIPTOR.services_by_name["ProxyService"]
        await check_every_role(target, service, proxy_pb2_grpc.ProxyServiceStub)


# -- the attacks, refused, nothing changed --------------------------------------------------------

NOT_FLAPS = ["console", "proxy", "registry", "flyd-w1", "cli", LEGACY]


async def test_attack_2_no_part_but_flaps_rewrites_a_machine_to_print_its_secret(
    certificates: ClusterSecurity, worker: Any
) -> None:
    """A stolen certificate (the console's, or any but flaps') changes a machine's command to
    `sh -c env` keeping its secret `<redacted>`, then reads its logs: refused at the worker,
    the machine as it was. flaps' own certificate may (the flaps-only path: it checked the
    caller's token)."""
    async with worker_served(certificates, worker) as target:
        made_cfg = config()
        made_cfg.secrets["API_KEY"] = SECRET
        as_flaps = target.stub(worker_pb2_grpc.WorkerServiceStub, "flaps")
        create = w.CreateMachineRequest(app="demo", config=made_cfg)
        made = (await as_flaps.CreateMachine(create, timeout=T)).machine
        before = worker.get(made.id).machine
        evil = config("sh", "-c", "env")
        evil.secrets["API_KEY"] = "<redacted>"
        update = w.UpdateMachineRequest(machine_id=made.id, config=evil)
        for part in NOT_FLAPS:
            stub = target.stub(worker_pb2_grpc.WorkerServiceStub, part)
            for call in (
                stub.UpdateMachine(update, timeout=T),
                stub.GetMachineLogs(w.GetMachineLogsRequest(machine_id=made.id), timeout=T),
                stub.RevealSecrets(w.RevealSecretsRequest(machine_id=made.id), timeout=T),
                stub.DestroyMachine(w.DestroyMachineRequest(machine_id=made.id), timeout=T),
                stub.CreateMachine(w.CreateMachineRequest(app="x", config=config()), timeout=T),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as raised:
                    await (call.read() if isinstance(call, grpc.aio.UnaryStreamCall) else call)
                assert raised.value.code() == DENIED, part
                assert SECRET not in str(raised.value)
        assert worker.get(made.id).machine == before
        assert [m.id for m in worker.list_machines()] == [made.id]
        updated = await as_flaps.UpdateMachine(update, timeout=T)
        assert list(updated.machine.config.cmd) == ["sh", "-c", "env"]
        assert worker.reveal_secrets(made.id) == {"API_KEY": SECRET}


@pytest.mark.parametrize("part", ["proxy", "registry"])
async def test_attack_3_no_certificate_moves_another_workers_address(
    certificates: ClusterSecurity, part: str
) -> None:
    """Announcing w1 at 127.0.0.1:9 on the proxy's gRPC port (and the registry's): refused for
    every certificate but w1's own; the address w1 has is the one it announced."""
    ClusterCA.ensure(certificates.ca.parent).issue("flyd-w2", "flyd")
    async with replica_served(certificates, part) as target:
        replica: Replica = target.replica  # type: ignore[attr-defined]
        spoofed = pb.WorkerInfo()
        spoofed.CopyFrom(W1)
        spoofed.address = "127.0.0.1:9"
        for attacker in ["console", "proxy", "flyd-w2", "cli", LEGACY]:
            stub = target.stub(registry_pb2_grpc.RegistryServiceStub, attacker)
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await stub.Announce(r.AnnounceRequest(worker=spoofed), timeout=T)
            assert raised.value.code() == DENIED, attacker
            view = replica.worker("w1")
            assert view is not None
            assert view.info.address == W1.address, attacker
        itself = target.stub(registry_pb2_grpc.RegistryServiceStub, "flyd-w1")
        moved = pb.WorkerInfo()
        moved.CopyFrom(W1)
        moved.address = "127.0.0.1:2"  # it moved: it may say so
        await itself.Announce(r.AnnounceRequest(worker=moved), timeout=T)
        view = replica.worker("w1")
        assert view is not None
        assert view.info.address == "127.0.0.1:2"


async def test_attack_7_only_the_operator_drains_workers_at_the_edge(
    certificates: ClusterSecurity,
) -> None:
    async with edge_served(certificates) as (target, edge):

        async def draining() -> set[str]:
            stub = target.stub(proxy_pb2_grpc.ProxyServiceStub, "cli")
            routes = await stub.ListRoutes(p.ListRoutesRequest(), timeout=T)
            return {m.worker_id for a in routes.apps for m in a.machines if m.draining}

        for part in ["console", "flaps", "proxy", "registry", "flyd-w1", LEGACY]:
            stub = target.stub(proxy_pb2_grpc.ProxyServiceStub, part)
            for worker_id in ("w1", "w2"):
                with pytest.raises(grpc.aio.AioRpcError) as raised:
                    await stub.DrainWorker(p.DrainWorkerRequest(worker_id=worker_id), timeout=T)
                assert raised.value.code() == DENIED, part
        assert await draining() == set()
        operator = target.stub(proxy_pb2_grpc.ProxyServiceStub, "cli")
        done = await operator.DrainWorker(p.DrainWorkerRequest(worker_id="w1"), timeout=T)
        assert done.draining
        assert await draining() == {"w1"}
        assert edge.router is not None
