"""What the scope tables (tests/flaps/test_scope.py, tests/flyd/test_scope.py) share: every
field of every request of the contract that could name an object, read from the descriptors,
and what each one is.

An id is a string, so the walk yields every string field (plain, repeated, a map's) of a
request and of the messages inside it (a machine config, its checks, a placement decision).
Each is classified by the message that declares it (`flyd.v1.MachineConfig.standbys`), or by
its name alone where a name means one thing in every request (`machine_id`, `lease_nonce`):

- SUBJECT: the object the call is about (its machine, the app it creates in or lists);
- REFERENCE: another object the call names, which must be of the subject's app: each has a
  case in the table that names a foreign app's object there, refused with nothing changed;
- ELSEWHERE: an object whose check another rule owns (an image: its owners; a worker: the
  fleet's operations);
- NOTHING: a name, a signal, a nonce, text: no object.

A field the tables do not classify fails the walk: a new request field that names an object
cannot arrive without a rule.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TypeVar

from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor
from google.protobuf.message import Message

M = TypeVar("M", bound=Message)

SUBJECT, REFERENCE, ELSEWHERE, NOTHING = "subject", "reference", "elsewhere", "nothing"


@dataclass(frozen=True)
class Field:
    """A string field as one request reaches it: its `path` in the request (`config.standbys[]`,
    `config.env{}`) and its declaration (`flyd.v1.MachineConfig.standbys`)."""

    path: str
    declared: str


def fields(method: MethodDescriptor) -> list[Field]:
    """Every string field the method's request can carry, at any depth."""
    return list(_walk(method.input_type, "", ()))


def _walk(message: Descriptor, prefix: str, seen: tuple[str, ...]) -> Iterator[Field]:
    for f in message.fields:
        path, declared = prefix + f.name, f"{message.full_name}.{f.name}"
        if f.type == FieldDescriptor.TYPE_MESSAGE:
            inner = f.message_type
            if inner.GetOptions().map_entry:
                key, value = inner.fields_by_name["key"], inner.fields_by_name["value"]
                if FieldDescriptor.TYPE_STRING in (key.type, value.type):
                    yield Field(path + "{}", declared)
                if value.type == FieldDescriptor.TYPE_MESSAGE:
                    yield from _walk(value.message_type, path + "{}.", seen)
                continue
            if inner.full_name.startswith("google.protobuf.") or inner.full_name in seen:
                continue
            step = "[]." if f.is_repeated else "."
            yield from _walk(inner, path + step, (*seen, inner.full_name))
        elif f.type in (FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES):
            yield Field(path + ("[]" if f.is_repeated else ""), declared)


BY_NAME: dict[str, tuple[str, str]] = {
    "machine_id": (SUBJECT, "the machine the call is about (its token's check)"),
    "lease_nonce": (NOTHING, "a lease's nonce, the machine's own"),
    "nonce": (NOTHING, "a lease's nonce, the machine's own"),
    "signal": (NOTHING, "a signal name"),
    "owner": (NOTHING, "who holds a lease, for humans"),
    "description": (NOTHING, "text for humans"),
    "page_token": (NOTHING, "a position in a list the caller may read"),
    "instance_id": (NOTHING, "an instance of the machine the call is about"),
    "name": (NOTHING, "a machine's name, for humans"),
}
"""Field names that mean one thing in every request."""

CONFIG: dict[str, tuple[str, str]] = {
    "flyd.v1.MachineConfig.image": (ELSEWHERE, "an image: its owners' check (issue 27, 7)"),
    "flyd.v1.MachineConfig.entrypoint": (NOTHING, "the machine's command"),
    "flyd.v1.MachineConfig.cmd": (NOTHING, "the machine's command"),
    "flyd.v1.MachineConfig.env": (NOTHING, "the machine's environment"),
    "flyd.v1.MachineConfig.metadata": (NOTHING, "labels of the machine's own"),
    "flyd.v1.MachineConfig.secrets": (NOTHING, "the machine's secrets"),
    "flyd.v1.MachineConfig.standbys": (REFERENCE, "the machines it stands by for: its slot"),
    "flyd.v1.CheckConfig.name": (NOTHING, "a check's name"),
    "flyd.v1.HttpCheck.path": (NOTHING, "a path on the machine itself"),
    "flyd.v1.HttpCheck.method": (NOTHING, "an HTTP method"),
    "flyd.v1.StopConfig.signal": (NOTHING, "a signal name"),
    "flyd.v1.PlacementConfig.required_labels": (NOTHING, "worker labels to match"),
}
"""A machine config: what flaps' and flyd's creates and updates carry."""


def classify(field: Field, table: Mapping[str, tuple[str, str]]) -> tuple[str, str] | None:
    """What `field` is, by its declaration (in `table`, then CONFIG) or its name; None when
    nothing says."""
    for rules in (table, CONFIG):
        if field.declared in rules:
            return rules[field.declared]
    return BY_NAME.get(field.declared.rsplit(".", 1)[1])


def references(method: MethodDescriptor, table: Mapping[str, tuple[str, str]]) -> set[str]:
    """The paths of the method's request that name another object (REFERENCE)."""
    return {f.path for f in fields(method) if (classify(f, table) or ("",))[0] == REFERENCE}


def as_path(field: str) -> str:
    """A field as an error names it (`config.standbys[0]`) as a path (`config.standbys[]`)."""
    return re.sub(r"\[\d+\]", "[]", field)


def filled(message: M) -> M:
    """`message` with every string field (at any depth) set to an id of its own, `id-1`,
    `id-2`, ...: what a rule reads the objects a request names from."""
    counter = itertools.count(1)
    _fill(message, counter, ())
    return message


def _fill(message: Message, counter: Iterator[int], seen: tuple[str, ...]) -> None:
    for f in message.DESCRIPTOR.fields:
        value = getattr(message, f.name)
        if f.type == FieldDescriptor.TYPE_STRING:
            if f.is_repeated:
                value.append(f"id-{next(counter)}")
            else:
                setattr(message, f.name, f"id-{next(counter)}")
        elif f.type == FieldDescriptor.TYPE_MESSAGE:
            inner = f.message_type
            if inner.GetOptions().map_entry:
                kind = inner.fields_by_name["value"]
                if kind.type == FieldDescriptor.TYPE_MESSAGE:
                    _fill(value[f"id-{next(counter)}"], counter, seen)
                elif kind.type == FieldDescriptor.TYPE_STRING:
                    value[f"id-{next(counter)}"] = f"id-{next(counter)}"
            elif not inner.full_name.startswith("google.protobuf.") and inner.full_name not in seen:
                item = value.add() if f.is_repeated else value
                _fill(item, counter, (*seen, inner.full_name))
