"""The flyd console script: one worker daemon."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import grpc
import structlog
from opentelemetry import trace

from flyd import fsm
from flyd.access import WORKER_ACCESS
from flyd.commits import Writer
from flyd.drivers.base import Driver, ExitStatus, Handle
from flyd.drivers.fdlimit import machines_within, raise_nofile
from flyd.drivers.oci import OciDriver
from flyd.drivers.oci import probe as oci_probe
from flyd.drivers.process import ProcessDriver
from flyd.fencing import GrpcPeers
from flyd.images.cache import ImageCache
from flyd.metrics import register_worker
from flyd.secrets import SecretBox
from flyd.service import LIMITS, WorkerServicer, map_error
from flyd.settings import FlydSettings
from flyd.store import LmdbMachineLog, MachineLog
from flyd.traces import OpTracer
from flyd.v1 import machine_pb2 as pb
from flyd.v1 import worker_pb2, worker_pb2_grpc
from flyd.worker import Identity, Worker
from model.errors import InvalidArgument, Unavailable
from model.images.source import ImageSource
from model.validate import CONFIG_LIMITS, DISK_LABEL, EGRESS_LABEL
from registry.v1 import registry_pb2, registry_pb2_grpc
from runtime import (
    Service,
    access,
    aio_channel,
    configure_logging,
    main_entry,
    settings_or_exit,
    setup_tracing,
    tracing_enabled,
    use_event_loop,
)
from runtime.clock import SYSTEM_CLOCK, Clock
from runtime.entropy import SYSTEM, Entropy
from runtime.heap import no_full_collections

log = structlog.get_logger("flyd")
ANNOUNCE_TIMEOUT = 2.0
# How often machine logs no copier bounds are checked against their size bound, image recency
# saved, and lazy row changes (a released process's finished start) committed if no other
# commit carried them.
LOG_ROTATE_INTERVAL = 1.0


def make_driver(
    settings: FlydSettings, on_exit: Callable[[str, Handle, ExitStatus], None]
) -> Driver:
    """The driver `settings.driver` names; `auto` is oci where this host can run it (crun and
    cgroup v1 limits), else process with the reason logged. `oci` where it cannot: exits, saying
    why.
    """
    choice = settings.driver
    if choice == "auto":
        problem = oci_probe(settings.cgroup_root)
        choice = "oci" if problem is None else "process"
        if problem is not None:
            _fall_back(problem)
    common: dict[str, Any] = {
        "on_exit": on_exit,
        "cgroup_root": settings.cgroup_root,
        "cgroup_prefix": settings.cgroup_prefix,
        "max_log_bytes": settings.log_max_bytes,
        "log_backups": settings.log_backups,
        "machine_host": settings.machine_host,
    }
    if choice == "oci":
        if settings.run_as is not None:
            raise SystemExit("flyd: run_as is for the process driver; oci machines get uid ranges")
        try:
            driver = OciDriver(
                settings.data_dir / "machines",
                network=settings.network,
                uid_base=settings.uid_base,
                egress_via=settings.egress_via,
                route_machines=settings.route_machines,
                **common,
            )
        except (Unavailable, InvalidArgument) as e:  # (a machine_host not of this host, ...)
            raise SystemExit(f"flyd: {e}") from None
        if settings.capacity.machines > driver.max_machines:
            raise SystemExit(
                f"flyd: capacity.machines is {settings.capacity.machines}, but network "
                f"{settings.network} and uid_base leave room for {driver.max_machines} machines"
            )
        return driver
    if settings.route_machines:
        log.warning(
            "route_machines_unused",
            message="process machines share the host's network: their host ports are reached",
        )
    if settings.egress_via is not None:
        log.warning(
            "egress_via_unused",
            message="process machines share the host's network: egress_via does not apply",
        )
    return ProcessDriver(settings.data_dir / "machines", run_as=settings.run_as, **common)


def _fall_back(problem: str) -> None:
    log.warning(
        "driver_process", reason=problem, message=f"machines run as host processes: {problem}"
    )


def descriptor_budget(settings: FlydSettings) -> None:
    """Raise flyd's descriptor limit as far as the host allows (netd, started by flyd,
    inherits it) and take no more machines than it holds (`flyd.drivers.fdlimit`)."""
    limit = raise_nofile()
    ports = CONFIG_LIMITS.counts["flyd.v1.MachineConfig.services"]
    fit = machines_within(limit, settings.capacity.machines, ports=ports)
    if fit == 0:
        raise SystemExit(f"flyd: a descriptor limit of {limit} holds no machine (ulimit -n)")
    if fit < settings.capacity.machines:
        log.warning(
            "capacity_machines_lowered",
            machines=fit,
            asked=settings.capacity.machines,
            nofile=limit,
            message=f"the descriptor limit ({limit}, ulimit -n) holds {fit} machines, not "
            f"{settings.capacity.machines}: this worker takes {fit}",
        )
        settings.capacity.machines = fit
    log.info("descriptors", nofile=limit, machines=settings.capacity.machines)


@dataclass
class Parts:
    """What a flyd is built of besides its settings. The production wiring (`build`) opens
    the real ones: the LMDB log in its data dir, the image cache, the host's driver, the system
    clock and randomness. A simulated worker (sim) brings its own: a log on a simulated disk,
    a fake driver on a fake host, its node's clock and seeded draws."""

    store: MachineLog
    images: ImageCache
    make_driver: Callable[[Callable[[str, Handle, ExitStatus], None]], Driver]
    secret_box: SecretBox
    boot_id: str
    clock: Clock = SYSTEM_CLOCK
    entropy: Entropy = SYSTEM
    monotonic: Callable[[], float] = time.monotonic
    commit_writer: Writer | None = None


