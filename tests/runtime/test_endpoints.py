"""Bearer-token authentication and the Prometheus endpoint of a Service."""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import grpc.aio
import pytest
from google.protobuf import wrappers_pb2
from grpc_health.v1 import health_pb2
from prometheus_client import Counter

from runtime import ServiceSettings, SettingsError, aio_channel, load_settings
from tests.runtime import _echo
from tests.runtime._support import running
from tests.runtime.test_server import SERVING, echo_service, health_status


def _say(channel: grpc.aio.Channel) -> grpc.aio.UnaryUnaryMultiCallable:
    return channel.unary_unary(
        f"/{_echo.SERVICE_NAME}/Say",
        request_serializer=wrappers_pb2.StringValue.SerializeToString,
        response_deserializer=wrappers_pb2.StringValue.FromString,
    )


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text("s3cret\n")
    return path


async def test_token_is_required_except_for_health(token_file: Path) -> None:
    service, _ = echo_service(auth_token_file=token_file)
    async with running(service), aio_channel(service.address) as channel:
        say = _say(channel)
        request = wrappers_pb2.StringValue(value="hi")
        reply = await say(request, timeout=5, metadata=(("authorization", "Bearer s3cret"),))
        assert reply.value == "hi"

        for metadata, detail in (
            ((), "missing authorization metadata"),
            ((("authorization", "Bearer nope"),), "invalid bearer token"),
            ((("authorization", "s3cret"),), "invalid bearer token"),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await say(request, timeout=5, metadata=metadata)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert detail in (info.value.details() or "")

        # Streams are refused the same way.
        count = _echo.EchoClient(channel).stream_count("3")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await anext(count)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED

        assert await health_status(channel) == SERVING == health_pb2.HealthCheckResponse.SERVING


def test_empty_or_missing_token_file_is_a_named_setting_error(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_text("  \n")
    with pytest.raises(SettingsError, match="auth_token_file: token file is empty"):
        load_settings(ServiceSettings, ["--auth-token-file", str(empty)], prog="svc")
    with pytest.raises(SettingsError, match="auth_token_file: file not found"):
        load_settings(ServiceSettings, ["--auth-token-file", str(tmp_path / "x")], prog="svc")
    with pytest.raises(SettingsError, match="metrics_listen"):
        load_settings(ServiceSettings, ["--metrics-listen", "nope"], prog="svc")


_probe = Counter("nonomad_test_endpoint_probes", "Counted by the metrics endpoint test.")


async def test_metrics_endpoint_serves_the_registry(capsys: pytest.CaptureFixture[str]) -> None:
    service, _ = echo_service("flaps", metrics_listen="127.0.0.1:0")
    _probe.inc(3)
    async with running(service):
        line = next(
            ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("NONOMAD_METRICS")
        )
        _, name, address = line.split()
        assert name == "flaps"
        body = await asyncio.to_thread(
            lambda: urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
        )
        assert "nonomad_test_endpoint_probes_total 3.0" in body
    # Closed with the service.
    with pytest.raises(urllib.error.URLError, match="refused"):
        await asyncio.to_thread(
            lambda: urllib.request.urlopen(f"http://{address}/metrics", timeout=2).read()
        )
