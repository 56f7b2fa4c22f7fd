"""`nonomad-console`: the web console as a process.

Binds its socket, then builds the replica (following flaps'), the SDK client (the read-only
token; each session calls with its own), the proxy's admin stub, the live hub, the sessions
and the ASGI app behind its front door (which knows the port it serves on), serves it with
uvicorn (HTTPS with `https_cert`), and prints `NONOMAD_READY console host:port` once it
answers. SIGTERM or SIGINT: the sessions and live streams end first (so no open page holds the
shutdown up), then the server stops, then the replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import sys
import time
from collections.abc import Iterator

import structlog
import uvicorn

from nonomad.client import Client
from nonomad.console.access import TokenCheck
from nonomad.console.app import build
from nonomad.console.guard import Door, Served
from nonomad.console.live import Live
from nonomad.console.pages import Pages
from nonomad.console.sessions import LoginCodes, Sessions
from nonomad.console.settings import ConsoleSettings
from proxy.v1 import proxy_pb2_grpc
from runtime import READY_PREFIX, aio_channel, configure_logging, parse_host_port
from runtime.settings import SettingsError, load_settings

log = structlog.get_logger("console")

RPC_TIMEOUT = 10.0
SWEEP = 5.0  # seconds between looks for sessions that expired


class _Server(uvicorn.Server):
    """uvicorn's server, stopped by the console (which owns the signals) rather than by them:
    the console ends its live streams before the server waits for connections to close."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.listening = asyncio.Event()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started:
            self.listening.set()


def _bind(listen: str) -> socket.socket:
    host, port = parse_host_port(listen)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named: asyncio sets TCP_NODELAY only on sockets that say so, and without it
    # an answer written in two parts waits out the client's delayed ACK (40 ms).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    sock.setblocking(False)
    return sock


async def run(settings: ConsoleSettings) -> int:
    replica = settings.replica()
    for address in settings.workers:
        replica.add_address(address)
    flaps = Client(
        settings.flaps,
        tls=settings.flaps_tls(),
        token_file=settings.token_file,
        timeout=RPC_TIMEOUT,
    )
    proxy_channel = (
        aio_channel(settings.proxy, tls=settings.cluster_tls) if settings.proxy else None
    )
    proxy = proxy_pb2_grpc.ProxyServiceStub(proxy_channel) if proxy_channel else None
    live = Live(replica, lambda subscribed: flaps.watch_placements(subscribed=subscribed))
    closing = asyncio.Event()
    try:
        sock = _bind(settings.listen)
    except OSError as err:
        print(f"nonomad-console: cannot listen on {settings.listen}: {err}", file=sys.stderr)
        await flaps.close()
        return 1
    bind_host, _ = parse_host_port(settings.listen)
    tls = settings.https_cert is not None
    served = Served.of(bind_host, sock.getsockname()[1], tls=tls, names=settings.hosts)
    sessions = Sessions(time.time, ttl=settings.session_ttl, max_sessions=settings.max_sessions)
    door = Door(served, sessions, LoginCodes(time.time), TokenCheck(flaps, time.time), flaps)
    app = build(Pages(replica, flaps, proxy, live), live, closing, door)
    server = _Server(
        uvicorn.Config(
            app,
            log_config=None,
            access_log=False,  # (a login URL's code is in its query string)
            lifespan="off",
            timeout_graceful_shutdown=max(1, int(settings.grace_period)),
            ssl_certfile=settings.https_cert,
            ssl_keyfile=settings.https_key,
        )
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    background = asyncio.Event()
    tasks = [
        asyncio.create_task(replica.run(background), name="console/replica"),
        asyncio.create_task(live.run(background), name="console/live"),
        asyncio.create_task(sessions.sweep_every(SWEEP, background), name="console/sessions"),
    ]
    serving = asyncio.create_task(server.serve(sockets=[sock]), name="console/http")
    try:
        listening = asyncio.create_task(server.listening.wait())
        await asyncio.wait({listening, serving}, return_when=asyncio.FIRST_COMPLETED)
        listening.cancel()
        if serving.done():
            serving.result()
            return 1
        host, port = sock.getsockname()[:2]
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        log.info(
            "console_listening",
            address=address,
            scheme=served.scheme,
            hosts=sorted(served.hosts),
            flaps=settings.flaps,
            proxy=settings.proxy,
        )
        print(f"{READY_PREFIX} console {address}", flush=True)
        waiter = asyncio.create_task(stop.wait())
        await asyncio.wait({waiter, serving}, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
    finally:
        log.info("console_stopping")
        closing.set()  # log streams
        sessions.close()  # every session's streams
        live.close()  # page streams
        server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(serving, settings.grace_period + 5)
        background.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        await flaps.close()
        if proxy_channel is not None:
            await proxy_channel.close()
        sock.close()
    return 0


def main() -> None:
    try:
        settings = load_settings(ConsoleSettings, None, prog="nonomad-console")
    except SettingsError as err:
        print(err, file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    configure_logging("console", settings.log_level)
    raise SystemExit(asyncio.run(run(settings)))


if __name__ == "__main__":
    main()
