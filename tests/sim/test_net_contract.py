"""One contract, two transports: the same calls against real grpc.aio on loopback and against
the simulated network answer the same way (response, status code, details, the ErrorInfo in
the trailers, deadlines, cancellation, streams), so the simulator cannot drift from gRPC."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import grpc.aio
import pytest
from google.protobuf.wrappers_pb2 import StringValue
from google.rpc import error_details_pb2

from runtime import transport
from runtime.status import abort_with_details, error_info
from sim.net import Network
from sim.world import World

SERVICE = "contract.v1.Echo"


@dataclass
class Echo:
    """The server's side: what each method does, and what its handlers saw."""

    cancelled: list[str] = field(default_factory=list)
    seen: dict[str, Any] = field(default_factory=dict)

    async def unary(self, request: StringValue, context: Any) -> StringValue:
        word = request.value
        self.seen["metadata"] = dict(context.invocation_metadata() or ())
        self.seen["remaining"] = context.time_remaining()
        if word == "abort":
            info = error_details_pb2.ErrorInfo(reason="NO_ROOM", domain="nonomad")
            await abort_with_details(context, grpc.StatusCode.RESOURCE_EXHAUSTED, "full", info)
        if word == "set-code":
            context.set_code(grpc.StatusCode.NOT_FOUND)
            context.set_details("no such thing")
            return StringValue()
        if word == "raise":
            raise ValueError("boom")
        if word == "hang":
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled.append("unary")
                raise
        return StringValue(value=f"echo: {word}")

    async def stream(self, request: StringValue, context: Any) -> Any:
        try:
            for i in range(3):
                yield StringValue(value=f"{request.value} {i}")
                if request.value == "abort" and i == 0:
                    await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "stopped at 0")
            if request.value == "hang":
                await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.append("stream")
            raise

    def handler(self) -> grpc.GenericRpcHandler:
        decode, encode = StringValue.FromString, StringValue.SerializeToString
        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "Unary": grpc.unary_unary_rpc_method_handler(self.unary, decode, encode),
                "Stream": grpc.unary_stream_rpc_method_handler(self.stream, decode, encode),
            },
        )


@dataclass
class Client:
    """The client's side, on whichever transport the test runs."""

    address: str
    echo: Echo
    channel: grpc.aio.Channel

    def unary(self, **kwargs: Any) -> Any:
        method = self.channel.unary_unary(
            f"/{SERVICE}/Unary", StringValue.SerializeToString, StringValue.FromString
        )
        return lambda word, **more: method(StringValue(value=word), **kwargs, **more)

    def stream(self, word: str, **kwargs: Any) -> Any:
        method = self.channel.unary_stream(
            f"/{SERVICE}/Stream", StringValue.SerializeToString, StringValue.FromString
        )
        return method(StringValue(value=word), **kwargs)

    def other(self, address: str) -> grpc.aio.Channel:
        return transport.current().channel(address, credentials=None, options=(), interceptors=None)


