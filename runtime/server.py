"""The process lifecycle every nonomad service shares: serve gRPC, report readiness, stop cleanly.

A service's `main()` builds a `Service`, registers its servicers with `add` (each wrapped once
by `wrap_servicer`, so domain errors become gRPC statuses in one place, and each request
decoded and checked against the service's `runtime.limits.Limits` by `register`: a malformed
protobuf or a field over its bound is INVALID_ARGUMENT before any handler runs), starts background
loops with `spawn`, and hands it to `main_entry`. `Service.run` adds the standard health and
reflection services, binds, announces readiness, and on SIGTERM/SIGINT shuts down in order:
health NOT_SERVING, `server.stop(grace)`, shutdown event to tasks, hooks, tracing flush.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import inspect
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import grpc
import grpc.aio
import structlog
from google.protobuf.descriptor import ServiceDescriptor
from google.rpc import error_details_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc

from runtime import tracing, transport
from runtime.endpoints import METRICS_PREFIX, MetricsEndpoint
from runtime.errors import InvalidArgument
from runtime.limits import DEFAULT_LIMITS, Limits, check
from runtime.looplag import watch_loop
from runtime.settings import ServiceSettings, SettingsError, parse_host_port
from runtime.status import abort_with_details

__all__ = [
    "CLUSTER_PREFIX",
    "READY_PREFIX",
    "ErrorMapper",
    "Mapped",
    "Service",
    "add_health_and_reflection",
    "main_entry",
    "read_announcements",
    "register",
    "server_options",
    "time_left",
    "use_event_loop",
    "wrap_servicer",
]

_log = structlog.get_logger(__name__)

Mapped = tuple[grpc.StatusCode, str] | tuple[grpc.StatusCode, str, error_details_pb2.ErrorInfo]
"""A status code and message, and maybe an ErrorInfo: a reason a caller can act on."""

ErrorMapper = Callable[[Exception], Mapped | None]
"""Maps a domain exception to (status code, message[, ErrorInfo]); None means "not ours":
INTERNAL."""

READY_PREFIX = "NONOMAD_READY"
"""First word of the stdout line a service prints once it serves: `NONOMAD_READY name addr`."""

CLUSTER_PREFIX = "NONOMAD_CLUSTER"
"""First word of the line with the `cluster_listen` address, printed before `NONOMAD_READY`."""


def read_announcements(proc: subprocess.Popen[bytes], timeout: float) -> dict[str, str]:
    """What a service started with stdout on a pipe announces, up to its `NONOMAD_READY` line:
    each `NONOMAD_<KIND> name address` line's address by kind (`NONOMAD_READY` is the gRPC
    address; the proxy also says `NONOMAD_HTTP`). RuntimeError, naming the exit code and what
    it printed, when the process exits or `timeout` passes first."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    deadline = time.monotonic() + timeout
    buf = b""
    announced: dict[str, str] = {}
    while time.monotonic() < deadline:
        if select.select([fd], [], [], 0.05)[0]:
            chunk = os.read(fd, 4096)
            if not chunk:  # stdout closed: it is exiting; give it a moment, for its code
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(1)
                break
            buf += chunk
            *lines, rest = buf.split(b"\n")
            buf = rest
            for raw in lines:
                words = raw.decode(errors="replace").split()
                if len(words) == 3 and words[0].startswith("NONOMAD_"):
                    announced[words[0]] = words[2]
                    if words[0] == READY_PREFIX:
                        return announced
        elif proc.poll() is not None:
            break
    raise RuntimeError(
        f"not ready (exit {proc.poll()}); it announced {announced}, then printed {buf!r}"
    )


_WRAPPED_MARK = "__nonomad_wrapped__"
_INTERNAL_MESSAGE = "internal error"

T = TypeVar("T")


class _Refused:
    """What a request that could not be decoded, or broke a limit, is handed to its handler
    as: the wrapped handler answers INVALID_ARGUMENT with `message` (gRPC's own decoding
    would answer UNKNOWN, naming a Python exception class)."""

    __slots__ = ("message",)

    def __init__(self, message: str) -> None:
        self.message = message


