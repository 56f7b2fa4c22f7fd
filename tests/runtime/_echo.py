"""A tiny gRPC service for the runtime tests, built without generated code.

Its descriptor goes into the default pool, as generated modules do, so reflection and grpcurl
can describe and call it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import grpc
import grpc.aio
from google.protobuf import descriptor_pb2, descriptor_pool, wrappers_pb2
from google.protobuf.descriptor import ServiceDescriptor
from google.rpc.error_details_pb2 import ErrorInfo

from runtime import Mapped, cluster_peer

SERVICE_NAME = "nonomad.test.v1.EchoService"
_STRING = ".google.protobuf.StringValue"


def _register() -> ServiceDescriptor:
    pool = descriptor_pool.Default()
    try:
        return pool.FindServiceByName(SERVICE_NAME)
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto(
        name="nonomad/test/v1/echo.proto",
        package="nonomad.test.v1",
        syntax="proto3",
        dependency=[wrappers_pb2.DESCRIPTOR.name],
    )
    service = proto.service.add(name="EchoService")
    service.method.add(name="Say", input_type=_STRING, output_type=_STRING)
    service.method.add(name="Count", input_type=_STRING, output_type=_STRING, server_streaming=True)
    pool.AddSerializedFile(proto.SerializeToString())
    return pool.FindServiceByName(SERVICE_NAME)


DESCRIPTOR: ServiceDescriptor = _register()


class EchoRefused(Exception):
    """The domain error of the echo service: mapped to FAILED_PRECONDITION, with an ErrorInfo
    when it has a `reason`."""

    def __init__(self, message: str, reason: str = "") -> None:
        super().__init__(message)
        self.reason = reason


REASON_DOMAIN = "echo.test"


def map_error(exc: Exception) -> Mapped | None:
    """The echo service's one place where domain errors become statuses."""
    if isinstance(exc, EchoRefused):
        if exc.reason:
            info = ErrorInfo(reason=exc.reason, domain=REASON_DOMAIN, metadata={"word": "rude"})
            return grpc.StatusCode.FAILED_PRECONDITION, str(exc), info
        return grpc.StatusCode.FAILED_PRECONDITION, str(exc)
    return None


class EchoServicer:
    """Say echoes its input, except for a few magic words (`whoami`: the caller's certificate
    name); Count streams 0..n-1."""

    def __init__(self) -> None:
        self.slow_started = asyncio.Event()
        self.release_slow = asyncio.Event()
        self.said: list[str] = []

    async def Say(
        self, request: wrappers_pb2.StringValue, context: Any
    ) -> wrappers_pb2.StringValue:
        self.said.append(request.value)
        match request.value:
            case "refuse":
                raise EchoRefused("echo refuses to say that")
            case "rude":
                raise EchoRefused("echo will not be rude", reason="TOO_RUDE")
            case "crash":
                raise RuntimeError("secret internal detail")
            case "whoami":
                return wrappers_pb2.StringValue(value=cluster_peer(context) or "anonymous")
            case "abort":
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, "handler aborted itself")
            case "slow":
                # The test controls when this in-flight call may finish.
                self.slow_started.set()
                await self.release_slow.wait()
        return wrappers_pb2.StringValue(value=request.value)

    async def Count(
        self, request: wrappers_pb2.StringValue, context: Any
    ) -> AsyncGenerator[wrappers_pb2.StringValue, None]:
        count, _, then = request.value.partition(" then ")
        for i in range(int(count)):
            yield wrappers_pb2.StringValue(value=str(i))
        if then == "refuse":
            raise EchoRefused("stream refused midway")
        if then == "crash":
            raise RuntimeError("secret stream detail")


def add_EchoServiceServicer_to_server(servicer: EchoServicer, server: Any) -> None:
    """What grpcio-tools would generate for the service."""
    handlers = {
        "Say": grpc.unary_unary_rpc_method_handler(
            servicer.Say,
            request_deserializer=wrappers_pb2.StringValue.FromString,
            response_serializer=wrappers_pb2.StringValue.SerializeToString,
        ),
        "Count": grpc.unary_stream_rpc_method_handler(
            servicer.Count,
            request_deserializer=wrappers_pb2.StringValue.FromString,
            response_serializer=wrappers_pb2.StringValue.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))


class EchoClient:
    """Calls the echo service on a channel."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self._say = channel.unary_unary(
            f"/{SERVICE_NAME}/Say",
            request_serializer=wrappers_pb2.StringValue.SerializeToString,
            response_deserializer=wrappers_pb2.StringValue.FromString,
        )
        self._count = channel.unary_stream(
            f"/{SERVICE_NAME}/Count",
            request_serializer=wrappers_pb2.StringValue.SerializeToString,
            response_deserializer=wrappers_pb2.StringValue.FromString,
        )

    async def say(self, value: str, deadline: float = 5.0) -> str:
        response = await self._say(wrappers_pb2.StringValue(value=value), timeout=deadline)
        return str(response.value)

    async def stream_count(self, value: str, deadline: float = 5.0) -> AsyncIterator[str]:
        call = self._count(wrappers_pb2.StringValue(value=value), timeout=deadline)
        async for item in call:
            yield str(item.value)
