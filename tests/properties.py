"""Arbitrary request messages for the property suite (tests/test_properties.py).

`requests(descriptor)` is a hypothesis strategy of messages of any type, built from its
descriptor: every field may be set or not, strings are names the services know, names they
refuse (a trailing newline), arbitrary text or far over any bound, numbers span their whole
type, enums include numbers no enum names, lists are empty, short or long. Most values stay
small so that a request gets past the first check and into the service's logic.
"""

from __future__ import annotations

from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from hypothesis import strategies as st

F = FieldDescriptor
KNOWN = ["", "m1", "m2", "web", "ams", "syd", "w1", "w2", "app:v1", "SIGTERM", "SIGSTOP", "/"]
HOSTILE = ["fzmid\n", "a" * 70, "../..", "\x00", "Web", "-x-", "a b"]

TEXT = st.one_of(
    st.sampled_from(KNOWN),
    st.sampled_from(HOSTILE),
    st.text(max_size=40),
    st.integers(1000, 3000).map(lambda n: "a" * n),  # over the default bound of 1024
    st.just("b" * 70_000),  # over every bound
)
_INT_RANGES = {
    F.TYPE_INT32: (-(2**31), 2**31 - 1),
    F.TYPE_SINT32: (-(2**31), 2**31 - 1),
    F.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    F.TYPE_UINT32: (0, 2**32 - 1),
    F.TYPE_FIXED32: (0, 2**32 - 1),
    F.TYPE_INT64: (-(2**63), 2**63 - 1),
    F.TYPE_SINT64: (-(2**63), 2**63 - 1),
    F.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    F.TYPE_UINT64: (0, 2**64 - 1),
    F.TYPE_FIXED64: (0, 2**64 - 1),
}


def _integers(lo: int, hi: int) -> st.SearchStrategy[int]:
    return st.one_of(st.integers(-2, 200), st.integers(lo, hi)).filter(lambda n: lo <= n <= hi)


def _scalar(fd: FieldDescriptor) -> st.SearchStrategy[Any]:
    if fd.type == F.TYPE_STRING:
        return TEXT
    if fd.type == F.TYPE_BYTES:
        return st.binary(max_size=64)
    if fd.type == F.TYPE_BOOL:
        return st.booleans()
    if fd.type in (F.TYPE_DOUBLE, F.TYPE_FLOAT):
        return st.floats(allow_nan=False, allow_infinity=False, width=32)
    if fd.type == F.TYPE_ENUM:
        assert fd.enum_type is not None
        named = [v.number for v in fd.enum_type.values]
        return st.one_of(st.sampled_from(named), st.integers(-5, 50))
    lo, hi = _INT_RANGES[fd.type]
    return _integers(lo, hi)


def requests(descriptor: Descriptor, depth: int = 0) -> st.SearchStrategy[Message]:
    """Messages of `descriptor`'s type; nested messages down to a bounded depth."""
    cls = GetMessageClass(descriptor)
    fields: dict[str, st.SearchStrategy[Any]] = {}
    for fd in descriptor.fields:
        value = _field(fd, depth)
        if value is not None:
            fields[fd.name] = st.one_of(st.none(), value)

    @st.composite
    def build(draw: st.DrawFn) -> Message:
        message = cls()
        for name, strategy in fields.items():
            value = draw(strategy)
            if value is None:
                continue
            fd = descriptor.fields_by_name[name]
            target = getattr(message, name) if fd.is_repeated or fd.type == F.TYPE_MESSAGE else None
            if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
                for key, item in value:
                    if isinstance(item, Message):
                        target[key].CopyFrom(item)
                    else:
                        target[key] = item
            elif fd.is_repeated:
                target.extend(value) if fd.type != F.TYPE_MESSAGE else [
                    target.add().CopyFrom(v) for v in value
                ]
            elif fd.type == F.TYPE_MESSAGE:
                target.CopyFrom(value)
            else:
                setattr(message, name, value)
        return message

    return build()


def _field(fd: FieldDescriptor, depth: int) -> st.SearchStrategy[Any] | None:
    if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
        key = _scalar(fd.message_type.fields_by_name["key"])
        value_fd = fd.message_type.fields_by_name["value"]
        if value_fd.type == F.TYPE_MESSAGE:
            if depth >= 3:
                return None
            value: st.SearchStrategy[Any] = requests(value_fd.message_type, depth + 1)
        else:
            value = _scalar(value_fd)
        return _lists(st.tuples(key, value))
    if fd.type == F.TYPE_MESSAGE:
        if depth >= 3:
            return None
        inner = requests(fd.message_type, depth + 1)
        return _lists(inner) if fd.is_repeated else inner
    return _lists(_scalar(fd)) if fd.is_repeated else _scalar(fd)


def _lists(item: st.SearchStrategy[Any]) -> st.SearchStrategy[list[Any]]:
    """Mostly short lists; now and then one over the default bound of 64 entries."""
    return st.one_of(
        st.lists(item, max_size=3),
        st.integers(65, 300).flatmap(lambda n: st.lists(item, min_size=n, max_size=n)),
    )