def _checked_decoder(
    decode: Callable[[bytes], Any], type_name: str, limits: Limits
) -> Callable[[bytes], Any]:
    def decoder(raw: bytes) -> Any:
        try:
            request = decode(raw)
        except Exception:
            # DecodeError, or invalid UTF-8 in a string field: either way not our message.
            return _Refused(f"request: not a valid {type_name} (malformed or truncated)")
        try:
            check(request, limits)
        except InvalidArgument as err:
            return _Refused(str(err))
        return request

    return decoder


def _refusing(handler: Any) -> Any:
    """`handler` with a behaviour that answers a `_Refused` request INVALID_ARGUMENT itself:
    for servicers `wrap_servicer` does not wrap (health, reflection), which would read fields
    of it and answer UNKNOWN. A stream's requests are checked as they are read. grpc.aio runs
    a behaviour by its kind (coroutine, async generator), so the wrapper keeps the kind."""

    async def refuse(request: Any, context: Any) -> Any:
        if type(request) is _Refused:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        return request

    async def checked(requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
        async for request in requests:
            yield await refuse(request, context)

    kind = next(
        k
        for k in ("unary_unary", "unary_stream", "stream_unary", "stream_stream")
        if getattr(handler, k) is not None
    )
    inner = getattr(handler, kind)
    streamed_in = kind.startswith("stream")

    async def requests_of(request: Any, context: Any) -> Any:
        return checked(request, context) if streamed_in else await refuse(request, context)

    if inspect.isasyncgenfunction(inner):

        async def generator(request: Any, context: Any) -> AsyncIterator[Any]:
            arg = await requests_of(request, context)
            async with contextlib.aclosing(inner(arg, context)) as responses:
                async for response in responses:
                    yield response

        return handler._replace(**{kind: generator})

    async def coroutine(request: Any, context: Any) -> Any:
        return await inner(await requests_of(request, context), context)

    return handler._replace(**{kind: coroutine})


class _CheckingServer:
    """What a generated `add_..._to_server` is given instead of the server: every method handler
    it registers decodes with `_checked_decoder`. With `refuse`, the handlers answer a request
    that failed its check themselves (`_refusing`), for servicers not wrapped by
    `wrap_servicer`."""

    def __init__(self, server: Any, limits: Limits, *, refuse: bool = False) -> None:
        self._server = server
        self._limits = limits
        self._refuse = refuse

    def _checked(self, handler: Any) -> Any:
        decode = handler.request_deserializer
        if decode is None:
            return handler
        type_name = getattr(getattr(decode, "__self__", None), "DESCRIPTOR", None)
        name = type_name.full_name if type_name is not None else "request message"
        checked = handler._replace(
            request_deserializer=_checked_decoder(decode, name, self._limits)
        )
        return _refusing(checked) if self._refuse else checked

    def add_generic_rpc_handlers(self, handlers: Sequence[Any]) -> None:
        self._server.add_generic_rpc_handlers([_CheckingHandler(h, self) for h in handlers])

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        checked = {name: self._checked(h) for name, h in handlers.items()}
        self._server.add_registered_method_handlers(service, checked)


class _CheckingHandler(grpc.ServiceRpcHandler):
    def __init__(self, inner: Any, server: _CheckingServer) -> None:
        self._inner = inner
        self._server = server
        self._cache: dict[str, Any] = {}

    def service_name(self) -> str:
        return str(self._inner.service_name())

    def service(self, details: grpc.HandlerCallDetails) -> Any:
        method: str = details.method
        if method not in self._cache:
            handler = self._inner.service(details)
            self._cache[method] = None if handler is None else self._server._checked(handler)
        return self._cache[method]


def register(
    server: Any,
    servicer: T,
    add_to_server: Callable[[T, Any], None],
    service: ServiceDescriptor,
    mapper: ErrorMapper,
    limits: Limits = DEFAULT_LIMITS,
) -> None:
    """Add `servicer` to a grpc.aio `server` as `Service` does: its handlers wrapped by
    `wrap_servicer`, every request decoded without raising and checked against `limits`."""
    wrap_servicer(servicer, service, mapper)
    add_to_server(servicer, _CheckingServer(server, limits))


def add_health_and_reflection(
    server: Any, health_servicer: health.aio.HealthServicer, service_names: Sequence[str]
) -> None:
    """Add the standard health and reflection services (reflection naming `service_names` and
    both of these) to a grpc.aio `server`. Their requests are decoded as the services' are: a
    malformed one is INVALID_ARGUMENT in plain words, not UNKNOWN naming a Python exception."""
    standard = _CheckingServer(server, DEFAULT_LIMITS, refuse=True)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, standard)
    names = [*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME]
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(
        reflection.aio.ReflectionServicer(names), standard
    )


