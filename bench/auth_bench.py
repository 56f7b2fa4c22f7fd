"""What security costs: on a CreateMachine (token verification plus TLS on every hop, on and
off), and on an edge request (the edge's per-request checks).

CreateMachine: one process holds two exchanges over the same workers: *plain* (the client,
flaps and the workers talk plaintext; flaps checks no token) and a TLS one (TLS on every hop,
mutual between flaps and the workers), which serves two sides: *secure* (every call checked:
the client's deploy token verified and its scope checked by flaps, flaps' certificate's role
checked by each worker against flyd.access) and *tls* (the same servers, connection and
client, the checks switched off for the call: `Switch`). The SDK's client creates machines
through each in turn, so all sides see the same noise, and a cost added is read as the median
of the paired differences: secure - plain is what security costs in all, secure - tls what the
per-call checks alone cost (issue 27's goal: <= 0.1 ms). The difference of the medians is
shown as a check. The workers are flyd's own Worker on fakes (a fake driver, the in-memory
log): their time is the same on every side and stays out of the differences.

The edge: one HttpProxy in front of a small backend, requests that make every per-request
check work against ones that make none work (`_edge_measure`; goal <= 0.1 ms).

Also, on their own: the verification of a token the first time flaps sees it (its signature)
and after (its text is known; its expiry is checked again), and a connection's first call.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import io
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from bench import report
from bench.procs import progress
from bench.report import Results, percentile
from flaps import auth, placement
from flaps.auth import Authorizer, TokenVerifier
from flaps.errors import map_error
from flaps.service import Exchange, MachinesServicer, Workers
from flaps.v1 import machines_pb2, machines_pb2_grpc, tokens_pb2
from flaps.verify import TokenServicer
from flyd import fsm
from flyd.access import WORKER_ACCESS
from flyd.fakes import FakeDriver, FakeHost
from flyd.images.build import build_image
from flyd.images.cache import ImageCache
from flyd.service import WorkerServicer
from flyd.service import map_error as flyd_map_error
from flyd.settings import CapacitySettings
from flyd.store import MemoryMachineLog
from flyd.v1 import machine_pb2 as pb
from flyd.v1 import worker_pb2, worker_pb2_grpc
from flyd.worker import Identity, Worker
from model.images.owners import PUBLIC
from model.images.source import ImageSource
from model.tokens import Keyring, caveats
from nonomad.client import Client, GuestConfig, MachineConfig
from nonomad.security import ClusterSecurity, provision
from proxy.pins import Grants, pin_check
from registry.replica import Replica
from registry.view import ALIVE
from runtime import Service, ServiceSettings, access, aio_channel, configure_logging
from runtime.clock import SystemClock
from runtime.pki import ClusterMembers

WORKERS = 4
FLYD_PART = "flyd-bench"  # one certificate the bench's workers all serve with
TARGET_MS = 0.3
CHECKS_TARGET_MS = 0.1  # the per-call checks alone, apart from TLS
SIDES = ("plain", "tls", "secure")
RUN_DEADLINE = 300.0


def _config() -> MachineConfig:
    config = MachineConfig(
        image="app:v1", guest=GuestConfig(cpu_millicores=10, memory_mib=1), entrypoint=["app"]
    )
    config.secrets["BENCH_SECRET"] = "a value the bench never prints"
    return config


class Switch:
    """Whether the calls being made now are checked: the *tls* and *secure* sides are the
    same servers, connections and replicas, and differ only in this, set before each call
    (one call at a time, all in this process). Anything else that told them apart (another
    port, another connection, another replica) measured as much as the checks did."""

    checked = True


def _switched(servicer: object, descriptor: Any, guard: Callable[[object], None]) -> None:
    """Each unary handler of `servicer` runs guarded (`guard(servicer)` put the checks in
    front of it) while `Switch.checked`, else as it was; streams stay guarded."""
    plain = {m.name: getattr(servicer, m.name) for m in descriptor.methods}
    guard(servicer)
    for name, handler in plain.items():
        checked = getattr(servicer, name)
        if checked is handler or not inspect.iscoroutinefunction(handler):
            continue

        async def either(request: Any, context: Any, _p: Any = handler, _c: Any = checked) -> Any:
            return await (_c if Switch.checked else _p)(request, context)

        setattr(servicer, name, either)


def _worker(root: Path, worker_id: str, source: ImageSource) -> Worker:
    worker: Worker | None = None

    def on_exit(machine_id: str, handle: object, status: object) -> None:
        if worker is not None:
            worker.on_exit(machine_id, handle, status)  # type: ignore[arg-type]

    clock = SystemClock()
    worker = Worker(
        identity=Identity(worker_id, "ams", "", {}, f"boot-{worker_id}"),
        store=MemoryMachineLog(),
        driver=FakeDriver(on_exit=on_exit, host=FakeHost(clock)),
        images=ImageCache(root / worker_id, source, max_bytes=1 << 30),
        capacity=CapacitySettings(
            cpu_millicores=10**8, memory_mib=10**8, disk_mib=10**8, machines=100_000
        ),
        ports=range(30000, 30001),
        machine_host="127.0.0.1",
        clock=clock,
        policy=fsm.Policy(),
    )
    worker.recover()
    return worker


@contextlib.asynccontextmanager
async def _serving(service: Service) -> AsyncIterator[str]:
    task = asyncio.create_task(service.run(handle_signals=False))
    try:
        async with asyncio.timeout(30):
            address = await service.wait_ready()
        yield address
    finally:
        service.request_shutdown()
        await asyncio.gather(task, return_exceptions=True)


def _worker_service(worker: Worker, settings: ServiceSettings) -> Service:
    """The worker's servicer as flyd serves it: over TLS, the role of each call checked
    (flyd.access) while `Switch.checked`."""
    service = Service(worker.identity.worker_id, settings)
    servicer = WorkerServicer(worker, heartbeat_interval=0.2, draining=service.draining)
    add = worker_pb2_grpc.add_WorkerServiceServicer_to_server
    descriptor = worker_pb2.DESCRIPTOR.services_by_name["WorkerService"]
    if settings.tls_enabled:
        members = access.members_of(service)
        _switched(
            servicer, descriptor, lambda s: access.guard(s, descriptor, WORKER_ACCESS, members)
        )
    service.add(servicer, add, descriptor, flyd_map_error)
    return service


def _flaps(
    replica: Replica, workers: Workers, settings: ServiceSettings, authorizer: Authorizer | None
) -> Service:
    servicer = MachinesServicer(Exchange(replica, workers, placement.Pipeline()))
    descriptor = machines_pb2.DESCRIPTOR.services_by_name["MachinesService"]
    if authorizer is not None:
        _switched(servicer, descriptor, lambda s: auth.guard(s, descriptor, authorizer))
    service = Service("flaps", settings)
    service.add(
        servicer, machines_pb2_grpc.add_MachinesServiceServicer_to_server, descriptor, map_error
    )
    return service


async def _alive(replica: Replica) -> None:
    def all_alive() -> bool:
        return sum(v.status == ALIVE for v in replica.workers()) == WORKERS

    if not await replica.wait_for(all_alive, 30):
        raise RuntimeError("the replica did not see every worker alive within 30 s")


async def _measure(root: Path, security: ClusterSecurity, n: int, results: Results) -> None:
    build_image(
        root / "src", root / "images", name="app", tag="v1", entrypoint=["app"], owners=PUBLIC
    )
    source = ImageSource(root / "images")
    workers = [_worker(root, f"w{i}", source) for i in range(WORKERS)]
    flyd_cert, flaps_cert = security.cert(FLYD_PART), security.cert("flaps")
    member = security.member_tls("flaps")
    keys = security.keyring()
    token = keys.mint(caveats(apps=["bench"], ops=["deploy"]))
    async with contextlib.AsyncExitStack() as stack:
        plain, secure = Replica(), Replica(channel=lambda a: aio_channel(a, tls=member))
        for worker in workers:
            plain_address = await stack.enter_async_context(
                _serving(_worker_service(worker, ServiceSettings(grace_period=1)))
            )
            mutual = ServiceSettings(
                grace_period=1,
                tls_cert=flyd_cert.cert,
                tls_key=flyd_cert.key,
                tls_client_ca=security.ca,
            )
            secure_address = await stack.enter_async_context(
                _serving(_worker_service(worker, mutual))
            )
            for replica, address in ((plain, plain_address), (secure, secure_address)):
                info = pb.WorkerInfo()
                info.CopyFrom(worker.info())
                info.address = address
                replica.add_worker(info)
        for replica in (plain, secure):
            task = asyncio.create_task(replica.run(asyncio.Event()))
            stack.callback(task.cancel)
            await _alive(replica)
        plain_workers, secure_workers = Workers(plain), Workers(secure, tls=member)
        for pool in (plain_workers, secure_workers):
            stack.push_async_callback(pool.close)
        authorizer = Authorizer(
            TokenVerifier(lambda: keys),
            Exchange(secure, secure_workers, placement.Pipeline()).app_of,
            ClusterMembers(security.ca),
        )
        plain_flaps = await stack.enter_async_context(
            _serving(_flaps(plain, plain_workers, ServiceSettings(grace_period=1), None))
        )
        tls_settings = ServiceSettings(
            grace_period=1, tls_cert=flaps_cert.cert, tls_key=flaps_cert.key
        )
        secure_flaps = await stack.enter_async_context(
            _serving(_flaps(secure, secure_workers, tls_settings, authorizer))
        )
        config = _config()
        # *tls* and *secure* are one client of one flaps: only `Switch.checked` differs.
        secure_client = Client(secure_flaps, tls=security.client_tls(), token=token, timeout=10)
        clients = {
            "plain": Client(plain_flaps, timeout=10),
            "tls": secure_client,
            "secure": secure_client,
        }
        for client in (clients["plain"], secure_client):
            stack.push_async_callback(client.close)

        # The first call of each: its connection, and for the secure side its TLS handshake.
        first: dict[str, float] = {}
        for side in ("plain", "secure"):
            t0 = time.perf_counter()
            await clients[side].create_machine("bench", config, region="ams")
            first[side] = (time.perf_counter() - t0) * 1000
        for _ in range(max(20, n // 10)):  # warm up both
            for side, client in clients.items():
                Switch.checked = side != "tls"
                await client.create_machine("bench", config, region="ams")

        samples: dict[str, list[float]] = {side: [] for side in SIDES}
        pairs: list[float] = []  # secure - plain
        checks: list[float] = []  # secure - tls
        progress(f"auth: {n} CreateMachine calls each way, interleaved")
        for i in range(n):
            order = SIDES[i % 3 :] + SIDES[: i % 3]  # each side first as often
            took: dict[str, float] = {}
            for side in order:
                Switch.checked = side != "tls"
                t0 = time.perf_counter()
                await clients[side].create_machine("bench", config, region="ams")
                took[side] = (time.perf_counter() - t0) * 1000
                samples[side].append(took[side])
            pairs.append(took["secure"] - took["plain"])
            checks.append(took["secure"] - took["tls"])

    rounds = 2000
    fresh = [keys.mint(caveats(apps=["bench"], ops=["deploy"])) for _ in range(rounds)]
    t0 = time.perf_counter()
    for each in fresh:  # each seen for the first time: the signature checked
        keys.verify(each)
    first_us = (time.perf_counter() - t0) / rounds * 1e6
    t0 = time.perf_counter()
    for each in fresh:  # seen before: known by its digest, its expiry checked
        keys.verify(each)
    again_us = (time.perf_counter() - t0) / rounds * 1e6

    # A call's role, as a worker checks it: who the certificate is (known by its PEM after
    # the first time) and its row (gRPC's own auth_context() is not in this).
    members = ClusterMembers(security.ca)
    context = _Context(flaps_cert.cert.read_bytes())
    method = "/flyd.v1.WorkerService/CreateMachine"
    t0 = time.perf_counter()
    for _ in range(rounds):
        assert access.refusal(WORKER_ACCESS, method, members.identity_of(context), None) is None
    role_us = (time.perf_counter() - t0) / rounds * 1e6
    pin_us = await _pin_check_us(keys, rounds)
    flaps_us = await _flaps_check_us(authorizer, token, rounds)

    results.add(
        "per-call checks added per CreateMachine, p50 (paired, same TLS)",
        round(statistics.median(checks), 3),
        "ms",
        ("<=", CHECKS_TARGET_MS),
        note="median of (secure - tls): token, scope and role checks, no transport change",
    )
    results.add(
        "per-call checks added, p50 difference",
        round(percentile(samples["secure"], 50) - percentile(samples["tls"], 50), 3),
        "ms",
    )
    added = statistics.median(pairs)
    results.add(
        "added per CreateMachine, p50 (paired)",
        round(added, 3),
        "ms",
        ("<=", TARGET_MS),
        note="median of (secure - plain) over interleaved pairs",
    )
    results.add(
        "added per CreateMachine, p50 difference",
        round(percentile(samples["secure"], 50) - percentile(samples["plain"], 50), 3),
        "ms",
    )
    for side in SIDES:
        for pct in (50, 90, 99):
            results.add(f"CreateMachine {side} p{pct}", percentile(samples[side], pct), "ms")
    results.add("token verification alone, first sight", round(first_us, 1), "us")
    results.add("token verification alone, seen before", round(again_us, 1), "us")
    results.add("flaps' check alone of a CreateMachine (token, scope)", round(flaps_us, 2), "us")
    results.add("role check alone (certificate known)", round(role_us, 2), "us")
    results.add("edge pin check, token known (cached grant)", round(pin_us, 2), "us")
    results.add("first call, plain (connect)", round(first["plain"], 2), "ms")
    results.add("first call, secure (connect + TLS handshakes)", round(first["secure"], 2), "ms")
    results.details = {
        "n": n,
        "workers": WORKERS,
        "samples_ms": {side: [round(v, 4) for v in s] for side, s in samples.items()},
    }
    await _edge_measure(keys, n, results)


class _Context:
    """What a check reads of a call's gRPC context: the client certificate (None: a client
    with none, as on flaps' public port) and the metadata (a token)."""

    def __init__(self, pem: bytes | None, token: str = "") -> None:
        self._auth = {"x509_pem_cert": [pem]} if pem is not None else {}
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()

    def auth_context(self) -> dict[str, list[bytes]]:
        return self._auth

    def peer_identity_key(self) -> str | None:
        return "x509_common_name" if self._auth else None

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata


