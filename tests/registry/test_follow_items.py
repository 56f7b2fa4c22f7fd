"""The framing of a Follow message read without parsing it (registry.replica.follow_items)."""

from __future__ import annotations

import pytest
from google.protobuf.message import DecodeError

from registry.replica import follow_items
from registry.v1 import registry_pb2 as r


def item(worker_id: str, status: int = r.MEMBER_STATUS_ALIVE) -> r.FollowResponse:
    return r.FollowResponse(worker_id=worker_id, status=status)  # type: ignore[arg-type]


def ids(message: bytes) -> list[str]:
    return [r.FollowResponse.FromString(data).worker_id for data in follow_items(message)]


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        (r.FollowResponse(batch=[item("a"), item("b"), item("c")]), ["a", "b", "c"]),
        (item("alone"), ["alone"]),
        # A batch is read as the items it carries, whatever else the message sets.
        (r.FollowResponse(worker_id="outer", batch=[item("x"), item("y")]), ["x", "y"]),
        (r.FollowResponse(), [""]),
    ],
)
def test_items_are_those_the_parsed_message_names(
    message: r.FollowResponse, expected: list[str]
) -> None:
    data = message.SerializeToString()
    assert ids(data) == expected
    parsed = r.FollowResponse.FromString(data)
    assert [i.worker_id for i in (parsed.batch or (parsed,))] == expected


def test_large_items_keep_their_bytes() -> None:
    big = item("big")
    big.item.snapshot.machines.add(id="m" * 40_000)  # a length past two varint bytes
    message = r.FollowResponse(batch=[big, item("small")]).SerializeToString()
    got = [r.FollowResponse.FromString(d) for d in follow_items(message)]
    assert got == [big, item("small")]


@pytest.mark.parametrize(
    "data",
    [
        r.FollowResponse(batch=[item("a")]).SerializeToString()[:-1],  # cut inside an item
        bytes([5 << 3 | 2, 0x80]),  # cut inside a length
        bytes([5 << 3 | 3]),  # a group: not in this message
    ],
)
def test_broken_framing_is_a_decode_error(data: bytes) -> None:
    with pytest.raises(DecodeError):
        list(follow_items(data))
