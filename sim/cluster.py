"""A whole cluster in one World: flyd workers, flaps and proxies, composed by the services' own
wiring (`flyd.main.compose`, `flaps.main.compose`, `proxy.main.compose`) from the flags a user
would pass, on simulated disks, hosts and network. A proxy runs its control plane (its
replica, the router's failover and supersedes through flaps), not its HTTP edge.

What a host is outlives its flyd, as on a real worker: its disk (the machine log), its machines
(a `FakeHost` on the world's clock) and its secrets key. Killing a flyd drops its node (no
`finally` runs), resets its connections and loses its disk's unsynced batches; booting it again
composes a new flyd on the same host, which recovers from what was synced.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from flaps import main as flaps_main
from flaps.settings import FlapsSettings
from flaps.v1 import platform_pb2, platform_pb2_grpc
from flyd import main as flyd_main
from flyd.fakes import FakeDriver, FakeHost
from flyd.images.build import build_image
from flyd.images.cache import ImageCache
from flyd.secrets import SecretBox
from flyd.settings import FlydSettings
from flyd.worker import Worker
from model.images.owners import PUBLIC
from model.images.source import ImageSource
from proxy import main as proxy_main
from proxy.settings import ProxySettings
from runtime import Service, load_settings, transport
from sim.disk import DiskFaults, SimDisk
from sim.net import Network
from sim.world import Node, SimulationError, World

T = TypeVar("T")

IMAGE = "app:v1"
"""The one image every simulated machine runs (the fake driver runs nothing of it)."""

READY_TIMEOUT = 30.0
"""Virtual seconds a booting service has to serve."""


class BootFailed(SimulationError):
    """A service exited as it started (as a real one would, to be started again)."""


@dataclass
class Host:
    """One worker host: what outlives every flyd booted on it."""

    name: str
    region: str
    root: Path
    disk: SimDisk
    machines: FakeHost
    flyd: Flyd | None = None
    boots: int = 0


@dataclass
class Flyd:
    """A flyd running on a host: its node, its service and its worker."""

    node: Node
    service: Service
    worker: Worker
    address: str
    task: Any = field(repr=False)


@dataclass
class Part:
    """A flaps or a proxy: its node, its service, where it serves, the task running it."""

    node: Node
    service: Service
    address: str
    task: Any = field(repr=False)


class Cluster:
    """Workers and flaps of one seed. `root`: a directory of the run's own (image source,
    image caches, secrets keys), gone with the run."""

    def __init__(self, world: World, root: Path, *, disk_faults: DiskFaults | None = None) -> None:
        self.world = world
        self.root = root
        self.net = Network(world)
        self.hosts: dict[str, Host] = {}
        self.flaps: dict[str, Part] = {}
        self.proxies: dict[str, Part] = {}
        self._disk_faults = disk_faults
        self.images = _image_source(root / "images")

    # -- flaps --

    def boot_flaps(self, name: str = "flaps-1", *flags: str, skew: float = 0.0) -> Part:
        """A flaps node, following the workers booted so far (later ones announce to it);
        its clocks run `skew` seconds ahead of the world's."""
        node, ip, workers = self._join(name, skew)
        settings = load_settings(
            FlapsSettings,
            # A key waits for a silent worker longer than any run: the checkers hold flaps to
            # one machine per key, not to the bound --key-doubt sets.
            [
                f"--listen={ip}:0",
                "--dead-after=5",
                "--suspect-after=2",
                "--key-doubt=600",
                *workers,
                *flags,
            ],
            prog="flaps",
        )
        service = self.world.run(
            node, _compose(lambda: flaps_main.compose(settings, _flaps_parts(node)))
        )
        flaps = self.flaps[name] = Part(node, service, *self._serve(node, service))
        return flaps

    def _join(self, name: str, skew: float) -> tuple[Node, str, list[str]]:
        """A new node on the network: it, its address, and --workers flags for the workers
        running now (those booted later announce to it)."""
        node = self.world.add(name, skew=skew)
        ip = self.net.join(node)
        return node, ip, [f"--workers={h.flyd.address}" for h in self.hosts.values() if h.flyd]

    def boot_proxy(self, name: str = "proxy-1", *flags: str, skew: float = 0.0) -> Part:
        """A proxy's control plane, following the workers booted so far (later ones announce
        to it) and acting through the first flaps."""
        node, ip, workers = self._join(name, skew)
        settings = load_settings(
            ProxySettings,
            [
                f"--listen={ip}:0",
                f"--flaps={self.flaps['flaps-1'].address}",
                "--region=ams",
                "--dead-after=5",
                "--suspect-after=2",
                *workers,
                *flags,
            ],
            prog="proxy",
        )
        parts = proxy_main.Parts(clock=node.clock, entropy=node.entropy, http=False)
        service = self.world.run(node, proxy_main.compose(settings, parts))
        proxy = self.proxies[name] = Part(node, service, *self._serve(node, service))
        return proxy

    def _serve(self, node: Node, service: Service) -> tuple[str, Any]:
        """Run a composed service on its node until it serves: its address, and its task."""
        task = node.spawn(service.run(handle_signals=False), name=f"{node.name}/run")
        return self.world.run(node, service.wait_ready(), timeout=READY_TIMEOUT), task

    # -- workers --

    def add_host(self, name: str, region: str = "ams") -> Host:
        if name in self.hosts:
            raise SimulationError(f"host {name} exists already")
        root = self.root / "hosts" / name
        root.mkdir(parents=True)
        disk = SimDisk(
            name,
            self.world.entropy.child(f"disk/{name}").rng(),
            self.world.entropy.child(f"epoch/{name}"),
            faults=self._disk_faults,
        )
        host = self.hosts[name] = Host(name, region, root, disk, FakeHost(self.world.clock))
        return host

    def boot_flyd(self, host: Host, *flags: str, skew: float = 0.0) -> Flyd:
        """A new flyd process on `host`: it recovers from the disk and announces itself to
        every flaps. Its clocks run `skew` seconds ahead of the world's (behind, if negative),
        as a host's clock that NTP keeps near, not at, the others'."""
        if host.flyd is not None:
            raise SimulationError(f"flyd on {host.name} is running")
        host.boots += 1
        node = self.world.add(f"flyd-{host.name}", skew=skew)
        ip = self.net.join(node)
        replicas = [f.address for f in self.flaps.values()]
        replicas += [p.address for p in self.proxies.values()]
        announce = [f"--announce={address}" for address in replicas]
        settings = load_settings(
            FlydSettings,
            [
                f"--listen={ip}:0",
                f"--worker-id={host.name}",
                f"--region={host.region}",
                f"--data-dir={host.root}",
                f"--image-source={self.images.root}",
                "--heartbeat-interval=0.5",
                "--announce-interval=2",
                *announce,
                *flags,
            ],
            prog="flyd",
        )
        parts = flyd_main.Parts(
            store=host.disk.open_log(),
            images=ImageCache(host.root / "images", self.images, max_bytes=1 << 30),
            make_driver=lambda on_exit: FakeDriver(on_exit=on_exit, host=host.machines),
            secret_box=SecretBox.load(host.root / "secrets.key"),
            boot_id=node.entropy.token_hex(8),
            clock=node.clock,
            entropy=node.entropy,
            monotonic=node.loop.time,
            commit_writer=host.disk.writer(node.loop),
        )
        try:
            service, worker = self.world.run(
                node, _compose(lambda: flyd_main.compose(settings, parts))
            )
            address, task = self._serve(node, service)
        except Exception as err:  # (its disk failed it at start, say): the process exits
            self.world.kill(node.name)
            self.net.crash(node.name)
            host.disk.crash()
            raise BootFailed(f"flyd on {host.name} did not start: {err!r}") from err
        host.flyd = Flyd(node, service, worker, address, task)
        return host.flyd

    def kill_flyd(self, host: Host) -> None:
        """SIGKILL flyd on `host`: its machines go on running, its unsynced batches are lost."""
        if host.flyd is None:
            raise SimulationError(f"flyd on {host.name} is not running")
        name = host.flyd.node.name
        self.world.kill(name)
        self.net.crash(name)
        host.disk.crash()
        host.flyd = None

    # -- the cluster's users --

    def user(self) -> Node:
        """The node the cluster's users call from (the CLI, the SDK), on the network."""
        node = self.world.nodes.get("user")
        if node is None:
            node = self.world.add("user")
            self.net.join(node)
        return node

    def stub(self, stub: Callable[[Any], T], address: str) -> T:
        """A gRPC stub on `address`, for a coroutine that runs on `user()`."""
        channel = transport.current().channel(
            address, credentials=None, options=(), interceptors=None
        )
        return stub(channel)

    def workers_seen(self, flaps: str = "flaps-1") -> dict[str, int]:
        """The workers `flaps` lists, with their status."""

        async def call() -> dict[str, int]:
            platform = self.stub(platform_pb2_grpc.PlatformServiceStub, self.flaps[flaps].address)
            answer = await platform.ListWorkers(platform_pb2.ListWorkersRequest(), timeout=10.0)
            return {w.info.id: w.status for w in answer.workers}

        return self.world.run(self.user(), call())

    def settle(self, check: Callable[[], bool], seconds: float = 30.0, what: str = "") -> None:
        """Run the world until `check()` holds, looking every half second; SimulationError
        when it does not within `seconds` of virtual time."""
        deadline = self.world.now + seconds
        while not check():
            if self.world.now >= deadline:
                raise SimulationError(f"not within {seconds}s: {what or check}")
            self.world.run_for(0.5)

    def close(self) -> None:
        """The run is over: fence every disk, then end every node's tasks."""
        for host in self.hosts.values():
            host.disk.crash()
            host.disk.release()
        self.world.close()


async def _compose(build: Any) -> Any:
    """Compose a service on its node (its tasks, channels and servers are that node's)."""
    return build()


def _flaps_parts(node: Node) -> flaps_main.Parts:
    return flaps_main.Parts(clock=node.clock, entropy=node.entropy)


def _image_source(root: Path) -> ImageSource:
    src = root / "src"
    src.mkdir(parents=True)
    (src / "app").write_text("#!/bin/sh\n")
    name, _, tag = IMAGE.partition(":")
    build_image(src, root / "source", name=name, tag=tag, entrypoint=["app"], owners=PUBLIC)
    return ImageSource(root / "source")


@contextlib.contextmanager
def cluster(seed: int, root: Path, **kwargs: Any) -> Any:
    """A Cluster on a new World of `seed`, closed at the end."""
    made = Cluster(World(seed), root, **kwargs)
    try:
        yield made
    finally:
        made.close()
