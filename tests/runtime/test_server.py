"""Service and wrap_servicer in-process: readiness, health, reflection, errors, shutdown, TLS."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from pathlib import Path

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from runtime import (
    ChannelTLS,
    Service,
    aio_channel,
    read_announcements,
    wrap_servicer,
)
from tests.harness import error_info
from tests.runtime import _echo
from tests.runtime._support import SERVING, echo_service, health_status, running
from tests.runtime.conftest import Certs

NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
HEALTH = "grpc.health.v1.Health"
REFLECTION = "grpc.reflection.v1alpha.ServerReflection"


@pytest.fixture
async def echo() -> AsyncIterator[tuple[Service, _echo.EchoClient]]:
    service, _ = echo_service()
    async with running(service), aio_channel(service.address) as channel:
        yield service, _echo.EchoClient(channel)


# -- readiness, health, reflection ----------------------------------------------------------


async def test_ready_line_file_health_and_reflection(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ready_file = tmp_path / "ready.json"
    service, _ = echo_service("flyd", ready_file=ready_file)
    async with running(service) as run, aio_channel(service.address) as channel:
        host, port = service.address.rsplit(":", 1)
        assert host == "127.0.0.1"
        assert int(port) > 0
        assert f"NONOMAD_READY flyd {service.address}\n" in capsys.readouterr().out
        assert json.loads(ready_file.read_text()) == {
            "service": "flyd",
            "address": service.address,
            "pid": __import__("os").getpid(),
        }

        assert await health_status(channel) == SERVING
        assert await health_status(channel, _echo.SERVICE_NAME) == SERVING
        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            await health_status(channel, "no.such.Service")
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND

        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        [response] = [r async for r in stub.ServerReflectionInfo(iter([request]), timeout=5)]
        listed = {s.name for s in response.list_services_response.service}
        assert listed == {_echo.SERVICE_NAME, HEALTH, REFLECTION}

        await service.set_health(_echo.SERVICE_NAME, serving=False)
        assert await health_status(channel, _echo.SERVICE_NAME) == NOT_SERVING

        service.request_shutdown()
        assert await run == 0
    # The file would otherwise announce an address nobody listens on.
    assert not ready_file.exists()


async def _send_raw(channel: grpc.aio.Channel, path: str, request: bytes) -> None:
    """Send `request` as the bytes of `path`'s request and read the first answer."""
    if path.endswith("ServerReflectionInfo"):
        await channel.stream_stream(path)(iter([request]), timeout=5).read()
    elif path.endswith("Watch"):
        await channel.unary_stream(path)(request, timeout=5).read()
    else:
        await channel.unary_unary(path)(request, timeout=5)


@pytest.mark.parametrize(
    "path",
    [
        f"/{HEALTH}/Check",
        f"/{HEALTH}/Watch",
        f"/{HEALTH}/List",
        f"/{REFLECTION}/ServerReflectionInfo",
    ],
)
async def test_health_and_reflection_refuse_bytes_that_are_not_their_request(path: str) -> None:
    """A malformed request is INVALID_ARGUMENT in plain words (gRPC's own decoding answered
    UNKNOWN "Unexpected <class 'DecodeError'>"); a good one after it is still served."""
    service, _ = echo_service()
    async with running(service), aio_channel(service.address) as channel:
        garbage = b"\x0a\x05ab"  # a string field that claims five bytes and has two
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await _send_raw(channel, path, garbage)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "malformed or truncated" in (caught.value.details() or "")
        assert await health_status(channel) == SERVING


# -- error mapping --------------------------------------------------------------------------


async def outcome(call: Awaitable[str]) -> tuple[grpc.StatusCode, str]:
    """(OK, answer) or (code, details) of a call, so tables can list both alike."""
    try:
        return grpc.StatusCode.OK, await call
    except grpc.aio.AioRpcError as error:
        return error.code(), error.details()


@pytest.mark.parametrize(
    ("word", "code", "details"),
    [
        ("hello", grpc.StatusCode.OK, "hello"),
        ("refuse", grpc.StatusCode.FAILED_PRECONDITION, "echo refuses to say that"),
        ("crash", grpc.StatusCode.INTERNAL, "internal error"),
        ("abort", grpc.StatusCode.PERMISSION_DENIED, "handler aborted itself"),
    ],
)
async def test_unary_errors_are_mapped(
    echo: tuple[Service, _echo.EchoClient], word: str, code: grpc.StatusCode, details: str
) -> None:
    _, client = echo
    assert await outcome(client.say(word)) == (code, details)


