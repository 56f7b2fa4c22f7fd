"""Fixtures for flyd tests that run real flyd processes, and for pytest-grpc-aio's servicers."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import structlog
from pytest_grpc_aio.plugin import GrpcContext

from flyd.drivers.cgroups import remove_tree
from flyd.drivers.rundir import kill_all
from flyd.images.build import build_image
from flyd.v1 import worker_pb2_grpc
from model.images.owners import PUBLIC
from nonomad.security import ClusterSecurity, provision
from tests import host_ports
from tests.harness import ServiceProcess, clean_env, flyd_args

# Which tests `make test` runs together on one xdist worker.
pytest_plugins = ["tests.xdist_groups"]


@pytest.fixture(autouse=True)
def _fresh_structlog() -> Iterator[None]:
    """Each test starts with structlog as a new process has it: a test that configures it (or
    uses `structlog.testing.capture_logs`, which marks it configured) must not change how an
    in-process CLI command of a later test decides to set up its own logging."""
    structlog.reset_defaults()
    yield
    structlog.reset_defaults()


DEMO_APP = """\
import http.server, os, sys

class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = f"hello from {os.environ['MACHINE_ID']}\\n".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, fmt, *args):
        print("request", self.path, flush=True)

print("listening on", os.environ["PORT"], flush=True)
http.server.ThreadingHTTPServer(("0.0.0.0", int(os.environ["PORT"])), Handler).serve_forever()
"""


@pytest.fixture(scope="session")
def security(tmp_path_factory: pytest.TempPathFactory) -> ClusterSecurity:
    """One cluster CA, certificates (each in its role; a worker's, `flyd-<worker id>`, made
    when it starts: `worker_args`), token root keys and an admin token for the whole session,
    made once: what `nonomad up` makes for a cluster."""
    return provision(tmp_path_factory.mktemp("security"), ["flaps", "proxy", "registry", "console"])


@pytest.fixture(scope="session")
def image_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An image source with `demo:v1`: a tiny HTTP server on $PORT, public (every app of a
    test may run it; `nonomad up` builds its own, the demo app's)."""
    root = tmp_path_factory.mktemp("images")
    src = tmp_path_factory.mktemp("demo-src")
    (src / "app.py").write_text(DEMO_APP)
    build_image(
        src, root, name="demo", tag="v1", entrypoint=["python3", "-u", "app.py"], owners=PUBLIC
    )
    return root


def remove_cgroup(cg: Path) -> None:
    """Remove one of a test's cgroups, killing what is still in it and waiting for it to leave."""
    if not remove_tree(cg):
        raise AssertionError(f"cgroup {cg} stays busy")


def remove_cgroups(prefix: str) -> None:
    """Remove the cgroups a test's workers made under `prefix`, and the prefix itself."""
    for controller in ("memory", "cpu", "pids"):
        base = Path("/sys/fs/cgroup") / controller / prefix
        if base.is_dir():
            for child in [p for p in base.iterdir() if p.is_dir()]:
                remove_cgroup(child)
            remove_cgroup(base)


def _kill_machines(data_dir: Path) -> None:
    """Whatever machines a test left running die with it."""
    kill_all(data_dir / "machines")


@contextlib.contextmanager
def one_flyd(tmp: Path, image_source: Path) -> Iterator[ServiceProcess]:
    """A flyd worker w1 in ams for a whole test module, on a block of host ports of its own;
    its machines die with it."""
    prefix = f"nonomad-test-{uuid.uuid4().hex[:8]}"
    proc = ServiceProcess(
        "flyd",
        flyd_args(
            tmp / "data",
            image_source,
            "w1",
            "ams",
            "--ports",
            host_ports.flag(host_ports.block()),
            "--cgroup-prefix",
            prefix,
        ),
        tmp / "flyd.log",
        env=clean_env(),
    ).start()
    try:
        yield proc
    finally:
        proc.kill()
        _kill_machines(tmp / "data")
        remove_cgroups(prefix)


@pytest.fixture
def flyd_factory(tmp_path: Path, image_source: Path) -> Iterator[Callable[..., ServiceProcess]]:
    """Start real flyd processes; each call makes a new worker unless `data_dir` is reused."""
    started: list[ServiceProcess] = []
    data_dirs: list[Path] = []
    prefix = f"nonomad-test-{uuid.uuid4().hex[:8]}"

    def start(*extra: str, worker_id: str = "w1", data_dir: Path | None = None) -> ServiceProcess:
        if data_dir is None:
            data_dir = tmp_path / f"flyd-{worker_id}"
        args = flyd_args(
            data_dir,
            image_source,
            worker_id,
            "ams",
            "--ports",
            host_ports.flag(host_ports.block()),
            "--cgroup-prefix",
            prefix,
            "--heartbeat-interval",
            "0.1",
            *extra,
        )
        proc = ServiceProcess("flyd", args, tmp_path / f"{worker_id}.log", env=clean_env())
        started.append(proc.start())
        data_dirs.append(data_dir)
        return proc

    yield start
    for proc in started:
        proc.kill()
    for data_dir in data_dirs:
        _kill_machines(data_dir)
    remove_cgroups(prefix)


@pytest.fixture
async def stub_for() -> AsyncIterator[Callable[[str], worker_pb2_grpc.WorkerServiceStub]]:
    """gRPC stubs to flyd addresses; channels are closed at the end."""
    channels: list[grpc.aio.Channel] = []

    def make(address: str) -> worker_pb2_grpc.WorkerServiceStub:
        channel = grpc.aio.insecure_channel(address)
        channels.append(channel)
        return worker_pb2_grpc.WorkerServiceStub(channel)

    yield make
    for channel in channels:
        await channel.close()


# -- pytest-grpc-aio: the in-process servicer tests (tests/servicers.py) ----------------------


@pytest.fixture
def grpc_addr(grpc_context: GrpcContext) -> str:
    """Where pytest-grpc-aio serves the servicer under test: an abstract unix socket of its own.

    Replaces the plugin's own, which binds a TCP socket to find a free port and never closes
    it (a ResourceWarning: an error under `filterwarnings = error`); its server, built without
    options (SO_REUSEPORT on), could also share that port silently with another test run's.
    """
    address = f"unix-abstract:nonomad-test-{uuid.uuid4().hex}"
    grpc_context.addr = address
    return address


@pytest.fixture
async def servicer_stub(grpc_aio_stub: Any, grpc_context: GrpcContext) -> AsyncIterator[Any]:
    """A stub (the module's `grpc_stub_cls`) to the module's `grpc_servicer`, served by
    pytest-grpc-aio for this test. The plugin leaves its channel open; it is closed here,
    before its server stops."""
    async with grpc_aio_stub() as stub:
        yield stub
        if grpc_context.channel is not None:
            await grpc_context.channel.close()
