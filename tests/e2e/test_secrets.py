"""A secret set on a machine reaches the machine's environment and nowhere else.

The whole secure fleet runs as processes (two workers, flaps, the proxy, a standalone
registry), logging at debug level and exporting spans to a real OTLP receiver. A machine gets a
secret; the test then calls every RPC of every service (flaps' Machines and Platform APIs, the
workers', the registry's, the proxy's admin API: a call the scenario does not make is made by a
sweep over the service descriptors, and a test fails when an RPC was never called), changes the
machine (update, stop, start, restart, leases, bad requests), reaches it through the edge, and
destroys it. Then it searches
everything: each RPC's answer and error text, every exported span, and every file the run left
(service logs, the workers' LMDB logs, the machines' own files). The secret's value must be in
none of them, while the machine proves it had it (it answers with its hash). The admin token
is searched for the same way: its id may be logged, the token never.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Callable, Iterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import Message

from flaps.v1 import machines_pb2 as m
from flaps.v1 import platform_pb2, platform_pb2_grpc
from flyd.v1 import machine_pb2 as pb
from flyd.v1 import worker_pb2 as w
from flyd.v1 import worker_pb2_grpc
from model.tokens import inspect, read_token
from model.validate import REDACTED
from proxy.v1 import proxy_pb2 as p
from registry.v1 import registry_pb2, registry_pb2_grpc
from tests.e2e.otlp import OtlpReceiver
from tests.harness import ServiceProcess, channel, clean_env
from tests.proxy.support import T, get, proxy_fleet
from tests.servicers import seconds

DENIED = grpc.StatusCode.PERMISSION_DENIED
CANARY = f"nonomad-canary-{secrets.token_hex(12)}"
OTHER = f"{CANARY}-second"
# The machine answers every GET with the SHA-256 of its API_KEY and its plain PLAIN variable.
APP = """\
import hashlib, http.server, os
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        key = os.environ.get("API_KEY", "").encode()
        body = (hashlib.sha256(key).hexdigest() + " " + os.environ.get("PLAIN", "")).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
print("listening", flush=True)
http.server.ThreadingHTTPServer(("127.0.0.1", int(os.environ["PORT"])), H).serve_forever()
"""
DEBUG = {f"{svc}_LOG_LEVEL": "debug" for svc in ("FLYD", "FLAPS", "PROXY", "REGISTRY")}


def config(**secret_values: str) -> pb.MachineConfig:
    return pb.MachineConfig(
        image="demo:v1",
        guest=pb.GuestConfig(cpu_millicores=100, memory_mib=64),
        services=[pb.ServiceConfig(internal_port=8080, autostart=True)],
        entrypoint=["python3", "-u", "-c", APP],
        env={"PLAIN": "visible"},
        secrets=secret_values,
    )


M = TypeVar("M", bound=Message)


class Seen:
    """Everything the test was shown: answers, error texts, stream messages."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def __call__(self, message: M) -> M:
        self.parts.append(message.SerializeToString())
        return message

    async def refused(self, call: object, code: grpc.StatusCode) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await call  # type: ignore[misc]
        assert raised.value.code() == code, raised.value.details()
        self.parts.append(str(raised.value).encode())

    def has(self, needle: str) -> bool:
        return any(needle.encode() in part for part in self.parts)


SERVICES: list[ServiceDescriptor] = [
    m.DESCRIPTOR.services_by_name["MachinesService"],
    platform_pb2.DESCRIPTOR.services_by_name["PlatformService"],
    w.DESCRIPTOR.services_by_name["WorkerService"],
    registry_pb2.DESCRIPTOR.services_by_name["RegistryService"],
    p.DESCRIPTOR.services_by_name["ProxyService"],
]
"""Every service of the fleet: each of their RPCs is called, and its answer searched."""


class Tracked:
    """A stub whose RPCs, as the test looks them up, are noted in `called` (`<service>/<rpc>`)."""

    def __init__(self, stub: object, service: ServiceDescriptor, called: set[str]) -> None:
        self._stub, self._service, self._called = stub, service.full_name, called

    def __getattr__(self, rpc: str) -> Any:
        self._called.add(f"{self._service}/{rpc}")
        return getattr(self._stub, rpc)


