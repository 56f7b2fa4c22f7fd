"""runtime.streams: per-caller caps on long calls, and who a caller is when nothing names it."""

from __future__ import annotations

import contextlib
from typing import Any

import grpc
import pytest
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2

from runtime.streams import STREAM_CAP, CallerCaps, caller_name, peer_host


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str, metadata: Any) -> None:
        super().__init__(details)
        self.code, self.details, self.metadata = code, details, metadata


class Context:
    """What the caps use of a grpc.aio.ServicerContext: abort, peer, the auth context."""

    def __init__(self, peer: str = "ipv4:127.0.0.1:5000", name: bytes | None = None) -> None:
        self._peer = peer
        self._auth = {"x509_pem_cert": [b"pem"], "x509_common_name": [name]} if name else {}

    async def abort(self, code: grpc.StatusCode, details: str, metadata: Any = ()) -> None:
        raise Aborted(code, details, metadata)

    def peer(self) -> str:
        return self._peer

    def auth_context(self) -> dict[str, list[bytes]]:
        return self._auth

    def peer_identity_key(self) -> str | None:
        return "x509_common_name" if self._auth else None


def error_info(aborted: Aborted) -> error_details_pb2.ErrorInfo:
    (binary,) = [v for k, v in aborted.metadata if k == "grpc-status-details-bin"]
    status = status_pb2.Status.FromString(binary)
    (detail,) = status.details
    info = error_details_pb2.ErrorInfo()
    assert any_pb2.Any.Unpack(detail, info)
    return info


async def test_a_caller_past_its_cap_is_refused_naming_it_and_fits_again_once_one_ends() -> None:
    caps = CallerCaps(limit=2, setting="--streams-per-caller", domain="test.nonomad")
    ctx = Context()
    async with contextlib.AsyncExitStack() as stack:
        for _ in range(2):
            await stack.enter_async_context(caps.hold(ctx, "follow streams", "token t1"))
        # Another caller, and another kind, count apart.
        async with (
            caps.hold(ctx, "follow streams", "token t2"),
            caps.hold(ctx, "waits", "token t1"),
        ):
            assert caps.open("follow streams", "token t1") == 2
        with pytest.raises(Aborted) as raised:
            async with caps.hold(ctx, "follow streams", "token t1"):
                pytest.fail("a third stream was let in")
        assert raised.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert raised.value.details == (
            "token t1 has 2 follow streams open, the most one caller may "
            "(--streams-per-caller 2); end one first"
        )
        info = error_info(raised.value)
        assert (info.reason, info.domain) == (STREAM_CAP, "test.nonomad")
        assert dict(info.metadata) == {
            "kind": "follow streams",
            "caller": "token t1",
            "limit": "2",
        }
        assert caps.open("follow streams", "token t1") == 2  # the refusal counted nothing
    assert caps.open("follow streams", "token t1") == 0
    async with caps.hold(ctx, "follow streams", "token t1"):
        assert caps.open("follow streams", "token t1") == 1


async def test_a_call_that_fails_gives_its_place_back() -> None:
    caps = CallerCaps(limit=1, setting="--x", domain="d")
    with pytest.raises(RuntimeError):
        async with caps.hold(Context(), "waits", "c"):
            raise RuntimeError("the wait failed")
    assert caps.open("waits", "c") == 0


@pytest.mark.parametrize(
    ("peer", "name", "caller"),
    [
        ("ipv4:127.0.0.1:5000", None, "host 127.0.0.1"),
        ("ipv6:[::1]:5000", None, "host ::1"),
        ("unix:/run/flyd.sock", None, "host unix:/run/flyd.sock"),
        ("", None, "host an unknown caller"),
        ("ipv4:10.0.0.2:41000", b"flaps", "certificate 'flaps'"),
    ],
)
def test_a_caller_is_its_certificate_or_else_its_host(
    peer: str, name: bytes | None, caller: str
) -> None:
    assert caller_name(Context(peer, name)) == caller
    if name is None:
        assert caller.removeprefix("host ") == peer_host(Context(peer))