async def build(argv: list[str]) -> Service:
    """The flyd of this process: its settings, logging and tracing, the host's parts."""
    settings = settings_or_exit(FlydSettings, argv, "flyd")
    configure_logging("flyd", settings.log_level, worker=settings.worker_id, region=settings.region)
    setup_tracing("flyd", **{"nonomad.worker": settings.worker_id, "cloud.region": settings.region})
    # Ignored dispositions survive exec and the machines' sh wrapper cannot undo them: a flyd
    # started in the background by a shell must not hand SIGINT/SIGQUIT-deafness to machines.
    for sig in (signal.SIGINT, signal.SIGQUIT, signal.SIGHUP):
        if signal.getsignal(sig) == signal.SIG_IGN:
            signal.signal(sig, signal.SIG_DFL)
    descriptor_budget(settings)
    data = settings.data_dir
    data.mkdir(parents=True, exist_ok=True)
    parts = Parts(
        store=LmdbMachineLog(data / "log"),
        images=ImageCache(
            data / "images",
            ImageSource(settings.image_source),
            max_bytes=settings.image_cache_bytes,
        ),
        make_driver=partial(make_driver, settings),
        # Machine secrets stay sealed in the log with this worker's own key.
        secret_box=SecretBox.load(data / "secrets.key"),
        boot_id=secrets.token_hex(8),
    )
    service, worker = compose(settings, parts)
    register_worker(worker)  # gauges read at scrape time (one worker per process)
    return service


