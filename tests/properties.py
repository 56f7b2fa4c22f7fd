"""Hostile request messages for the property suite (tests/test_properties.py).

`hostile(base)` is a hypothesis strategy of messages made from a valid request (`valid`: an
image, a small guest, a machine id the worker has) by setting one to three of its fields, at
any depth, to values a service must refuse or survive: strings far over any bound, names with
a trailing newline, path tricks and NUL bytes, numbers at the ends of their type, enum numbers
no enum names, lists and maps of hundreds or thousands of entries, nested messages of arbitrary
content (`requests`). Everything else stays valid, so a request gets past the first check and
into the service's logic more often than a message drawn from nothing would.

`requests(descriptor)` is the message drawn from nothing: every field set or not, values from
the same pools, nested messages down to a bounded depth.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.duration_pb2 import Duration
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from hypothesis import strategies as st

from flyd.v1 import machine_pb2 as pb

F = FieldDescriptor
KNOWN = ["", "m1", "web", "ams", "syd", "w1", "s1", "app:v1", "SIGTERM", "SIGSTOP", "/"]
HOSTILE = ["fzmid\n", "web\n", "w1\n", "a" * 70, "../..", "/../../etc", "\x00", "Web", "-x-", "a b"]

TEXT = st.one_of(
    st.sampled_from(KNOWN),
    st.sampled_from(HOSTILE),
    st.text(max_size=40),
    st.sampled_from([1025, 4097, 70_000]).map(lambda n: "a" * n),  # over the bounds
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
# Long lists and maps: over every bound of entries, and far over.
LONG = [65, 300, 5000]


@dataclass(frozen=True)
class Known:
    """What a valid request names: a machine the worker has, a fresh id for a create."""

    machine_id: str
    fresh_id: str
    config: pb.MachineConfig
    state: int = 0  # the machine's
    app: str = "web"
    region: str = "ams"
    worker_id: str = "w1"


def valid(descriptor: Descriptor, known: Known) -> Message:
    """A request of `descriptor`'s type that a service would accept: its names, its config,
    the machine's state, a short wait and a lease's ttl filled in from `known` (by field
    name), the rest left at defaults."""
    message = GetMessageClass(descriptor)()
    names = {
        "machine_id": known.fresh_id if descriptor.name == "CreateMachineRequest" else "",
        "app": known.app,
        "region": known.region,
        "worker_id": known.worker_id,
        "signal": "SIGTERM",
        "primary": known.fresh_id,
        "primary_app": known.app,  # a supersede names its primary's app (model.scope)
    }
    if not names["machine_id"]:
        names["machine_id"] = known.machine_id
    for fd in descriptor.fields:
        if fd.is_repeated:
            continue
        if fd.type == F.TYPE_STRING and fd.name in names:
            setattr(message, fd.name, names[fd.name])
        elif fd.message_type is pb.MachineConfig.DESCRIPTOR:
            getattr(message, fd.name).CopyFrom(known.config)
        elif fd.message_type is Duration.DESCRIPTOR and fd.name == "timeout":
            getattr(message, fd.name).CopyFrom(Duration(nanos=50_000_000))  # a short wait
        elif fd.message_type is Duration.DESCRIPTOR and fd.name == "ttl":
            getattr(message, fd.name).CopyFrom(Duration(seconds=60))  # a lease's
        elif fd.enum_type is pb.MachineState.DESCRIPTOR and fd.name == "state":
            setattr(message, fd.name, known.state)
        elif fd.name == "generation" and fd.type == F.TYPE_UINT64:
            setattr(message, fd.name, 1)
    return message


def _integers(lo: int, hi: int) -> st.SearchStrategy[int]:
    edges = [v for v in (lo, hi, -1, 0, 1, hi // 2) if lo <= v <= hi]
    return st.one_of(st.sampled_from(edges), st.integers(-2, 200).filter(lambda n: lo <= n <= hi))


def _scalar(fd: FieldDescriptor) -> st.SearchStrategy[Any]:
    if fd.type == F.TYPE_STRING:
        return TEXT
    if fd.type == F.TYPE_BYTES:
        return st.one_of(st.binary(max_size=64), st.just(b"\xff" * 70_000))
    if fd.type == F.TYPE_BOOL:
        return st.booleans()
    if fd.type in (F.TYPE_DOUBLE, F.TYPE_FLOAT):
        return st.one_of(
            st.sampled_from([-1.0, 0.0, 3.0e38, -3.0e38]),
            st.floats(allow_nan=False, allow_infinity=False, width=32),
        )
    if fd.type == F.TYPE_ENUM:
        assert fd.enum_type is not None
        named = [v.number for v in fd.enum_type.values]
        return st.one_of(st.sampled_from(named), st.sampled_from([-1, 99, 2**31 - 1]))
    lo, hi = _INT_RANGES[fd.type]
    return _integers(lo, hi)


def _small(fd: FieldDescriptor) -> st.SearchStrategy[Any]:
    """Short values of field `fd`: what a long list repeats (a long list of long strings
    would be hundreds of megabytes, refused for its size before anything else is read)."""
    if fd.type == F.TYPE_MESSAGE:
        return st.just(GetMessageClass(fd.message_type)())
    if fd.type == F.TYPE_STRING:
        return st.sampled_from(KNOWN + HOSTILE[:3])
    if fd.type == F.TYPE_BYTES:
        return st.binary(max_size=8)
    return _scalar(fd)


def _many(item: st.SearchStrategy[Any], small: st.SearchStrategy[Any]) -> Any:
    """Mostly short lists of `item`; now and then one far over any bound of entries, of
    `small` values (the same one repeated: drawing thousands would be slow)."""
    return st.one_of(
        st.lists(item, max_size=3),
        st.tuples(st.sampled_from(LONG), small).map(lambda drawn: [drawn[1]] * drawn[0]),
    )


def _entries(key_fd: FieldDescriptor, value: st.SearchStrategy[Any], small: Any) -> Any:
    """Map entries: mostly a few; now and then thousands, with distinct keys."""

    def keys(n: int) -> list[Any]:
        return [f"k{i}" for i in range(n)] if key_fd.type == F.TYPE_STRING else list(range(n))

    return st.one_of(
        st.lists(st.tuples(_scalar(key_fd), value), max_size=3),
        st.tuples(st.sampled_from(LONG), small).map(
            lambda drawn: [(key, drawn[1]) for key in keys(drawn[0])]
        ),
    )


@functools.cache
def requests(descriptor: Descriptor, depth: int = 0) -> st.SearchStrategy[Message]:
    """Messages of `descriptor`'s type drawn from nothing; nested messages down to a bounded
    depth."""
    fields: dict[str, st.SearchStrategy[Any]] = {}
    for fd in descriptor.fields:
        value = _field(fd, depth)
        if value is not None:
            fields[fd.name] = st.one_of(st.none(), value)

    @st.composite
    def build(draw: st.DrawFn) -> Message:
        message = GetMessageClass(descriptor)()
        for name, strategy in fields.items():
            value = draw(strategy)
            if value is not None:
                _assign(message, descriptor.fields_by_name[name], value)
        return message

    return build()


def _field(fd: FieldDescriptor, depth: int) -> st.SearchStrategy[Any] | None:
    """Values for field `fd`: a list for a repeated one, (key, value) pairs for a map."""
    if _is_map(fd):
        key_fd = fd.message_type.fields_by_name["key"]
        value_fd = fd.message_type.fields_by_name["value"]
        if value_fd.type == F.TYPE_MESSAGE:
            if depth >= 3:
                return None
            value: st.SearchStrategy[Any] = requests(value_fd.message_type, depth + 1)
        else:
            value = _scalar(value_fd)
        return _entries(key_fd, value, _small(value_fd))
    if fd.type == F.TYPE_MESSAGE:
        if depth >= 3:
            return None
        inner = requests(fd.message_type, depth + 1)
        return _many(inner, _small(fd)) if fd.is_repeated else inner
    return _many(_scalar(fd), _small(fd)) if fd.is_repeated else _scalar(fd)


def _is_map(fd: FieldDescriptor) -> bool:
    return fd.message_type is not None and fd.message_type.GetOptions().map_entry


def _assign(message: Message, fd: FieldDescriptor, value: Any) -> None:
    """Set field `fd` of `message` to `value` (replacing a list or map, not adding to it)."""
    if _is_map(fd):
        target = getattr(message, fd.name)
        target.clear()
        for key, item in value:
            if isinstance(item, Message):
                target[key].CopyFrom(item)
            else:
                target[key] = item
    elif fd.is_repeated:
        target = getattr(message, fd.name)
        del target[:]
        if fd.type == F.TYPE_MESSAGE:
            for item in value:
                target.add().CopyFrom(item)
        else:
            target.extend(value)
    elif fd.type == F.TYPE_MESSAGE:
        getattr(message, fd.name).CopyFrom(value)
    else:
        setattr(message, fd.name, value)


@st.composite
def hostile(draw: st.DrawFn, base: Message) -> Message:
    """`base` with up to three fields, at any depth, set to hostile values (none: `base`
    itself, which hypothesis tries first)."""
    message = type(base)()
    message.CopyFrom(base)
    for _ in range(draw(st.integers(0, 3))):
        target = message
        depth = 0
        while target.DESCRIPTOR.fields:
            fd = draw(st.sampled_from(list(target.DESCRIPTOR.fields)))
            nested = fd.type == F.TYPE_MESSAGE and not fd.is_repeated and depth < 3
            if nested and draw(st.booleans()):  # into the message, to change one of its fields
                target = getattr(target, fd.name)
                depth += 1
                continue
            strategy = _field(fd, depth)
            if strategy is not None:
                _assign(target, fd, draw(strategy))
            break
    return message