BAD_SIGNAL = "SIGNOPE"
# A harmless request for each RPC of the services the sweep covers, on the machine with the
# secrets (`mid`): a read, or a change refused (a bad signal, an empty config...) or that
# changes nothing (start a started machine, uncordon an uncordoned worker). A new RPC without
# one here fails the sweep, naming it.
SWEEP: dict[str, Callable[[str], Message]] = {
    "flyd.v1.WorkerService/CreateMachine": lambda mid: w.CreateMachineRequest(
        machine_id=mid, app="vault", config=pb.MachineConfig()
    ),
    "flyd.v1.WorkerService/StartMachine": lambda mid: w.StartMachineRequest(machine_id=mid),
    "flyd.v1.WorkerService/StopMachine": lambda mid: w.StopMachineRequest(
        machine_id=mid, signal=BAD_SIGNAL
    ),
    "flyd.v1.WorkerService/RestartMachine": lambda mid: w.RestartMachineRequest(
        machine_id=mid, signal=BAD_SIGNAL
    ),
    "flyd.v1.WorkerService/SignalMachine": lambda mid: w.SignalMachineRequest(
        machine_id=mid, signal=BAD_SIGNAL
    ),
    "flyd.v1.WorkerService/DestroyMachine": lambda mid: w.DestroyMachineRequest(machine_id=mid),
    "flyd.v1.WorkerService/GetMachine": lambda mid: w.GetMachineRequest(machine_id=mid),
    "flyd.v1.WorkerService/ListMachines": lambda mid: w.ListMachinesRequest(),
    "flyd.v1.WorkerService/WaitMachine": lambda mid: w.WaitMachineRequest(
        machine_id=mid, state=pb.MACHINE_STATE_STARTED, timeout=seconds(5)
    ),
    "flyd.v1.WorkerService/GetCapacity": lambda mid: w.GetCapacityRequest(),
    "flyd.v1.WorkerService/WatchEvents": lambda mid: w.WatchEventsRequest(from_seq=0),
    "flyd.v1.WorkerService/GetMachineLogs": lambda mid: w.GetMachineLogsRequest(
        machine_id=mid, tail_lines=100
    ),
    "flyd.v1.WorkerService/CordonWorker": lambda mid: w.CordonWorkerRequest(cordoned=False),
    "flyd.v1.WorkerService/UpdateMachine": lambda mid: w.UpdateMachineRequest(
        machine_id=mid, config=pb.MachineConfig()
    ),
    "flyd.v1.WorkerService/AcquireLease": lambda mid: w.AcquireLeaseRequest(
        machine_id=mid, ttl=seconds(-1)
    ),
    "flyd.v1.WorkerService/ReleaseLease": lambda mid: w.ReleaseLeaseRequest(
        machine_id=mid, nonce="not-the-nonce"
    ),
    "flyd.v1.WorkerService/ListMachineEvents": lambda mid: w.ListMachineEventsRequest(
        machine_id=mid
    ),
    "flyd.v1.WorkerService/GetPlacement": lambda mid: w.GetPlacementRequest(machine_id=mid),
    "flyd.v1.WorkerService/SupersedeMachine": lambda mid: w.SupersedeMachineRequest(
        machine_id=mid, generation=0, primary="nobody"
    ),
    "flyd.v1.WorkerService/RevealSecrets": lambda mid: w.RevealSecretsRequest(machine_id=mid),
    "registry.v1.RegistryService/Announce": lambda mid: registry_pb2.AnnounceRequest(
        worker=pb.WorkerInfo(id="Not A Worker")
    ),
    "registry.v1.RegistryService/ListMembers": lambda mid: registry_pb2.ListMembersRequest(),
    "registry.v1.RegistryService/Follow": lambda mid: registry_pb2.FollowRequest(),
    "registry.v1.RegistryService/ListSlot": lambda mid: registry_pb2.ListSlotRequest(
        app="vault", slot=mid
    ),
    "proxy.v1.ProxyService/ListRoutes": lambda mid: p.ListRoutesRequest(),
    "proxy.v1.ProxyService/GetStats": lambda mid: p.GetStatsRequest(),
    "proxy.v1.ProxyService/DrainWorker": lambda mid: p.DrainWorkerRequest(worker_id="nope"),
}