async def _abort_with_mapped(
    exc: Exception, context: Any, method: str, mapper: ErrorMapper
) -> NoReturn:
    try:
        mapped = mapper(exc)
    except Exception:
        # A broken mapper must not hide the original error from the log.
        _log.exception("error_mapper_failed", method=method, error=repr(exc))
        mapped = None
    if mapped is None and isinstance(exc, InvalidArgument):
        mapped = (grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    if mapped is None:
        _log.error("rpc_failed", method=method, exc_info=exc)
        await context.abort(grpc.StatusCode.INTERNAL, _INTERNAL_MESSAGE)
    elif len(mapped) == 2:
        code, message = mapped
        _log.debug("rpc_error", method=method, code=code.name, message=message)
        await context.abort(code, message)
    else:
        code, message, info = mapped
        _log.debug("rpc_error", method=method, code=code.name, message=message, reason=info.reason)
        await abort_with_details(context, code, message, info)
    raise AssertionError("context.abort returned")  # pragma: no cover - abort always raises


_deadline: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "nonomad_rpc_deadline", default=None
)


def time_left(cap: float) -> float:
    """The seconds the RPC being handled has left before its caller's deadline, at most `cap`
    (`cap` outside a handler, or when the caller set no deadline): the timeout of a call made
    on the caller's behalf, so that nobody works on for a caller who has given up."""
    deadline = _deadline.get()
    if deadline is None:
        return cap
    return max(0.0, min(cap, deadline - asyncio.get_running_loop().time()))


def _caller_deadline(context: Any) -> float | None:
    remaining = context.time_remaining()
    # On the loop's clock (time.monotonic on a real loop; virtual time on a simulated node's).
    return None if remaining is None else asyncio.get_running_loop().time() + remaining


def _wrap_unary(
    handler: Callable[[Any, Any], Awaitable[Any]], method: str, mapper: ErrorMapper
) -> Callable[[Any, Any], Awaitable[Any]]:
    @functools.wraps(handler)
    async def wrapper(request: Any, context: Any) -> Any:
        if type(request) is _Refused:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        _deadline.set(_caller_deadline(context))  # this task's own context: nothing to reset
        try:
            return await handler(request, context)
        except grpc.aio.AbortError:
            # The handler chose its status with context.abort; it is already final.
            raise
        except Exception as exc:
            await _abort_with_mapped(exc, context, method, mapper)

    setattr(wrapper, _WRAPPED_MARK, True)
    return wrapper


def _wrap_stream(
    handler: Callable[[Any, Any], AsyncGenerator[Any, None]], method: str, mapper: ErrorMapper
) -> Callable[[Any, Any], AsyncIterator[Any]]:
    @functools.wraps(handler)
    async def wrapper(request: Any, context: Any) -> AsyncIterator[Any]:
        if type(request) is _Refused:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        _deadline.set(_caller_deadline(context))
        try:
            # aclosing: when the client goes away, the handler's own finally blocks run now,
            # not whenever the abandoned generator is collected.
            async with contextlib.aclosing(handler(request, context)) as responses:
                async for response in responses:
                    yield response
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await _abort_with_mapped(exc, context, method, mapper)

    setattr(wrapper, _WRAPPED_MARK, True)
    return wrapper