async def _flaps_check_us(authorizer: Authorizer, token: str, rounds: int) -> float:
    """flaps' check of a CreateMachine on its public port (the token verified, seen before;
    its scope and the request's named objects checked), per call, gRPC's own part aside."""
    method = "/flaps.v1.MachinesService/CreateMachine"
    request = machines_pb2.CreateMachineRequest(app="bench", region="ams", config=_config())
    context = _Context(None, token)
    assert await authorizer.check(method, request, context) is not None
    return await _us_per_call(lambda: authorizer.check(method, request, context), rounds)


async def _pin_check_us(keys: Keyring, rounds: int) -> float:
    """A pinned request's check at the edge once flaps has answered about its token (the
    grant kept: proxy.pins), per request."""
    servicer = TokenServicer(TokenVerifier(lambda: keys))

    async def verify(token: str) -> tokens_pb2.VerifyTokenResponse:
        request = tokens_pb2.VerifyTokenRequest(token=token)
        return await servicer.VerifyToken(request, None)

    check = pin_check(Grants(verify))
    token = keys.mint(caveats(apps=["bench"], ops=["read"])).encode()
    assert await check("bench", "m-1", token) is None  # flaps asked, once
    return await _us_per_call(lambda: check("bench", "m-1", token), rounds)


EDGE_BARE = (
    b"GET /hello HTTP/1.1\r\nHost: bench.%s\r\nUser-Agent: bench\r\n"
    b"X-Bench-Padding-A: %s\r\nX-Bench-Padding-B: %s\r\n\r\n"
)
EDGE_CHECKED = (
    b"GET /hello HTTP/1.1\r\nHost: bench.%s\r\nUser-Agent: bench\r\n"
    b"X-Forwarded-For: 203.0.113.66\r\nForwarded: for=203.0.113.66\r\n"
    b"Connection: keep-alive, x-trace\r\nX-Trace: 1\r\n"
    b"nonomad-force-instance-id: m-1\r\nnonomad-token: %s\r\n\r\n"
)