async def eventually(check: Callable[[], bool], what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10.0
    while not check():
        assert loop.time() < deadline, f"never: {what}"
        await asyncio.sleep(0.01)


Body = Callable[[Client], Awaitable[None]]


def on_grpc(body: Body) -> None:
    async def main() -> None:
        echo = Echo()
        server = transport.GRPC.server(interceptors=None, options=())
        server.add_generic_rpc_handlers((echo.handler(),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        address = f"127.0.0.1:{port}"
        channel = transport.GRPC.channel(address, credentials=None, options=(), interceptors=None)
        try:
            await body(Client(address, echo, channel))
        finally:
            await channel.close()
            await server.stop(None)

    asyncio.run(main())


def on_sim(body: Body) -> None:
    world = World(seed=2)
    try:
        net = Network(world)
        server_node, client_node = world.add("server"), world.add("client")
        ip = net.join(server_node)
        net.join(client_node)
        echo = Echo()

        async def serve() -> int:
            server = transport.current().server(interceptors=None, options=())
            server.add_generic_rpc_handlers((echo.handler(),))
            port: int = server.add_insecure_port(f"{ip}:0")
            await server.start()
            return port

        address = f"{ip}:{world.run(server_node, serve())}"

        async def client() -> None:
            channel = transport.current().channel(
                address, credentials=None, options=(), interceptors=None
            )
            await body(Client(address, echo, channel))

        world.run(client_node, client())
    finally:
        world.close()


@pytest.fixture(params=["grpc", "sim"])
def run(request: pytest.FixtureRequest) -> Callable[[Body], None]:
    return on_grpc if request.param == "grpc" else on_sim


def test_a_unary_call_answers_and_the_handler_sees_metadata_and_its_deadline(run) -> None:  # type: ignore[no-untyped-def]
    async def body(client: Client) -> None:
        answer = await client.unary(timeout=30.0, metadata=(("x-caller", "me"),))("hi")
        assert answer.value == "echo: hi"
        assert client.echo.seen["metadata"]["x-caller"] == "me"
        # (gRPC sends the timeout coarsened, rounded up: a little over 30 s may arrive)
        assert 0 < client.echo.seen["remaining"] <= 31.0
        await client.unary()("no deadline")
        assert client.echo.seen["remaining"] is None

    run(body)


@pytest.mark.parametrize(
    ("word", "code", "details"),
    [
        ("abort", grpc.StatusCode.RESOURCE_EXHAUSTED, "full"),
        ("set-code", grpc.StatusCode.NOT_FOUND, "no such thing"),
        ("raise", grpc.StatusCode.UNKNOWN, "Unexpected <class 'ValueError'>: boom"),
    ],
)
def test_a_failed_call_carries_its_code_details_and_reason(  # type: ignore[no-untyped-def]
    run, word: str, code: grpc.StatusCode, details: str
) -> None:
    async def body(client: Client) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await client.unary(timeout=10.0)(word)
        assert caught.value.code() == code
        assert caught.value.details() == details
        info = error_info(caught.value)
        assert (info.reason if info else None) == ("NO_ROOM" if word == "abort" else None)

    run(body)


def test_a_call_past_its_deadline_fails_and_its_handler_is_cancelled(run) -> None:  # type: ignore[no-untyped-def]
    async def body(client: Client) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await client.unary(timeout=0.3)("hang")
        assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await eventually(lambda: client.echo.cancelled == ["unary"], "the handler cancelled")

    run(body)


def test_an_unknown_method_is_unimplemented_and_nobody_there_is_unavailable(run) -> None:  # type: ignore[no-untyped-def]
    async def body(client: Client) -> None:
        missing = client.channel.unary_unary(
            f"/{SERVICE}/Missing", StringValue.SerializeToString, StringValue.FromString
        )
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await missing(StringValue(), timeout=10.0)
        assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED
        host = client.address.rpartition(":")[0]
        nobody = client.other(f"{host}:9")
        try:
            stub = nobody.unary_unary(f"/{SERVICE}/Unary", StringValue.SerializeToString)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub(StringValue(), timeout=10.0)
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        finally:
            await nobody.close()

    run(body)


def test_a_stream_delivers_its_messages_in_order_then_its_status(run) -> None:  # type: ignore[no-untyped-def]
    async def body(client: Client) -> None:
        call = client.stream("n", timeout=10.0)
        assert [m.value async for m in call] == ["n 0", "n 1", "n 2"]
        assert await call.code() == grpc.StatusCode.OK
        aborted = client.stream("abort", timeout=10.0)
        assert (await aborted.read()).value == "abort 0"
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await aborted.read()
        assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert caught.value.details() == "stopped at 0"

    run(body)


def test_a_stream_the_client_cancels_cancels_its_handler(run) -> None:  # type: ignore[no-untyped-def]
    async def body(client: Client) -> None:
        call = client.stream("hang")
        got = [(await call.read()).value for _ in range(3)]
        assert got == ["hang 0", "hang 1", "hang 2"]
        assert call.cancel() is True
        assert call.cancelled()
        await eventually(lambda: client.echo.cancelled == ["stream"], "the handler cancelled")

    run(body)