def wrap_servicer(servicer: object, service: ServiceDescriptor, mapper: ErrorMapper) -> None:
    """Make each handler of `service` on `servicer` answer exceptions with a mapped status.

    Replaces the bound methods on the instance (call it before `add_..._to_server`). An
    exception from an async handler or async-generator handler goes through `mapper`; a mapped
    one aborts the call with that code and message, an unmapped one with INTERNAL and a generic
    message (the exception is logged with its traceback, never sent to the caller).
    `context.abort` from the handler and cancellation pass through untouched. Synchronous
    methods, such as the generated base class's UNIMPLEMENTED stubs, are left alone. Doing this
    once at registration keeps an interceptor off the call path.
    """
    for method in service.methods:
        handler = getattr(servicer, method.name, None)
        if handler is None or getattr(handler, _WRAPPED_MARK, False):
            continue
        full_method = f"/{service.full_name}/{method.name}"
        if inspect.isasyncgenfunction(handler):
            wrapped: object = _wrap_stream(handler, full_method, mapper)
        elif inspect.iscoroutinefunction(handler):
            wrapped = _wrap_unary(handler, full_method, mapper)
        else:
            continue
        try:
            setattr(servicer, method.name, wrapped)
        except AttributeError as exc:
            raise TypeError(
                f"cannot wrap {type(servicer).__name__}.{method.name}: "
                "the servicer must allow instance attributes (no __slots__)"
            ) from exc


def server_options(settings: ServiceSettings) -> list[tuple[str, int]]:
    """gRPC server channel options for `settings`."""
    return [
        ("grpc.max_receive_message_length", settings.max_message_bytes),
        ("grpc.max_send_message_length", settings.max_message_bytes),
        # Find dead clients (a follower whose host vanished) without waiting on TCP.
        ("grpc.keepalive_time_ms", 60_000),
        ("grpc.keepalive_timeout_ms", 20_000),
        # Accept the keepalive pings of tracing.DEFAULT_CHANNEL_OPTIONS (every 30 s, also on
        # idle connections) instead of answering GOAWAY "too_many_pings".
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 20_000),
        # gRPC sets SO_REUSEPORT by default: two processes could then share a port silently.
        ("grpc.so_reuseport", 0),
    ]


def _format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _write_atomically(path: Path, text: str) -> None:
    # Readers poll for the file; they must never see it half-written.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


@dataclass(frozen=True)
class _Registration:
    servicer: object
    add_to_server: Callable[[Any, Any], None]
    full_name: str
    limits: Limits


