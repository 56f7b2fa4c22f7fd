"""A real little fleet for flaps tests: flyd workers and flaps instances as processes."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest

from flaps.v1 import machines_pb2_grpc, platform_pb2, platform_pb2_grpc
from flyd.v1 import worker_pb2_grpc
from model.tokens import read_token
from nonomad.client import Client
from nonomad.security import ClusterSecurity
from runtime import ChannelTLS
from tests import host_ports
from tests.conftest import _kill_machines, remove_cgroups
from tests.harness import ServiceProcess, channel, clean_env, flyd_args


@dataclass
class Fleet:
    """Workers by id and flaps instances, plus stubs to talk to them.

    `env` is added to every process's environment (the `OTEL_*` settings of a trace receiver).
    With `security` (the default of the `fleet` fixture) the fleet runs as `nonomad up` runs
    one: workers serve the cluster's certificates only, flaps serves TLS and checks tokens
    (its cluster port for the parts), and the stubs here hold the admin token.
    """

    tmp: Path
    image_source: Path
    env: dict[str, str] = field(default_factory=dict)
    security: ClusterSecurity | None = None
    prefix: str = field(default_factory=lambda: f"nonomad-test-{uuid.uuid4().hex[:8]}")
    workers: dict[str, ServiceProcess] = field(default_factory=dict)
    flaps: list[ServiceProcess] = field(default_factory=list)
    channels: list[grpc.aio.Channel] = field(default_factory=list)

    def add_worker(
        self, worker_id: str, region: str, *extra: str, ports: str = ""
    ) -> ServiceProcess:
        """Spawn worker `worker_id`; `ports` ("LOW-HIGH") are its host ports for services
        (default: a block of 50 of its own). Workers added one after another boot side by
        side: reading one's `address` (as `add_flaps` does) waits until it is ready."""
        if not ports:
            ports = host_ports.flag(host_ports.block())
        args = flyd_args(
            self.tmp / worker_id,
            self.image_source,
            worker_id,
            region,
            "--ports",
            ports,
            "--cgroup-prefix",
            self.prefix,
            "--heartbeat-interval",
            "0.1",
            *(self.security.worker_args(worker_id) if self.security else ()),
            *extra,
        )
        proc = ServiceProcess(
            "flyd", args, self.tmp / f"{worker_id}.log", env=clean_env(**self.env)
        )
        self.workers[worker_id] = proc.spawn()
        return proc

    def add_flaps(self, *extra: str) -> ServiceProcess:
        """Start a flaps following every worker so far; it reads the workers' image source
        (as `nonomad up` runs it), so an image the app may not run is refused there."""
        args = [
            "--listen",
            "127.0.0.1:0",
            "--image-source",
            str(self.image_source),
            "--grace-period",
            "2",
            "--suspect-after",
            "0.5",
            "--dead-after",
            "1.0",
            *(self.security.flaps_args() if self.security else ()),
            *extra,
        ]
        for worker in self.workers.values():
            args += ["--workers", worker.address]
        proc = ServiceProcess(
            "flaps", args, self.tmp / f"flaps-{len(self.flaps)}.log", env=clean_env(**self.env)
        )
        self.flaps.append(proc.start())
        return proc

    def _channel(
        self, address: str, tls: ChannelTLS | None = None, token: str | None = None
    ) -> grpc.aio.Channel:
        made = channel(address, tls, token)
        self.channels.append(made)
        return made

    def _flaps_channel(self, i: int) -> grpc.aio.Channel:
        if self.security is None:
            return self._channel(self.flaps[i].address)
        token = read_token(self.security.admin_token)
        return self._channel(self.flaps[i].address, self.security.client_tls(), token)

    def machines(self, i: int = 0) -> machines_pb2_grpc.MachinesServiceStub:
        return machines_pb2_grpc.MachinesServiceStub(self._flaps_channel(i))

    def platform(self, i: int = 0) -> platform_pb2_grpc.PlatformServiceStub:
        return platform_pb2_grpc.PlatformServiceStub(self._flaps_channel(i))

    def worker(self, worker_id: str) -> worker_pb2_grpc.WorkerServiceStub:
        """A worker, called as flaps calls it: only flaps' certificate may (flyd.access)."""
        tls = self.security.member_tls("flaps") if self.security else None
        return worker_pb2_grpc.WorkerServiceStub(
            self._channel(self.workers[worker_id].address, tls)
        )

    def client(self, i: int = 0, **kwargs: Any) -> Client:
        """The SDK's client to flaps i, as the admin unless `token=` says (`kwargs` go to
        Client)."""
        if self.security is not None:
            kwargs.setdefault("tls", self.security.client_tls())
            if "token" not in kwargs:
                kwargs.setdefault("token_file", self.security.admin_token)
        return Client(self.flaps[i].address, **kwargs)

    async def until_alive(self, i: int = 0, deadline: float = 30.0) -> None:
        """Wait until flaps i sees every worker alive."""
        await eventually(lambda: self._all_alive(i), deadline, "every worker alive in flaps")

    async def _all_alive(self, i: int) -> bool:
        resp = await self.platform(i).ListWorkers(platform_pb2.ListWorkersRequest(), timeout=5)
        alive = {w.info.id for w in resp.workers if w.status == platform_pb2.WORKER_STATUS_ALIVE}
        return alive == set(self.workers)

    async def close(self) -> None:
        for open_channel in self.channels:
            await open_channel.close()
        for proc in [*self.flaps, *self.workers.values()]:
            proc.kill()
        for worker_id in self.workers:
            _kill_machines(self.tmp / worker_id)
        remove_cgroups(self.prefix)


async def eventually(check: Callable[[], Awaitable[bool]], deadline: float, what: str) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline
    while True:
        with contextlib.suppress(grpc.aio.AioRpcError):
            if await check():
                return
        if loop.time() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


@pytest.fixture
async def fleet(
    tmp_path: Path, image_source: Path, security: ClusterSecurity
) -> AsyncIterator[Fleet]:
    fleet = Fleet(tmp_path, image_source, security=security)
    try:
        yield fleet
    finally:
        await fleet.close()
