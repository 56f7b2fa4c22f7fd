"""Fixtures for the driver tests: real drivers of both kinds, on a run root of the test's own;
and for the worker tests: flyds in-process on a `Node` (a fake host and clock, an image source,
the log on the test's tmp_path), and `start_flyd`'s over both stores."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from flyd.drivers.base import ExitStatus, Handle
from flyd.drivers.oci import OciDriver
from flyd.drivers.process import ProcessDriver
from flyd.drivers.rundir import kill_all
from flyd.drivers.wrapped import WrappedDriver
from flyd.images.cache import ImageCache
from flyd.store import LmdbMachineLog, MachineLog, MemoryMachineLog
from model.images.source import ImageSource
from runtime.clock import ManualClock
from tests.conftest import remove_cgroups
from tests.flyd.driver_support import KINDS, OCI_UNAVAILABLE
from tests.flyd.support import Boot, Flyd, Node, RecordingHost, image_cache, image_source


@pytest.fixture
def prefix() -> Iterator[str]:
    """A cgroup prefix of this test's own, removed with everything in it afterwards."""
    name = f"nonomad-test-{uuid.uuid4().hex[:12]}"
    yield name
    remove_cgroups(name)


@pytest.fixture
def run_root(tmp_path: Path) -> Path:
    return tmp_path / "run"


@pytest.fixture
def image(tmp_path: Path) -> Path:
    """A machine's image: a bare directory (the host lends OCI machines its runtime)."""
    path = tmp_path / "image"
    path.mkdir()
    return path


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    if request.param == "oci" and OCI_UNAVAILABLE is not None:
        pytest.skip(f"crun cannot run here: {OCI_UNAVAILABLE}")
    return str(request.param)


@pytest.fixture
async def make_driver(
    kind: str, run_root: Path, prefix: str
) -> AsyncIterator[Callable[..., WrappedDriver]]:
    """Makes drivers of the test's kind on one run root; afterwards kills what is left."""
    drivers: list[WrappedDriver] = []

    def make(on_exit: Callable[[str, Handle, ExitStatus], None], **kwargs: object) -> WrappedDriver:
        options: dict[str, object] = {"cgroup_prefix": prefix, **kwargs}
        cls: type[WrappedDriver] = OciDriver if kind == "oci" else ProcessDriver
        driver = cls(run_root, on_exit=on_exit, **options)  # type: ignore[arg-type]
        drivers.append(driver)
        return driver

    yield make
    for driver in drivers:
        await driver.close()
    _kill_and_reap(run_root)


def _kill_and_reap(run_root: Path) -> None:
    # Wrappers are this process's children (a real flyd restart leaves them to init): reap
    # them, or their zombies would keep their cgroups busy.
    handles = []
    for handle_file in run_root.glob("*/handle.json"):
        with contextlib.suppress(OSError, ValueError):
            handles.append(Handle.from_dict(json.loads(handle_file.read_text())))
    kill_all(run_root)
    for handle in handles:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(handle.pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(handle.pid, 0)


@pytest.fixture(params=["memory", "lmdb"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[MachineLog]:
    log: MachineLog = (
        MemoryMachineLog() if request.param == "memory" else LmdbMachineLog(tmp_path / "log")
    )
    yield log
    log.close()


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def host(clock: ManualClock) -> RecordingHost:
    return RecordingHost(clock)


@pytest.fixture
def source(tmp_path: Path) -> ImageSource:
    """The image source of the test's flyds: `app:v1` (support.image_source)."""
    return image_source(tmp_path)


@pytest.fixture
async def node(
    tmp_path: Path, clock: ManualClock, host: RecordingHost, source: ImageSource
) -> AsyncIterator[Node]:
    """Where the test boots (and reboots) flyds in-process, on its tmp_path; afterwards every
    flyd still alive is killed."""
    node = Node(tmp_path, clock, host, source)
    yield node
    await node.kill_all()


@pytest.fixture
def images(node: Node) -> ImageCache:
    """The image cache every flyd of `start_flyd` shares."""
    return image_cache(node.root, node.source)


@pytest.fixture
async def start_flyd(store: MachineLog, node: Node, images: ImageCache) -> AsyncIterator[Boot]:
    """Boots a recovered flyd on the test's store and host; settings can be overridden."""

    def start(**overrides: Any) -> Flyd:
        return node.boot(store=store, images=images, **overrides)

    yield start
    await node.kill_all()  # before the store closes


@pytest.fixture
def flyd(start_flyd: Boot) -> Flyd:
    return start_flyd()


@pytest.fixture
def host_listener() -> Iterator[int]:
    """A stand-in for flaps, the registry or the proxy: a socket listening on the host's
    loopback, as they do (no real flaps runs here; flyd's own port is the real service probed).
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]