class Service:
    """The lifecycle of one service process: one gRPC server plus tracked background tasks.

    Build it, `add` servicers, `spawn` background loops, `on_shutdown` cleanup hooks, then
    `await run()` (or `main_entry`). A Service runs once.
    """

    def __init__(self, name: str, settings: ServiceSettings) -> None:
        self.name = name
        self.settings = settings
        self.shutdown_event = asyncio.Event()
        """Set once the server has stopped: background tasks must return promptly."""
        self.draining = asyncio.Event()
        """Set when shutdown begins, before the server stops: long-lived streaming handlers
        should end their streams so `server.stop` need not wait out the grace period."""
        self._registrations: list[_Registration] = []
        self._pending: list[tuple[str, Callable[[asyncio.Event], Awaitable[None]]]] = []
        self._tasks: dict[asyncio.Task[None], str] = {}
        self._hooks: list[Callable[[], Awaitable[None]]] = []
        self._stop_requested = asyncio.Event()
        self._ready = asyncio.Event()
        self._finished = asyncio.Event()
        self._exit_code = 0
        self._address: str | None = None
        self._cluster_address: str | None = None
        self._servers: list[Any] = []
        self._started = False
        self._health: Any = None
        self._metrics: MetricsEndpoint | None = None

    # -- registration ----------------------------------------------------------------------

    def add(
        self,
        servicer: T,
        add_to_server: Callable[[T, Any], None],
        service: ServiceDescriptor,
        mapper: ErrorMapper,
        limits: Limits = DEFAULT_LIMITS,
    ) -> None:
        """Register `servicer` for `service`, with its errors translated by `mapper` and its
        requests bounded by `limits`.

        `add_to_server` is the generated `add_XServicer_to_server`. The service's full name is
        served by reflection and gets its own health status.
        """
        if self._started:
            raise RuntimeError("servicers must be added before run()")
        wrap_servicer(servicer, service, mapper)
        self._registrations.append(
            _Registration(servicer, add_to_server, service.full_name, limits)
        )

    def spawn(self, name: str, coro_fn: Callable[[asyncio.Event], Awaitable[None]]) -> None:
        """Run `coro_fn(shutdown_event)` as a tracked background task while the service runs.

        It must return soon after the event is set; it is cancelled if still running one grace
        period later. If it raises, the error is logged and the service shuts down with exit
        code 1. Tasks spawned before `run()` start once the server is listening.
        """
        if self._stop_requested.is_set():
            # Shutdown may already be past the point where it awaits tasks; this one would leak.
            _log.warning("spawn_refused_stopping", task=name)
        elif self._started:
            self._start_task(name, coro_fn)
        else:
            self._pending.append((name, coro_fn))

    def on_shutdown(self, hook: Callable[[], Awaitable[None]]) -> None:
        """Run `await hook()` during shutdown, after the tasks; hooks run in reverse order."""
        self._hooks.append(hook)

    # -- state -----------------------------------------------------------------------------

    @property
    def address(self) -> str:
        """The bound `host:port` (the real port when `listen` asked for port 0)."""
        if self._address is None:
            raise RuntimeError("the service is not listening yet")
        return self._address

    @property
    def cluster_address(self) -> str | None:
        """The bound `cluster_listen` address, or None when there is no such listener."""
        return self._cluster_address

    @property
    def service_names(self) -> list[str]:
        """Full names of the registered services, in registration order."""
        return [reg.full_name for reg in self._registrations]

    async def wait_ready(self) -> str:
        """Wait until the service serves and return its address.

        Raises RuntimeError if `run()` finished without becoming ready (bind failure, ...).
        """
        ready = asyncio.create_task(self._ready.wait())
        finished = asyncio.create_task(self._finished.wait())
        try:
            await asyncio.wait({ready, finished}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ready.cancel()
            finished.cancel()
        if not self._ready.is_set():
            raise RuntimeError(f"{self.name} stopped before it was ready")
        return self.address

    def request_shutdown(self, exit_code: int = 0) -> None:
        """Begin a graceful shutdown; `run()` then returns the highest exit code requested."""
        self._exit_code = max(self._exit_code, exit_code)
        self._stop_requested.set()

    async def set_health(self, service: str, serving: bool) -> None:
        """Set the health status of `service` ("" for the whole server) while running.

        Ignored once shutdown has begun: everything is NOT_SERVING then.
        """
        if self._health is None:
            raise RuntimeError("the service is not running")
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        await self._health.set(service, status)

    # -- running ---------------------------------------------------------------------------

    async def run(self, *, handle_signals: bool = True) -> int:
        """Serve until SIGTERM/SIGINT or `request_shutdown()`, then stop gracefully.

        Returns the process exit code: 0 for a clean stop, 1 when startup failed, a
        background task crashed or a shutdown hook failed. `handle_signals=False` leaves the
        process's signal handlers alone (for running several services in one process).
        """
        if self._started:
            raise RuntimeError("a Service runs only once")
        self._started = True
        loop = asyncio.get_running_loop()
        signals: list[signal.Signals] = []
        try:
            try:
                await self._start_server()
                interval = self.settings.loop_lag_interval
                if interval is not None:
                    self.spawn("loop-lag", functools.partial(watch_loop, interval))
                for name, coro_fn in self._pending:
                    self._start_task(name, coro_fn)
                self._pending.clear()
                if handle_signals:
                    signals = self._install_signal_handlers(loop)
                if not self._stop_requested.is_set():
                    await self._announce_ready()
            except Exception:
                # Bind failure, unreadable TLS files, unwritable ready file: a clean exit 1.
                _log.exception("startup_failed", service=self.name)
                self.request_shutdown(1)
            await self._stop_requested.wait()
        finally:
            # Also reached when run() is cancelled: the server must not outlive it.
            try:
                await self._shutdown()
            finally:
                for sig in signals:
                    loop.remove_signal_handler(sig)
                self._finished.set()
        return self._exit_code

    async def _start_server(self) -> None:
        settings = self.settings
        host, _ = parse_host_port(settings.listen)
        self._health = health.aio.HealthServicer()
        server = self._server()
        if settings.tls_cert is not None and settings.tls_key is not None:
            client_ca = settings.tls_client_ca
            port = server.add_secure_port(settings.listen, self._credentials(client_ca))
        else:
            port = server.add_insecure_port(settings.listen)
        # Older grpcio reports a failed bind as port 0 instead of raising.
        if not port:
            raise RuntimeError(f"could not bind {settings.listen}")
        self._address = _format_address(host, port)
        if settings.cluster_listen is not None:
            # The same services again, for the cluster's own parts only: a second server,
            # because one port cannot both ask clients for a certificate and serve those
            # (the CLI, grpcurl) that have none.
            cluster = self._server()
            cluster_port = cluster.add_secure_port(
                settings.cluster_listen, self._credentials(settings.cluster_ca)
            )
            if not cluster_port:
                raise RuntimeError(f"could not bind cluster_listen {settings.cluster_listen}")
            cluster_host, _ = parse_host_port(settings.cluster_listen)
            self._cluster_address = _format_address(cluster_host, cluster_port)
            await cluster.start()
            self._servers.append(cluster)
        await server.start()
        self._servers.append(server)
        if settings.metrics_listen is not None:
            try:
                self._metrics = MetricsEndpoint(settings.metrics_listen)
            except OSError as exc:
                for started in self._servers:
                    await started.stop(None)
                raise RuntimeError(
                    f"could not bind metrics_listen {settings.metrics_listen}: {exc}"
                ) from exc

    def _server(self) -> Any:
        """A gRPC server with every registered service, health and reflection."""
        interceptors: list[Any] = tracing.server_interceptors()
        server = transport.current().server(
            interceptors=interceptors or None,
            options=server_options(self.settings),
        )
        for reg in self._registrations:
            reg.add_to_server(reg.servicer, _CheckingServer(server, reg.limits))
        add_health_and_reflection(server, self._health, self.service_names)
        return server

    def _credentials(self, client_ca: Path | None) -> grpc.ServerCredentials:
        """TLS with this service's certificate; with `client_ca`, clients must present a
        certificate it signed."""
        settings = self.settings
        assert settings.tls_cert is not None
        assert settings.tls_key is not None
        return grpc.ssl_server_credentials(
            [(settings.tls_key.read_bytes(), settings.tls_cert.read_bytes())],
            root_certificates=client_ca.read_bytes() if client_ca else None,
            require_client_auth=client_ca is not None,
        )

    async def _announce_ready(self) -> None:
        for name in ("", *self.service_names):
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        address = self.address
        _log.info(
            "ready",
            address=address,
            services=self.service_names,
            tls=self.settings.tls_enabled,
            mutual_tls=self.settings.tls_client_ca is not None,
            cluster_address=self._cluster_address,
        )
        if self._metrics is not None:
            print(
                f"{METRICS_PREFIX} {self.name} {self._metrics.address}", file=sys.stdout, flush=True
            )
        if self._cluster_address is not None:
            print(f"{CLUSTER_PREFIX} {self.name} {self._cluster_address}", flush=True)
        # Test harnesses and supervisors wait for this exact line rather than polling a port.
        print(f"{READY_PREFIX} {self.name} {address}", file=sys.stdout, flush=True)
        if self.settings.ready_file is not None:
            document = {"service": self.name, "address": address, "pid": os.getpid()}
            if self._cluster_address is not None:
                document["cluster_address"] = self._cluster_address
            _write_atomically(self.settings.ready_file, json.dumps(document))
        self._ready.set()

    def _install_signal_handlers(self, loop: asyncio.AbstractEventLoop) -> list[signal.Signals]:
        installed = []
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, self._on_signal, sig)
            except (NotImplementedError, RuntimeError, ValueError) as exc:
                # Not the main thread, or a platform without loop signal handlers: the service
                # still runs and stops through request_shutdown().
                _log.warning("signal_handler_unavailable", signal=sig.name, error=str(exc))
            else:
                installed.append(sig)
        return installed

    def _on_signal(self, sig: signal.Signals) -> None:
        if self._stop_requested.is_set():
            _log.info("signal_ignored_already_stopping", signal=sig.name)
            return
        _log.info("signal_received", signal=sig.name)
        self.request_shutdown()

    def _start_task(self, name: str, coro_fn: Callable[[asyncio.Event], Awaitable[None]]) -> None:
        task = asyncio.create_task(self._run_task(name, coro_fn), name=f"{self.name}/{name}")
        self._tasks[task] = name
        task.add_done_callback(self._tasks.pop)

    async def _run_task(
        self, name: str, coro_fn: Callable[[asyncio.Event], Awaitable[None]]
    ) -> None:
        try:
            await coro_fn(self.shutdown_event)
        except asyncio.CancelledError:
            raise
        except Exception:
            _log.exception("task_crashed", task=name)
            self.request_shutdown(1)
        else:
            if not self.shutdown_event.is_set():
                _log.info("task_finished_early", task=name)

    async def _shutdown(self) -> None:
        grace = self.settings.grace_period
        _log.info("shutting_down", grace_period=grace, exit_code=self._exit_code)
        if self._health is not None:
            await self._health.enter_graceful_shutdown()
        self.draining.set()
        # Each refuses new calls at once; calls in flight get `grace` seconds, then are cancelled.
        await asyncio.gather(*(server.stop(grace) for server in self._servers))
        self.shutdown_event.set()

        if self._tasks:
            _, pending = await asyncio.wait(set(self._tasks), timeout=grace)
            for task in pending:
                _log.warning("task_cancelled_after_grace", task=self._tasks.get(task))
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

        for hook in reversed(self._hooks):
            try:
                await hook()
            except Exception:
                _log.exception("shutdown_hook_failed", hook=getattr(hook, "__qualname__", hook))
                self._exit_code = max(self._exit_code, 1)

        ready_file = self.settings.ready_file
        if ready_file is not None and self._ready.is_set():
            # A stale file would announce an address nobody listens on any more.
            with contextlib.suppress(FileNotFoundError):
                ready_file.unlink()
        if self._metrics is not None:
            await asyncio.to_thread(self._metrics.close)
        # The exporter may block on an unreachable collector; keep the loop free meanwhile.
        await asyncio.to_thread(tracing.shutdown_tracing)
        _log.info("stopped", exit_code=self._exit_code)