async def test_a_mapped_reason_travels_as_error_info(
    echo: tuple[Service, _echo.EchoClient],
) -> None:
    _, client = echo
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await client.say("rude")

    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert caught.value.details() == "echo will not be rude"
    assert error_info(caught.value) == ("TOO_RUDE", _echo.REASON_DOMAIN, {"word": "rude"})


@pytest.mark.parametrize(
    ("request_text", "items", "code", "details"),
    [
        ("3", ["0", "1", "2"], grpc.StatusCode.OK, ""),
        ("2 then refuse", ["0", "1"], grpc.StatusCode.FAILED_PRECONDITION, "stream refused midway"),
        ("1 then crash", ["0"], grpc.StatusCode.INTERNAL, "internal error"),
    ],
)
async def test_stream_errors_are_mapped_after_the_items_sent(
    echo: tuple[Service, _echo.EchoClient],
    request_text: str,
    items: list[str],
    code: grpc.StatusCode,
    details: str,
) -> None:
    _, client = echo
    received: list[str] = []

    async def collect() -> str:
        async for item in client.stream_count(request_text):
            received.append(item)
        return ""

    assert await outcome(collect()) == (code, details)
    assert received == items


async def test_internal_error_is_logged_with_traceback_not_sent(
    echo: tuple[Service, _echo.EchoClient], capsys: pytest.CaptureFixture[str]
) -> None:
    _, client = echo
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await client.say("crash")
    assert "secret" not in raised.value.details()
    output = capsys.readouterr()
    assert "RuntimeError: secret internal detail" in output.out + output.err


class _FakeContext:
    """Just enough of a servicer context to watch wrap_servicer's decisions."""

    def __init__(self) -> None:
        self.aborted: tuple[grpc.StatusCode, str] | None = None

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.aborted = (code, details)
        raise grpc.aio.AbortError()

    def time_remaining(self) -> float | None:
        return None  # the caller set no deadline


class _Cancelled:
    async def Say(self, request: object, context: object) -> None:
        raise asyncio.CancelledError

    async def Count(self, request: object, context: object) -> AsyncGenerator[int, None]:
        yield 1
        raise asyncio.CancelledError

    def Sync(self, request: object, context: object) -> None:
        """Stands in for a generated UNIMPLEMENTED stub."""


async def test_cancellation_passes_through_untranslated() -> None:
    servicer = _Cancelled()
    wrap_servicer(servicer, _echo.DESCRIPTOR, _echo.map_error)
    context = _FakeContext()
    with pytest.raises(asyncio.CancelledError):
        await servicer.Say(None, context)
    with pytest.raises(asyncio.CancelledError):
        [item async for item in servicer.Count(None, context)]
    assert context.aborted is None


async def test_wrapping_is_idempotent_and_leaves_sync_methods_alone() -> None:
    servicer = _echo.EchoServicer()
    wrap_servicer(servicer, _echo.DESCRIPTOR, _echo.map_error)
    once = servicer.Say
    wrap_servicer(servicer, _echo.DESCRIPTOR, _echo.map_error)
    assert servicer.Say is once
    assert "Say" in vars(servicer)
    assert once.__name__ == "Say"

    plain = _Cancelled()
    sync_before = plain.Sync
    wrap_servicer(plain, _echo.DESCRIPTOR, _echo.map_error)
    assert plain.Sync == sync_before


async def test_a_failing_mapper_still_yields_internal() -> None:
    def broken_mapper(exc: Exception) -> tuple[grpc.StatusCode, str] | None:
        raise KeyError("mapper bug")

    servicer = _echo.EchoServicer()
    wrap_servicer(servicer, _echo.DESCRIPTOR, broken_mapper)
    context = _FakeContext()
    with pytest.raises(grpc.aio.AbortError):
        await servicer.Say(_echo.wrappers_pb2.StringValue(value="refuse"), context)
    assert context.aborted == (grpc.StatusCode.INTERNAL, "internal error")


