"""Bounds on what a request may hold, checked once, where a service decodes it.

Every string and bytes field of a request is at most `Limits.text` long, every repeated and
map field holds at most `Limits.items` entries, unless the field has a bound of its own
(`texts`, `counts`, by the field's full proto name, e.g. `flyd.v1.MachineConfig.cmd`; a map's
keys and values are the fields `...EnvEntry.key` and `...EnvEntry.value`), and a message named
in `sizes` (e.g. `flyd.v1.MachineConfig`) encodes to at most so many bytes wherever it appears.
A bound keyed by type serves every request that carries it: flyd and flaps share the
machine config's. `check` names the first field over its bound as it appears in the request
(`config.cmd[3]`) and the bound, and quotes nothing of the value.

`runtime.server` runs `check` on every decoded request of every service before its handler
sees it, so a handler never meets a megabyte owner string or a hundred thousand checks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from runtime.errors import InvalidArgument
from runtime.validate import quote

__all__ = ["DEFAULT_LIMITS", "Limits", "check"]

_MESSAGE = FieldDescriptor.TYPE_MESSAGE
_TEXT = (FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES)
_TIMES = {"google.protobuf.Duration", "google.protobuf.Timestamp"}


@dataclass(frozen=True)
class Limits:
    """The bounds of one service's requests; see the module docstring."""

    text: int = 1024
    """Characters of a string field (bytes of a bytes field) without a bound of its own."""
    items: int = 64
    """Entries of a repeated or map field without a bound of its own."""
    texts: Mapping[str, int] = field(default_factory=dict)
    counts: Mapping[str, int] = field(default_factory=dict)
    sizes: Mapping[str, int] = field(default_factory=dict)

    def merged(self, *others: Limits) -> Limits:
        """These bounds with each of `others`' own bounds added (theirs win on a clash)."""
        texts, counts, sizes = dict(self.texts), dict(self.counts), dict(self.sizes)
        for other in others:
            texts.update(other.texts)
            counts.update(other.counts)
            sizes.update(other.sizes)
        return Limits(self.text, self.items, texts, counts, sizes)


DEFAULT_LIMITS = Limits()


def check(message: Message, limits: Limits, path: str = "") -> None:
    """Raise InvalidArgument naming the first field of `message` over its bound (or, for a
    Duration or Timestamp, outside the range its type allows)."""
    if message.DESCRIPTOR.full_name in _TIMES:
        _check_time(message, path)
    for fd, value in message.ListFields():
        where = f"{path}.{fd.name}" if path else fd.name
        if fd.is_repeated:
            bound = limits.counts.get(fd.full_name, limits.items)
            if len(value) > bound:
                raise InvalidArgument(where, f"at most {bound} entries, got {len(value)}")
            if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
                _check_map(fd, value, limits, where)
            elif fd.type == _MESSAGE:
                for i, item in enumerate(value):
                    check(item, limits, f"{where}[{i}]")
            elif fd.type in _TEXT:
                bound = limits.texts.get(fd.full_name, limits.text)
                for i, item in enumerate(value):
                    _check_text(item, bound, f"{where}[{i}]")
        elif fd.type == _MESSAGE:
            check(value, limits, where)
        elif fd.type in _TEXT:
            _check_text(value, limits.texts.get(fd.full_name, limits.text), where)
    # After its fields, so that one field over its own bound is named as such.
    size_limit = limits.sizes.get(message.DESCRIPTOR.full_name)
    if size_limit is not None:
        size = message.ByteSize()
        if size > size_limit:
            raise InvalidArgument(
                path or message.DESCRIPTOR.name,
                f"at most {size_limit} bytes encoded, got {size}",
            )


def _check_time(value: Message, where: str) -> None:
    # A Duration of -2**63 seconds decodes; whatever converts it (JSON, datetime) raises.
    try:
        value.ToJsonString()  # type: ignore[attr-defined]
    except ValueError:
        name = value.DESCRIPTOR.name
        raise InvalidArgument(where or name, f"not a valid {name}: out of its range") from None


def _check_map(
    fd: FieldDescriptor, value: Mapping[object, object], limits: Limits, where: str
) -> None:
    entry_type = fd.message_type
    assert entry_type is not None
    key_fd = entry_type.fields_by_name["key"]
    value_fd = entry_type.fields_by_name["value"]
    key_bound = limits.texts.get(key_fd.full_name, limits.text)
    value_bound = limits.texts.get(value_fd.full_name, limits.text)
    for key, item in value.items():
        if isinstance(key, str | bytes):
            _check_text(key, key_bound, f"{where} key")
        entry = f"{where}[{quote(key, 32)}]" if isinstance(key, str) else f"{where}[{key!r}]"
        if isinstance(item, Message):
            check(item, limits, entry)
        elif isinstance(item, str | bytes):
            _check_text(item, value_bound, entry)


def _check_text(value: str | bytes, bound: int, where: str) -> None:
    if len(value) > bound:
        unit = "characters" if isinstance(value, str) else "bytes"
        raise InvalidArgument(where, f"at most {bound} {unit}, got {len(value)}")