def compose(settings: FlydSettings, parts: Parts) -> tuple[Service, Worker]:
    """Open the log, recover every machine, and wire the gRPC service: the one wiring the
    production flyd and a simulated one share."""
    store, images = parts.store, parts.images
    service = Service("flyd", settings)
    identity = Identity(
        worker_id=settings.worker_id,
        region=settings.region,
        address=settings.advertise or "",
        labels=dict(settings.labels),
        boot_id=parts.boot_id,
    )
    worker: Worker | None = None

    def on_exit(machine_id: str, handle: Handle, status: ExitStatus) -> None:
        if worker is not None:
            worker.on_exit(machine_id, handle, status)

    driver = parts.make_driver(on_exit)
    log.info("driver", driver=driver.name, limits_enforced=driver.limits_enforced)
    if driver.egress_refusal is None:  # flaps sends machines that ask for egress only here
        identity.labels[EGRESS_LABEL] = "true"
    if driver.disk_limited:
        identity.labels[DISK_LABEL] = "limited"
    worker = Worker(
        identity=identity,
        store=store,
        driver=driver,
        images=images,
        capacity=settings.capacity,
        ports=settings.port_range(),
        machine_host=settings.machine_host,
        clock=parts.clock,
        policy=fsm.Policy(
            window=settings.restart_window, default_max_retries=settings.restart_max_retries
        ),
        log_keep=settings.log_keep,
        state_dir=settings.data_dir,
        # Spans of machine operations only while tracing is on: off, the steps run none of it.
        op_tracer=OpTracer(trace.get_tracer("flyd"), settings.worker_id)
        if tracing_enabled()
        else None,
        # A returning worker asks the replicas it announces to who else is in its slots.
        peers=GrpcPeers(settings.announce, partial(aio_channel, tls=settings.cluster_tls))
        if settings.announce
        else None,
        fence_after=settings.fence_after,
        ready_grace=settings.ready_grace,
        ready_settle=settings.ready_settle,
        secret_box=parts.secret_box,
        monotonic=parts.monotonic,
        entropy=parts.entropy,
        commit_writer=parts.commit_writer,
    )
    servicer = WorkerServicer(
        worker,
        heartbeat_interval=settings.heartbeat_interval,
        draining=service.draining,
        log_read_bytes=settings.log_read_bytes,
        streams_per_caller=settings.streams_per_caller,
    )
    # Over TLS, each RPC only for the parts whose role may call it (flyd.access).
    access.add(
        service,
        WORKER_ACCESS,
        servicer,
        worker_pb2_grpc.add_WorkerServiceServicer_to_server,
        worker_pb2.DESCRIPTOR.services_by_name["WorkerService"],
        map_error,
        LIMITS,
    )

    # Recovered before the server serves: a call answered from rows not loaded yet would
    # miss a machine the log holds (a create under its idempotency key made again, capacity
    # reserved twice). The simulator found that window (sim, tests/sim/test_cluster.py).
    worker.recover()

    async def run_worker(shutdown: asyncio.Event) -> None:
        assert worker is not None
        if not identity.address:
            identity.address = await service.wait_ready()
        while not shutdown.is_set():
            await worker.flush()
            await asyncio.to_thread(driver.rotate_logs)  # it lists every run dir
            images.flush()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(shutdown.wait(), LOG_ROTATE_INTERVAL)

    async def announce(shutdown: asyncio.Event) -> None:
        """Tell the configured replicas who this worker is, now and every so often.

        Replicas follow a worker once they know it; repeating the announcement lets replicas
        that restarted, or started later, learn of it without anyone restarting anything.
        """
        address = await service.wait_ready()
        info = pb.WorkerInfo(
            id=identity.worker_id,
            region=identity.region,
            address=identity.address or address,
            labels=identity.labels,
            boot_id=identity.boot_id,
        )
        tls = settings.cluster_tls
        channels = {target: aio_channel(target, tls=tls) for target in settings.announce}
        try:
            while not shutdown.is_set():
                for target, channel in channels.items():
                    stub = registry_pb2_grpc.RegistryServiceStub(channel)
                    try:
                        await stub.Announce(
                            registry_pb2.AnnounceRequest(worker=info), timeout=ANNOUNCE_TIMEOUT
                        )
                    except grpc.aio.AioRpcError as err:
                        log.info("announce failed", target=target, code=err.code().name)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(shutdown.wait(), settings.announce_interval)
        finally:
            for channel in channels.values():
                await channel.close()

    async def close() -> None:
        assert worker is not None
        await worker.close(flush=True)  # the lazy rows are committed, the log's writer stops
        await driver.close()  # stops watching; the machines keep running
        images.flush()
        store.close()

    async def fencing(shutdown: asyncio.Event) -> None:
        assert worker is not None
        await asyncio.gather(worker.fencing.run(shutdown), worker.fencing.tick(shutdown))

    service.spawn("worker", run_worker)
    service.spawn("fencing", fencing)
    service.spawn("readiness", worker.readiness.run)
    if settings.announce:
        service.spawn("announce", announce)
    service.on_shutdown(close)
    return service, worker


def main() -> None:
    # Process-wide choices, made before the loop runs (build() reads the settings again in
    # it): the event loop, and a cycle collector that never walks the old objects.
    no_full_collections()
    use_event_loop(settings_or_exit(FlydSettings, sys.argv[1:], "flyd").event_loop)
    main_entry(build)


if __name__ == "__main__":
    main()
