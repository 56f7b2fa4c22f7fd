"""Proxy benchmark: the processes measured, each in its own process.

The backend (a small keep-alive HTTP server), nonomad's proxy in front of it
(`proxy.http.HttpProxy` with a static router, optionally with a probe that times its own
callbacks), and HAProxy configured the same way (installed with apt-get when missing, as is
wrk: `ensure_tool`). Python children print their port and run until their stdin closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import procs
from proxy.settings import ProxySettings

DOMAIN = "nonomad.test"
START_WAIT = 15.0

_BACKEND_BODY = b"hello from the bench backend\n"
_BACKEND_RESPONSE = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n\r\n%b"
    % (len(_BACKEND_BODY), _BACKEND_BODY)
)


class _BackendProtocol(asyncio.Protocol):
    """Answers every request (GETs without bodies) with the same small response."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        buf = self.buf + data if self.buf else data
        n = buf.count(b"\r\n\r\n")
        if n:
            assert self.transport is not None
            self.transport.write(_BACKEND_RESPONSE * n)
            buf = buf[buf.rfind(b"\r\n\r\n") + 4 :]
        self.buf = buf


async def _serve_until_stdin_closes(start: Callable[[], Any]) -> None:
    port = await start()
    print(port, flush=True)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    await reader.read()  # EOF: the bench is done with us


def backend_main() -> None:
    """Child process: the backend. Prints its port; runs until stdin closes."""

    async def start() -> int:
        server = await asyncio.get_running_loop().create_server(
            _BackendProtocol, "127.0.0.1", 0, backlog=1024
        )
        return int(server.sockets[0].getsockname()[1])

    asyncio.run(_serve_until_stdin_closes(start))


class StaticRouter:
    """A router with one machine for every app: the data plane's cost alone."""

    def __init__(self, port: int) -> None:
        from proxy.routing import Backend

        self.backend = Backend("bench-machine", "bench", "bench-worker", "ams", "127.0.0.1", port)

    async def acquire(
        self, app: str, *, pinned: str | None = None, exclude: frozenset[str] = frozenset()
    ) -> Any:
        return self.backend

    def try_acquire(
        self, app: str, *, pinned: str | None = None, exclude: frozenset[str] = frozenset()
    ) -> Any:
        return self.backend

    def release(self, backend: Any, *, ok: bool, connect_failed: bool = False) -> None:
        pass


def proxy_main() -> None:
    """Child process: nonomad's proxy in front of the backend port in argv[1], on the event
    loop named in argv[2] (default: the proxy's default, as `nonomad-proxy` runs it)."""
    import logging

    import structlog

    from proxy.http import HttpProxy
    from proxy.stats import Stats
    from runtime import use_event_loop

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    backend_port = int(sys.argv[1])
    default_loop = ProxySettings.model_fields["event_loop"].default
    use_event_loop(sys.argv[2] if len(sys.argv) > 2 else default_loop)

    probe = os.environ.get(PROBE_ENV)
    if probe:
        _install_probe(Path(probe))

    async def start() -> int:
        proxy = HttpProxy(StaticRouter(backend_port), Stats(), domain=DOMAIN, region="ams")
        _, port = await proxy.serve("127.0.0.1", 0)
        return port

    asyncio.run(_serve_until_stdin_closes(start))


PROBE_ENV = "NONOMAD_PROXY_BENCH_PROBE"


def _install_probe(path: Path) -> None:
    """(`--section latency --probe` only) Time the proxy's own callbacks with perf_counter: a
    client's request bytes in, the machine's answer bytes in (and written on), so the latency
    the load generator sees can be split into the proxy's work, the machine's, and the rest
    (waiting to be scheduled, or behind other callbacks). SIGUSR1 writes what was recorded
    since the last one to `path` (JSON) and starts afresh."""

    from proxy.forward import Client
    from proxy.upstream import Upstream

    clock = time.perf_counter
    started: dict[int, float] = {}
    sent: dict[int, float] = {}
    rows: list[tuple[float, float, float, float]] = []  # client cb start/end, upstream cb start/end
    client_received = Client.data_received
    upstream_received = Upstream.data_received

    def on_client_data(self: Any, data: bytes) -> None:
        t0 = clock()
        client_received(self, data)
        started[id(self)] = t0
        sent[id(self)] = clock()

    def on_upstream_data(self: Any, data: bytes) -> None:
        client = self.client
        t0 = clock()
        upstream_received(self, data)
        t1 = clock()
        if client is not None and id(client) in started:
            rows.append((started.pop(id(client)), sent.pop(id(client)), t0, t1))

    def dump(signum: int, frame: Any) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(rows))
        tmp.rename(path)
        rows.clear()

    Client.data_received = on_client_data  # type: ignore[method-assign]
    Upstream.data_received = on_upstream_data  # type: ignore[method-assign]
    signal.signal(signal.SIGUSR1, dump)


@dataclass
class Child:
    """A child process that printed the port it serves on."""

    name: str
    proc: subprocess.Popen[bytes]
    port: int

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        with contextlib.suppress(ProcessLookupError):
            self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def start_python_child(
    name: str, func: str, args: Sequence[str], log: Path, env: dict[str, str] | None = None
) -> Child:
    with open(log, "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-c", f"from bench.proxy_children import {func}; {func}()", *args],
            cwd=procs.REPO_ROOT,
            env={**procs.clean_env(), **(env or {})},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
        )
    assert proc.stdout is not None
    line = proc.stdout.readline()  # bounded: the child prints its port or dies
    if not line.strip():
        proc.kill()
        proc.wait(5)
        raise RuntimeError(f"{name} failed to start; see {log}")
    return Child(name, proc, int(line))


def ensure_tool(binary: str, package: str) -> str | None:
    """The path of `binary`, installing Debian's `package` (as root) when it is missing."""
    path = _which(binary)
    if path is not None:
        return path
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return None
    procs.progress(f"installing {package} with apt-get")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", package]
    ok = subprocess.run(install, env=env, capture_output=True, timeout=300).returncode == 0
    if not ok:
        subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True, timeout=300)
        subprocess.run(install, env=env, capture_output=True, timeout=300)
    return _which(binary)


def _which(binary: str) -> str | None:
    sbin = Path("/usr/sbin") / binary  # not on every PATH
    return shutil.which(binary) or (str(sbin) if sbin.exists() else None)


_HAPROXY_CONFIG = """\
global
    maxconn 4096
    nbthread 1
    log stdout format raw local0 err

defaults
    mode http
    timeout connect 2s
    timeout client 60s
    timeout server 60s
    timeout http-keep-alive 60s
    timeout http-request 10s
    option http-keep-alive
    http-reuse always

frontend bench
    bind 127.0.0.1:{port}
    default_backend machines

backend machines
    server m1 127.0.0.1:{backend_port}
"""


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_haproxy(binary: str, backend_port: int, tmp: Path) -> Child:
    port = _free_port()
    config = tmp / "haproxy.cfg"
    config.write_text(_HAPROXY_CONFIG.format(port=port, backend_port=backend_port))
    log = tmp / "haproxy.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [binary, "-db", "-f", str(config)],
            stdin=subprocess.PIPE,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    child = Child("haproxy", proc, port)
    deadline = time.monotonic() + START_WAIT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"haproxy exited; see {log}")
        with contextlib.suppress(OSError):
            import socket

            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return child
        time.sleep(0.05)
    child.stop()
    raise RuntimeError("haproxy did not start listening")
