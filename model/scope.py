"""Every object a call names is of the call's app: the rule, once, for every service (issue 27).

A call is about one object, its subject: the machine it names, or the app a create or a list
names. It may name others too: the machines a new machine stands by for (`config.standbys`,
flaps' `standby_for`), the machine whose secrets it copies (`secrets_from`), the member a
supersede says serves the slot (`primary`). Each of those must be of the subject's app,
whoever calls (a token of that app, an admin's, a part of the cluster): a machine of app
`evil` whose config named a demo machine sat in the demo's slot, and a promotion of it
stopped the demo's primaries.

Here: which fields of a machine config name objects (`config_refs`), and the judgement of a
reference once its object is found (`check`, `check_held`, `check_member`). Each service
resolves what it can and calls them: flaps every reference of every request (flaps.auth: each
RPC's rule says which fields name objects), flyd the rows it holds, before it commits
anything (flyd.worker). A later object type (a volume a config mounts) adds its references
where its field is (`config_refs`, or the request's rule in flaps.auth), with its `kind`, and
each service's resolution of that kind (flaps.auth `Authorizer.owner_app`); an image is
checked where it is resolved, against its owners.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from flyd.v1 import machine_pb2 as pb
from model import slots
from model.errors import InvalidArgument

MACHINE = "machine"
"""The one kind of object a request names today."""


@dataclass(frozen=True)
class Ref:
    """An object a request names besides its subject: its `kind` and id, and the request
    field that holds the id (as an error names it: `config.standbys[0]`)."""

    field: str
    id: str
    kind: str = MACHINE


class ForeignObject(InvalidArgument):
    """A request names an object of another app than the one it is about."""


def config_refs(config: pb.MachineConfig, field: str = "config") -> list[Ref]:
    """The objects a machine config names: the machines it stands by for (the first is its
    slot). A config field that names another object adds its references here."""
    return [Ref(f"{field}.standbys[{i}]", standby) for i, standby in enumerate(config.standbys)]


def check(ref: Ref, app: str, owner: str) -> None:
    """Refuse `ref`, whose object is of app `owner`, in a call about app `app`."""
    if owner != app:
        raise ForeignObject(
            ref.field,
            f"{ref.kind} {ref.id} is of app {owner!r}, not {app!r}: a call may name only "
            "objects of the app it is about",
        )


def missing(ref: Ref) -> InvalidArgument:
    """The error for a reference to nothing."""
    return InvalidArgument(ref.field, f"{ref.kind} {ref.id} not found")


def check_held(app: str, refs: Iterable[Ref], held: Callable[[str], pb.Machine | None]) -> None:
    """Refuse any of `refs` whose machine this worker holds (`held`: its row, or None) and is
    of another app than `app`. A worker knows only its own rows: the others are flaps' to
    check, and a slot is keyed by app (`model.slots.key`), so one it cannot see is harmless."""
    for ref in refs:
        row = held(ref.id) if ref.kind == MACHINE else None
        if row is not None:
            check(ref, app, row.app)


def check_member(
    machine: pb.Machine, primary: str, primary_app: str, row: pb.Machine | None
) -> None:
    """A supersede of `machine` names `primary` (of `primary_app`, as its caller found it) as
    the member serving its slot: it must be of the machine's app, and when its `row` is at
    hand, of the machine's slot. A supersede only ever touches members of one app's slot."""
    if not primary_app:
        raise InvalidArgument("primary_app", "is required: the app of the primary named")
    check(Ref("primary_app", primary), machine.app, primary_app)
    if row is None:
        return
    ref = Ref("primary", primary)
    check(ref, machine.app, row.app)
    if slots.key(row) != slots.key(machine):
        raise InvalidArgument(
            ref.field,
            f"machine {primary} is in slot {slots.slot_of(row).id}, not in "
            f"{slots.slot_of(machine).id} with {machine.id}",
        )