async def _edge_measure(keys: Keyring, n: int, results: Results) -> None:
    """What the edge's per-request checks add to a request, through one HttpProxy (the demo's
    data plane, a static router) to a small backend, one keep-alive connection, all on
    loopback in this process. Two requests alternate: *checked* makes every check work (a
    client's X-Forwarded-For and Forwarded dropped, a Connection list read and the header it
    names dropped, a pinned machine's token checked: its grant kept, proxy.pins) and *bare*
    makes none of them work (no such header, no pin), padded to the same size with headers that
    pass on. The edge writes its own forwarding headers on both. Read the median of the
    paired differences."""
    from bench.proxy_children import DOMAIN, StaticRouter, _BackendProtocol
    from proxy.http import HttpProxy
    from proxy.stats import Stats

    servicer = TokenServicer(TokenVerifier(lambda: keys))

    async def verify(token: str) -> tokens_pb2.VerifyTokenResponse:
        return await servicer.VerifyToken(tokens_pb2.VerifyTokenRequest(token=token), None)

    token = keys.mint(caveats(apps=["bench"], ops=["read"])).encode()
    checked = EDGE_CHECKED % (DOMAIN.encode(), token)
    extra = len(checked) - len(EDGE_BARE % (DOMAIN.encode(), b"", b""))
    bare = EDGE_BARE % (DOMAIN.encode(), b"p" * (extra // 2), b"p" * (extra - extra // 2))
    loop = asyncio.get_running_loop()
    backend = await loop.create_server(_BackendProtocol, "127.0.0.1", 0)
    edge = HttpProxy(
        StaticRouter(backend.sockets[0].getsockname()[1]),
        Stats(),
        domain=DOMAIN,
        region="ams",
        pin_check=pin_check(Grants(verify)),
    )
    try:
        _, port = await edge.serve("127.0.0.1", 0)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)

        async def send(request: bytes) -> float:
            t0 = time.perf_counter()
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])
            await reader.readexactly(length)
            took = (time.perf_counter() - t0) * 1000
            if not head.startswith(b"HTTP/1.1 200"):
                raise RuntimeError(f"the edge answered {head.splitlines()[0]!r}")
            return took

        for _ in range(max(50, n // 10)):  # warm up both (and the grant: flaps asked once)
            await send(bare)
            await send(checked)
        samples: dict[str, list[float]] = {"bare": [], "checked": []}
        added: list[float] = []
        progress(f"auth: {n} edge requests each way, interleaved")
        for i in range(n):
            order = (("bare", bare), ("checked", checked))
            took = {side: await send(req) for side, req in (order if i % 2 else order[::-1])}
            for side, value in took.items():
                samples[side].append(value)
            added.append(took["checked"] - took["bare"])
        writer.close()
    finally:
        await edge.close(grace=1)
        backend.close()
    results.add(
        "edge checks added per request, p50 (paired)",
        round(statistics.median(added), 3),
        "ms",
        ("<=", CHECKS_TARGET_MS),
        note="median of (checked - bare): forwarding headers dropped, Connection read, pin's token",
    )
    for side in ("bare", "checked"):
        for pct in (50, 99):
            results.add(f"edge request {side} p{pct}", percentile(samples[side], pct), "ms")


async def _us_per_call(call: Callable[[], Awaitable[object]], rounds: int) -> float:
    """Microseconds per awaited `call()`, over `rounds` in a row."""
    t0 = time.perf_counter()
    for _ in range(rounds):
        await call()
    return (time.perf_counter() - t0) / rounds * 1e6


def run(*, quick: bool = False, out: Path | None = None, strict: bool = False) -> int:
    """Run the benchmark, print its table; write JSON to `out` when given."""
    n = 300 if quick else 3000
    results = Results(
        "auth: CreateMachine plain, over TLS, and over TLS with every call checked "
        f"({WORKERS} fake workers, everything in one process)"
    )
    configure_logging("auth-bench", "warning")
    with tempfile.TemporaryDirectory(prefix="nonomad-auth-bench-") as tmp:
        root = Path(tmp)
        (root / "src").mkdir()
        (root / "src" / "app").write_text("#!/bin/sh\n")
        security = provision(root / "security", ["flaps", FLYD_PART])

        async def bounded() -> None:
            async with asyncio.timeout(RUN_DEADLINE):
                await _measure(root, security, n, results)

        try:
            # The services' ready lines are for harnesses; the table is what this prints.
            with contextlib.redirect_stdout(io.StringIO()):
                asyncio.run(bounded())
        except Exception as err:
            results.errors.append(f"{type(err).__name__}: {err}")
    return report.finish(results, out, strict)


def main(argv: list[str] | None = None) -> int:
    return report.main(run, "auth_bench", __doc__, "300 creates each way instead of 3000", argv)


if __name__ == "__main__":
    sys.exit(main())