async def test_oversized_request_is_refused() -> None:
    service, _ = echo_service(max_message_bytes=1024)
    async with running(service), aio_channel(service.address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await _echo.EchoClient(channel).say("x" * 2048)
        assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


# -- shutdown -------------------------------------------------------------------------------


async def test_graceful_shutdown_story() -> None:
    service, servicer = echo_service(grace_period=5.0)
    task_saw_shutdown = asyncio.Event()

    async def background(shutdown: asyncio.Event) -> None:
        await shutdown.wait()
        task_saw_shutdown.set()

    hooks_ran: list[str] = []

    async def hook(name: str) -> None:
        hooks_ran.append(name)

    service.spawn("background", background)
    service.on_shutdown(lambda: hook("first registered"))
    service.on_shutdown(lambda: hook("last registered"))

    async with running(service) as run, aio_channel(service.address) as channel:
        client = _echo.EchoClient(channel)
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
        assert (await watch.read()).status == SERVING

        slow = asyncio.create_task(client.say("slow", deadline=10))
        await asyncio.wait_for(servicer.slow_started.wait(), 5)

        # SIGTERM arrives here.
        service.request_shutdown()
        assert (await asyncio.wait_for(watch.read(), 5)).status == NOT_SERVING
        watch.cancel()

        await asyncio.wait_for(service.draining.wait(), 5)
        async with aio_channel(service.address) as fresh:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await _echo.EchoClient(fresh).say("too late", deadline=5)
        # Refused before any handler runs: grpc answers a new stream on a stopping server with
        # UNAVAILABLE (refused stream) or, when the stream raced the stop, CANCELLED.
        assert refused.value.code() in {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED}
        assert "too late" not in servicer.said

        # Background tasks keep running while calls in flight drain.
        assert not service.shutdown_event.is_set()
        assert not slow.done()

        servicer.release_slow.set()
        assert await asyncio.wait_for(slow, 5) == "slow"
        assert await asyncio.wait_for(run, 5) == 0

    assert task_saw_shutdown.is_set()
    assert hooks_ran == ["last registered", "first registered"]


async def test_grace_period_bounds_calls_and_tasks() -> None:
    service, servicer = echo_service(grace_period=0.2)
    stubborn_cancelled = asyncio.Event()

    async def stubborn(shutdown: asyncio.Event) -> None:
        try:
            await asyncio.Event().wait()  # ignores the shutdown event
        except asyncio.CancelledError:
            stubborn_cancelled.set()
            raise

    service.spawn("stubborn", stubborn)
    async with running(service) as run, aio_channel(service.address) as channel:
        slow = asyncio.create_task(_echo.EchoClient(channel).say("slow", deadline=10))
        await asyncio.wait_for(servicer.slow_started.wait(), 5)
        service.request_shutdown()
        # The slow call is never released: the grace period ends it.
        with pytest.raises(grpc.aio.AioRpcError):
            await asyncio.wait_for(slow, 5)
        assert await asyncio.wait_for(run, 5) == 0
    assert stubborn_cancelled.is_set()


@pytest.mark.parametrize("failure", ["task", "hook"])
async def test_failure_means_exit_code_1(failure: str) -> None:
    service, _ = echo_service(grace_period=1.0)

    async def crashing_task(shutdown: asyncio.Event) -> None:
        raise RuntimeError("loop died")

    async def idle_task(shutdown: asyncio.Event) -> None:
        await shutdown.wait()

    async def crashing_hook() -> None:
        raise RuntimeError("could not close")

    if failure == "task":
        service.spawn("crashing", crashing_task)
    else:
        service.spawn("idle", idle_task)
        service.on_shutdown(crashing_hook)

    run = asyncio.create_task(service.run(handle_signals=False))
    if failure == "hook":
        await asyncio.wait_for(service.wait_ready(), 5)
        service.request_shutdown()
    # A crashing task shuts the service down by itself.
    assert await asyncio.wait_for(run, 5) == 1


async def test_task_spawned_while_running_is_tracked() -> None:
    service, _ = echo_service()
    saw = asyncio.Event()

    async def late(shutdown: asyncio.Event) -> None:
        await shutdown.wait()
        saw.set()

    async with running(service) as run:
        service.spawn("late", late)
        service.request_shutdown()
        assert await asyncio.wait_for(run, 5) == 0
    assert saw.is_set()


async def test_bind_failure_is_exit_code_1() -> None:
    first, _ = echo_service()
    async with running(first):
        second, _ = echo_service(listen=first.address)
        run = asyncio.create_task(second.run(handle_signals=False))
        with pytest.raises(RuntimeError, match="stopped before it was ready"):
            await asyncio.wait_for(second.wait_ready(), 5)
        assert await asyncio.wait_for(run, 5) == 1


async def test_unwritable_ready_file_is_exit_code_1(tmp_path: Path) -> None:
    service, _ = echo_service(ready_file=tmp_path / "no-such-dir" / "ready.json")
    run = asyncio.create_task(service.run(handle_signals=False))
    assert await asyncio.wait_for(run, 5) == 1


async def test_a_service_runs_once() -> None:
    service, _ = echo_service()
    async with running(service):
        with pytest.raises(RuntimeError, match="runs only once"):
            await service.run()
        with pytest.raises(RuntimeError, match="before run"):
            service.add(object(), lambda s, srv: None, _echo.DESCRIPTOR, _echo.map_error)


# -- TLS ------------------------------------------------------------------------------------


async def test_tls(certs: Certs) -> None:
    service, _ = echo_service(tls_cert=certs.server_cert, tls_key=certs.server_key)
    async with running(service):
        async with aio_channel(service.address, tls=ChannelTLS(ca=certs.ca)) as channel:
            assert await _echo.EchoClient(channel).say("over tls") == "over tls"
            assert await health_status(channel) == SERVING
        async with aio_channel(service.address) as plaintext:
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await _echo.EchoClient(plaintext).say("in the clear", deadline=2)
            assert raised.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_mutual_tls_requires_a_client_certificate(certs: Certs) -> None:
    service, _ = echo_service(
        tls_cert=certs.server_cert, tls_key=certs.server_key, tls_client_ca=certs.ca
    )
    with_cert = ChannelTLS(ca=certs.ca, cert=certs.client_cert, key=certs.client_key)
    async with running(service):
        async with aio_channel(service.address, tls=with_cert) as channel:
            assert await _echo.EchoClient(channel).say("mutual") == "mutual"
        async with aio_channel(service.address, tls=ChannelTLS(ca=certs.ca)) as anonymous:
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await _echo.EchoClient(anonymous).say("who am i", deadline=2)
            assert raised.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_server_name_override(certs: Certs) -> None:
    service, _ = echo_service(tls_cert=certs.server_cert, tls_key=certs.server_key)
    async with running(service):
        port = service.address.rsplit(":", 1)[1]
        # Dialled as an IP, verified as the name on the certificate.
        tls = ChannelTLS(ca=certs.ca, server_name="localhost")
        async with aio_channel(f"127.0.0.1:{port}", tls=tls) as channel:
            assert await _echo.EchoClient(channel).say("named") == "named"


def test_channel_tls_needs_cert_and_key_together(certs: Certs) -> None:
    with pytest.raises(ValueError, match="both or neither"):
        ChannelTLS(ca=certs.ca, cert=certs.client_cert)


def _printer(script: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL
    )


def test_read_announcements_collects_lines_up_to_ready() -> None:
    # A line split across writes, an unrelated line, then the ready line.
    proc = _printer(
        "import sys, time\n"
        "w = sys.stdout.write\n"
        "w('hello\\nNONOMAD_HTTP proxy 127.0'); sys.stdout.flush(); time.sleep(0.05)\n"
        "w('.0.1:8080\\nNONOMAD_READY proxy 127.0.0.1:4280\\n'); sys.stdout.flush()\n"
        "time.sleep(30)\n"
    )
    with proc:
        try:
            assert read_announcements(proc, timeout=30) == {
                "NONOMAD_HTTP": "127.0.0.1:8080",
                "NONOMAD_READY": "127.0.0.1:4280",
            }
        finally:
            proc.kill()


def test_read_announcements_fails_when_the_process_exits_first() -> None:
    proc = _printer("print('NONOMAD_HTTP proxy 127.0.0.1:8080'); print('boom')")
    with proc, pytest.raises(RuntimeError, match=r"not ready \(exit .*NONOMAD_HTTP"):
        read_announcements(proc, timeout=30)
