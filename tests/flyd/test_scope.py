"""flyd's side of "every object a call names is checked against its scope" (issue 27, item 1).

A worker's callers are the cluster's parts, so the scope of a call is the app it is about: the
machine's, or the app a create names. Every other object the request names must be of that
app, as far as this worker holds it: flyd refuses even flaps when the machine a config stands
by for, or the primary a supersede names, is another app's row here (a supersede also carries
the primary's app, `primary_app`, for a primary held elsewhere). What a worker cannot see is
harmless: a slot is (app, slot id) everywhere, so a foreign machine naming a slot id stays in
a slot of its own app's.

The table is over the whole WorkerService: every string field of every request (tests.scope),
each one classified, and each that names another object refused with a foreign app's id, with
nothing committed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
import pytest

from flyd.v1 import machine_pb2 as pb
from flyd.v1 import worker_pb2 as w
from model import scope, slots
from tests.flyd.servicer_support import (
    Stub,
    draining,
    flyd,
    grpc_add_to_server,
    grpc_servicer,
    grpc_stub_cls,
    heartbeat_interval,
    log_read_bytes,
    streams_per_caller,
)
from tests.flyd.support import CREATED, STARTED, STOPPED, Flyd, config
from tests.scope import (
    NOTHING,
    REFERENCE,
    SUBJECT,
    as_path,
    classify,
    fields,
    references,
)
from tests.servicers import INVALID, T, answer, refused

__all__ = [
    "draining",
    "flyd",
    "grpc_add_to_server",
    "grpc_servicer",
    "grpc_stub_cls",
    "heartbeat_interval",
    "log_read_bytes",
    "streams_per_caller",
]

SERVICE = w.DESCRIPTOR.services_by_name["WorkerService"]
HIGH = 1_000_000
_RECORD = "flaps' record of why the machine is here: kept, acted on by nobody"

FIELDS: dict[str, tuple[str, str]] = {
    "flyd.v1.CreateMachineRequest.app": (SUBJECT, "the app the machine is made in"),
    "flyd.v1.CreateMachineRequest.idempotency_key": (NOTHING, "a key held per (app, key)"),
    "flyd.v1.ListMachinesRequest.app": (SUBJECT, "the app listed"),
    "flyd.v1.WatchEventsRequest.log_epoch": (NOTHING, "which log a position counts in"),
    "flyd.v1.SupersedeMachineRequest.primary": (REFERENCE, "the member serving the slot"),
    "flyd.v1.SupersedeMachineRequest.primary_app": (REFERENCE, "that member's app"),
    **{
        f"flyd.v1.{name}": (NOTHING, _RECORD)
        for name in (
            "PlacementDecision.worker_id",
            "RegionPlacement.region",
            "RegionPlacement.outcome",
            "RegionPlacement.keyed_worker_id",
            "RegionPlacement.rejections_by_reason",
            "PlacementCandidate.worker_id",
            "PlacementCandidate.sub_scores",
            "PlacementRejection.worker_id",
            "PlacementRejection.reason",
            "PlacementRejection.detail",
        )
    },
}
"""WorkerService's request fields beyond tests.scope's shared ones."""


def standing_by(*targets: str) -> pb.MachineConfig:
    made = config()
    made.standbys.extend(targets)
    return made


# (rpc, the field, the request naming a foreign app's object there, the field the error names)
Case = tuple[str, str, Callable[[], Any], str]
CASES: list[Case] = [
    # evil's machine stands by for the demo's primary: its slot would be the demo's.
    ("CreateMachine", "config.standbys[]", lambda: w.CreateMachineRequest(
        machine_id="e2", app="evil", config=standing_by("d1")), "config.standbys[0]"),
    ("CreateMachine", "config.standbys[]", lambda: w.CreateMachineRequest(
        machine_id="e2", app="evil", config=standing_by("e1", "d2")), "config.standbys[1]"),
    ("UpdateMachine", "config.standbys[]", lambda: w.UpdateMachineRequest(
        machine_id="e1", config=standing_by("d1")), "config.standbys[0]"),
    # The demo's primary told that evil's machine serves its slot, at a generation far above.
    ("SupersedeMachine", "primary_app", lambda: w.SupersedeMachineRequest(
        machine_id="d1", generation=HIGH, primary="w9-e", primary_app="evil"), "primary_app"),
    # ... by a caller that says the primary is the demo's: its row here says otherwise.
    ("SupersedeMachine", "primary", lambda: w.SupersedeMachineRequest(
        machine_id="d1", generation=HIGH, primary="e1", primary_app="demo"), "primary"),
]  # fmt: skip


def test_every_field_of_every_request_is_classified_and_each_reference_has_a_case() -> None:
    unclassified = [
        f"{method.name}: {f.path} ({f.declared})"
        for method in SERVICE.methods
        for f in fields(method)
        if classify(f, FIELDS) is None
    ]
    assert unclassified == []
    named = {
        (method.name, path) for method in SERVICE.methods for path in references(method, FIELDS)
    }
    assert {(rpc, path) for rpc, path, _, _ in CASES} == named
    # What flyd reads a config's references from is the same as the table.
    assert {as_path(ref.field) for ref in scope.config_refs(standing_by("a", "b"))} == {
        "config.standbys[]"
    }


async def two_apps(stub: Stub) -> None:
    """The demo's primary d1 (started) and its standby d2; evil's machine e1 (started)."""
    for machine_id, app, cfg, skip in (
        ("d1", "demo", config(), False),
        ("d2", "demo", standing_by("d1"), True),
        ("e1", "evil", config(), False),
    ):
        request = w.CreateMachineRequest(
            machine_id=machine_id, app=app, config=cfg, skip_launch=skip
        )
        await stub.CreateMachine(request, timeout=T)


def state_of(flyd: Flyd) -> tuple[int, dict[str, bytes]]:
    """Everything a refusal must leave as it was: the log's position and every row."""
    rows = {mid: row.machine.SerializeToString() for mid, row in flyd.worker.rows.items()}
    return flyd.store.last_seq(), rows