async def sweep(stub: Tracked, service: ServiceDescriptor, mid: str, seen: Seen) -> None:
    """Call each RPC of `service` not called yet with its SWEEP request; note what it showed
    (the first message of a stream; an error's text)."""
    for method in service.methods:
        name = f"{service.full_name}/{method.name}"
        if name in stub._called:
            continue
        assert name in SWEEP, f"no harmless request for {name} in SWEEP"
        call = getattr(stub, method.name)(SWEEP[name](mid), timeout=T)
        try:
            if method.server_streaming:
                seen(await call.read())
                call.cancel()
            else:
                seen(await call)
        except grpc.aio.AioRpcError as err:  # a refusal (a bad request, a role's) says why
            seen.parts.append(str(err).encode())


def files(root: Path, skip: Path) -> Iterator[Path]:
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink() and skip not in path.parents:
            yield path


async def test_a_secret_reaches_its_machine_and_nowhere_else(
    tmp_path: Path, image_source: Path, otlp: OtlpReceiver
) -> None:
    env = otlp.env(**DEBUG)
    seen = Seen()
    called: set[str] = set()
    machines_api, platform_api, worker_api, registry_api, proxy_api = SERVICES
    async with proxy_fleet(tmp_path, image_source, env=env) as fleet, AsyncExitStack() as stack:
        security = fleet.security
        assert security is not None
        await fleet.add_workers("w1", "w2")
        fleet.start_flaps()
        await fleet.until_alive()
        proxy = fleet.add_proxy()
        follow = [a for worker in fleet.workers.values() for a in ("--workers", worker.address)]
        registry = ServiceProcess(
            "registry",
            ["--listen", "127.0.0.1:0", "--grace-period", "2", *follow, *security.registry_args()],
            tmp_path / "registry.log",
            env=clean_env(**env),
        ).start()
        stack.callback(registry.kill)  # the fleet stops its own; this one too, whatever happens
        machines = Tracked(fleet.machines(), machines_api, called)
        assert fleet.flaps is not None
        platform = Tracked(
            platform_pb2_grpc.PlatformServiceStub(fleet._channel(fleet.flaps.address, flaps=True)),
            platform_api,
            called,
        )

        # The machine, created with a secret (and created again: the same idempotent create).
        create = m.CreateMachineRequest(
            app="vault", region="ams", config=config(API_KEY=CANARY), idempotency_key="v-1"
        )
        made = seen(await machines.CreateMachine(create, timeout=T)).machine
        assert dict(made.config.secrets) == {"API_KEY": REDACTED}
        assert seen(await machines.CreateMachine(create, timeout=T)).machine.id == made.id
        mid = made.id
        wait = m.WaitMachineRequest(
            machine_id=mid, state=pb.MACHINE_STATE_STARTED, timeout=seconds(20)
        )
        seen(await machines.WaitMachine(wait, timeout=30))

        # It has the value: it answers with its hash, through the edge.
        await fleet.until_routed("vault", 1)
        expected = f"{hashlib.sha256(CANARY.encode()).hexdigest()} visible"
        reply = await get(proxy.http, "vault")
        assert (reply.status, reply.body.decode()) == (200, expected)

        # Every read, of flaps and of the fleet.
        seen(await machines.GetMachine(m.GetMachineRequest(machine_id=mid), timeout=T))
        seen(await machines.ListMachines(m.ListMachinesRequest(app="vault"), timeout=T))
        seen(await machines.ListMachines(m.ListMachinesRequest(), timeout=T))
        events = m.ListMachineEventsRequest(machine_id=mid)
        seen(await machines.ListMachineEvents(events, timeout=T))
        async for line in machines.GetMachineLogs(
            m.GetMachineLogsRequest(machine_id=mid, tail_lines=100), timeout=T
        ):
            seen(line)
        seen(await platform.ListRegions(platform_pb2.ListRegionsRequest(), timeout=T))
        seen(await platform.ListWorkers(platform_pb2.ListWorkersRequest(), timeout=T))
        simulate = platform_pb2.SimulatePlacementRequest(
            app="vault", region="ams", config=config(API_KEY=CANARY)
        )
        seen(await platform.SimulatePlacement(simulate, timeout=T))
        lease = seen(
            await machines.AcquireLease(
                m.AcquireLeaseRequest(machine_id=mid, ttl=seconds(30), owner="test"), timeout=T
            )
        ).lease
        seen(await machines.ReleaseLease(m.ReleaseLeaseRequest(machine_id=mid, nonce=lease.nonce)))
        seen(await machines.GetPlacement(m.GetPlacementRequest(machine_id=mid), timeout=T))
        # A claim at no generation: refused, naming the field (a real one could stop it).
        supersede = m.SupersedeMachineRequest(machine_id=mid, generation=0, primary="nobody")
        await seen.refused(
            machines.SupersedeMachine(supersede, timeout=T), grpc.StatusCode.INVALID_ARGUMENT
        )
        await seen.refused(
            platform.CordonWorker(
                platform_pb2.CordonWorkerRequest(worker_id="nope", cordoned=True), timeout=T
            ),
            grpc.StatusCode.NOT_FOUND,
        )

        # Changes: the secret kept (redacted in), another added; bad requests that name it.
        update = m.UpdateMachineRequest(
            machine_id=mid, config=config(API_KEY=REDACTED, SECOND=OTHER)
        )
        updated = seen(await machines.UpdateMachine(update, timeout=60)).machine
        assert dict(updated.config.secrets) == {"API_KEY": REDACTED, "SECOND": REDACTED}
        wait.instance_id = updated.instance_id
        seen(await machines.WaitMachine(wait, timeout=30))
        await seen.refused(
            machines.UpdateMachine(
                m.UpdateMachineRequest(machine_id=mid, config=config(PLAIN=CANARY)), timeout=T
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
        )
        await seen.refused(
            machines.CreateMachine(
                m.CreateMachineRequest(
                    app="vault", region="ams", config=config(API_KEY=CANARY + "\x00")
                ),
                timeout=T,
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
        )
        seen(await machines.RestartMachine(m.RestartMachineRequest(machine_id=mid), timeout=60))
        seen(await machines.WaitMachine(wait, timeout=30))
        seen(await machines.SignalMachine(m.SignalMachineRequest(machine_id=mid, signal="SIGHUP")))
        seen(await machines.StopMachine(m.StopMachineRequest(machine_id=mid), timeout=60))
        stopped = m.WaitMachineRequest(
            machine_id=mid, state=pb.MACHINE_STATE_STOPPED, timeout=seconds(20)
        )
        seen(await machines.WaitMachine(stopped, timeout=30))
        seen(await machines.StartMachine(m.StartMachineRequest(machine_id=mid), timeout=60))
        seen(await machines.WaitMachine(wait, timeout=30))
        await fleet.until_routed("vault", 1)
        reply = await get(proxy.http, "vault")
        assert reply.body.decode() == expected

        # The workers', the registry's and the proxy's own APIs: what the scenario reads, then
        # every other RPC of theirs, each with the certificate of a part that may call it (a
        # worker's: flaps'). The one RPC that answers the value, RevealSecrets (flaps copying
        # an app's secrets to a new machine), no other part may call.
        worker = Tracked(fleet.worker(made.worker_id), worker_api, called)
        address = fleet.workers[made.worker_id].address
        for part in ("console", "proxy", "registry", "cli"):
            stolen = Tracked(
                worker_pb2_grpc.WorkerServiceStub(channel(address, security.member_tls(part))),
                worker_api,
                called,
            )
            reveal = w.RevealSecretsRequest(machine_id=mid)
            await seen.refused(stolen.RevealSecrets(reveal, timeout=T), DENIED)
            update = w.UpdateMachineRequest(machine_id=mid, config=config(API_KEY=REDACTED))
            update.config.entrypoint[:] = ["sh", "-c", "env"]  # attack 2: printing it
            await seen.refused(stolen.UpdateMachine(update, timeout=T), DENIED)
        seen(await worker.GetMachine(w.GetMachineRequest(machine_id=mid), timeout=T))
        seen(await worker.ListMachines(w.ListMachinesRequest(), timeout=T))
        watch = worker.WatchEvents(w.WatchEventsRequest(from_seq=0), timeout=T)
        seen(await watch.read())  # the snapshot: every row
        watch.cancel()
        follow_stub = Tracked(
            registry_pb2_grpc.RegistryServiceStub(
                channel(registry.address, security.member_tls("console"))
            ),
            registry_api,
            called,
        )
        follow_call = follow_stub.Follow(registry_pb2.FollowRequest(), timeout=T)
        seen(await follow_call.read())
        follow_call.cancel()
        admin = Tracked(fleet.admin(), proxy_api, called)
        seen(await admin.ListRoutes(p.ListRoutesRequest(), timeout=T))
        seen(await admin.GetStats(p.GetStatsRequest(), timeout=T))
        for stub, service in (
            (worker, worker_api),
            (follow_stub, registry_api),
            (admin, proxy_api),
        ):
            await sweep(stub, service, mid, seen)

        # A machine a deploy adds gets them from one of the app's, through flaps and the
        # workers, the first one gone, it serves the same. Placement watchers see it placed.
        watch = platform.WatchPlacements(platform_pb2.WatchPlacementsRequest(), timeout=60)
        await watch.initial_metadata()  # subscribed: every decision from now on comes
        twin = seen(
            await machines.CreateMachine(
                m.CreateMachineRequest(
                    app="vault", region="ams", config=config(), secrets_from=mid
                ),
                timeout=T,
            )
        ).machine
        assert dict(twin.config.secrets) == {"API_KEY": REDACTED, "SECOND": REDACTED}
        decision = seen(await watch.read())
        assert (decision.event.outcome, decision.event.machine_id) == ("placed", twin.id)
        watch.cancel()
        wait_twin = m.WaitMachineRequest(
            machine_id=twin.id, state=pb.MACHINE_STATE_STARTED, timeout=seconds(20)
        )
        seen(await machines.WaitMachine(wait_twin, timeout=30))
        await seen.refused(
            machines.CreateMachine(
                m.CreateMachineRequest(
                    app="other", region="ams", config=config(), secrets_from=mid
                ),
                timeout=T,
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
        )
        for gone in (mid, twin.id):
            if gone == twin.id:
                await fleet.until_routed("vault", 1)
                reply = await get(proxy.http, "vault")
                assert reply.body.decode() == expected
            seen(
                await machines.DestroyMachine(
                    m.DestroyMachineRequest(machine_id=gone, force=True), timeout=60
                )
            )
        # Stopped gracefully, so every span is exported and every log line written.
        for proc in [registry, *fleet.proxies, fleet.flaps, *fleet.workers.values()]:
            assert proc.terminate() == 0, proc.stderr_tail()

    # Every RPC of every service was called, and what it showed searched below.
    assert called == {f"{s.full_name}/{rpc.name}" for s in SERVICES for rpc in s.methods}
    token = read_token(security.admin_token)
    token_id = inspect(token).token_id
    spans = b"".join(otlp.raw)
    # The search would find what is there: the plain variable in answers, spans at all, the
    # token's id in flaps' spans and log.
    assert seen.has("visible")
    assert any(s.attributes.get("nonomad.token_id") == token_id for s in otlp.spans)
    assert token_id in (tmp_path / "flaps.log").read_text()
    # And the secrets are nowhere: not in an answer, a span, a log, the LMDB files, anything.
    for value in (CANARY, OTHER):
        assert not seen.has(value)
        assert value.encode() not in spans
    for path in files(tmp_path, skip=tmp_path / "security"):
        data = path.read_bytes()
        for needle in (CANARY, OTHER, token):
            assert needle.encode() not in data, f"{needle[:24]}... found in {path}"