def use_event_loop(name: str) -> None:
    """Make the next `asyncio.run` use `name`'s loop: "uvloop" (asyncio's own, with a warning,
    when uvloop is not installed) or "asyncio". A process-wide choice: a service's `main`
    makes it, before `main_entry`. grpc.aio runs on either; on uvloop a gRPC call costs about a
    sixth less CPU (bench/flaps_bench.py), an HTTP request about a quarter (bench/proxy_bench.py).
    """
    if name != "uvloop":
        return
    try:
        import uvloop
    except ImportError:
        _log.warning("uvloop_missing", consequence="asyncio's own event loop")
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def main_entry(
    make_service: Callable[[list[str]], Service | Awaitable[Service]],
    argv: Sequence[str] | None = None,
) -> NoReturn:
    """Run a service as a console script: build it, run it, exit with its code.

    `make_service(argv)` (plain or async) is called inside the event loop, so servicers may
    create asyncio and grpc.aio objects and async setup (opening stores, recovery) can run
    before serving. `argv` defaults to `sys.argv[1:]`. A SettingsError it raises is printed to
    stderr with exit code 2.
    """
    args = list(sys.argv[1:] if argv is None else argv)

    async def _main() -> int:
        made = make_service(args)
        service = await made if inspect.isawaitable(made) else made
        return await service.run()

    try:
        code = asyncio.run(_main())
    except SettingsError as exc:
        print(exc, file=sys.stderr, flush=True)
        code = 2
    except KeyboardInterrupt:
        # Ctrl-C before the signal handlers were installed (while building the service).
        code = 130
    sys.exit(code)