@pytest.mark.parametrize(
    ("rpc", "path", "request_", "field"), CASES, ids=[f"{c[0]}-{c[3]}" for c in CASES]
)
async def test_a_foreign_apps_object_named_is_refused_and_nothing_changes(
    servicer_stub: Stub,
    flyd: Flyd,
    rpc: str,
    path: str,
    request_: Callable[[], Any],
    field: str,
) -> None:
    await two_apps(servicer_stub)
    before = state_of(flyd)
    err = await refused(answer(servicer_stub, rpc, request_()), INVALID, field)
    assert "of app" in (err.details() or "")
    assert state_of(flyd) == before
    assert flyd.worker.get("d1").machine.slot == pb.SlotState(id="d1", generation=0, primary="d1")


async def test_a_create_of_another_apps_machine_id_is_refused(
    servicer_stub: Stub, flyd: Flyd
) -> None:
    """The subject itself: a create naming an existing machine of another app."""
    await two_apps(servicer_stub)
    before = state_of(flyd)
    request = w.CreateMachineRequest(machine_id="d1", app="evil", config=config())
    await refused(servicer_stub.CreateMachine(request, timeout=T), grpc.StatusCode.ALREADY_EXISTS)
    assert state_of(flyd) == before


async def test_an_idempotency_key_is_the_apps_own(servicer_stub: Stub, flyd: Flyd) -> None:
    """Another app's create under the demo's key makes evil's own machine, not the demo's."""
    keyed = w.CreateMachineRequest(
        machine_id="d1", app="demo", config=config(), idempotency_key="k"
    )
    await servicer_stub.CreateMachine(keyed, timeout=T)
    other = w.CreateMachineRequest(
        machine_id="e1", app="evil", config=config(), idempotency_key="k"
    )
    made = (await servicer_stub.CreateMachine(other, timeout=T)).machine
    assert (made.id, made.app) == ("e1", "evil")
    assert flyd.worker.get("d1").machine.app == "demo"


async def test_a_supersede_names_only_a_member_of_the_machines_own_slot(
    servicer_stub: Stub, flyd: Flyd
) -> None:
    """Of the same app, but of another slot (its row is here): refused too. A member of the
    slot outranks it, as before."""
    await two_apps(servicer_stub)
    await servicer_stub.CreateMachine(
        w.CreateMachineRequest(machine_id="d3", app="demo", config=config()), timeout=T
    )
    before = state_of(flyd)
    other_slot = w.SupersedeMachineRequest(
        machine_id="d1", generation=HIGH, primary="d3", primary_app="demo"
    )
    err = await refused(servicer_stub.SupersedeMachine(other_slot, timeout=T), INVALID, "primary")
    assert "slot d3, not in d1" in (err.details() or "")
    assert state_of(flyd) == before
    member = w.SupersedeMachineRequest(
        machine_id="d1", generation=1, primary="d2", primary_app="demo"
    )
    told = (await servicer_stub.SupersedeMachine(member, timeout=T)).machine
    assert (told.slot.generation, told.slot.primary) == (1, "d2")
    await flyd.worker.wait("d1", STOPPED, 5.0)


async def test_a_machine_standing_by_for_an_id_held_elsewhere_stays_in_its_apps_slot(
    servicer_stub: Stub, flyd: Flyd
) -> None:
    """This worker cannot tell whose machine `w2-d` is: it makes evil's standby of it, and its
    promotion far above is a claim in (evil, w2-d), never in the demo's slot of that id."""
    demo_primary = pb.Machine(
        id="w2-d", app="demo", worker_id="w2", state=STARTED,
        slot=pb.SlotState(id="w2-d", generation=0, primary="w2-d"),
    )  # fmt: skip
    request = w.CreateMachineRequest(
        machine_id="e2", app="evil", config=standing_by("w2-d"), skip_launch=True
    )
    made = (await servicer_stub.CreateMachine(request, timeout=T)).machine
    assert made.state == CREATED
    promote = w.StartMachineRequest(machine_id="e2", generation=HIGH)
    evil = (await servicer_stub.StartMachine(promote, timeout=T)).machine
    assert (evil.slot.id, evil.slot.primary, evil.slot.generation) == ("w2-d", "e2", HIGH)
    assert slots.key(evil) == ("evil", "w2-d") != slots.key(demo_primary)
    # A promotion of the demo's primary is counted among the demo's members only: evil's
    # claim, however high, moves none of the demo's generations.
    assert slots.promotion_generation(demo_primary, [demo_primary, evil]) == 1
