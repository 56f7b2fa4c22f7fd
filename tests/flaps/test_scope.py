"""flaps' side of "every object a call names is checked against its scope" (issue 27, item 1).

flaps in-process as test_auth runs it (guarded, over TLS, with a cluster port), in front of
its fake fleet: app `a` has machine A, app `b` machine B. The table is over the whole
contract of MachinesService and PlatformService: every string field of every request
(tests.scope), each one classified, each that names another object than the call's subject
given a case that names B's there in a call about `a`, and each refused, whoever calls:

| caller | refused with |
| --- | --- |
| a token of app a | PERMISSION_DENIED: it may not touch B (caveat `apps = a`) |
| a token of apps a and b, an admin token | INVALID_ARGUMENT naming the field: B is of another app |
| the proxy's certificate (the calls its part makes) | INVALID_ARGUMENT naming the field |
| a flaps that checks no tokens | INVALID_ARGUMENT naming the field |

and nothing changed on any worker: no commit, every row as it was. `flaps.auth.RULES` are
read from the same descriptors: a rule that names an object the table does not (or the other
way round) fails, so a new request field that names an object cannot arrive without one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
import pytest

from flaps import auth, placement
from flaps.service import Exchange, MachinesServicer, PlatformServicer, Workers
from flaps.v1 import machines_pb2 as m
from flaps.v1 import machines_pb2_grpc, platform_pb2, platform_pb2_grpc
from flyd.v1 import machine_pb2 as pb
from runtime.errors import InvalidArgument
from tests.flaps.auth_support import CALLS, DENIED, STUBS, Flaps, flaps
from tests.flaps.support import FakeFleet
from tests.flyd.support import config
from tests.harness import channel, error_info
from tests.scope import (
    ELSEWHERE,
    NOTHING,
    REFERENCE,
    SUBJECT,
    as_path,
    classify,
    fields,
    filled,
    references,
)
from tests.servicers import T, answer

__all__ = ["flaps"]

SERVICES = [
    m.DESCRIPTOR.services_by_name["MachinesService"],
    platform_pb2.DESCRIPTOR.services_by_name["PlatformService"],
]
METHODS = {method.name: method for service in SERVICES for method in service.methods}
SERVICE_OF = {
    method.name: "machines" if service.name == "MachinesService" else "platform"
    for service in SERVICES
    for method in service.methods
}
MESSAGES = {"machines": m, "platform": platform_pb2}
INVALID = grpc.StatusCode.INVALID_ARGUMENT
HIGH = 1_000_000
_REGION = "a region: the fleet's, every app places there"

FIELDS: dict[str, tuple[str, str]] = {
    "flaps.v1.CreateMachineRequest.app": (SUBJECT, "the app the machine is made in"),
    "flaps.v1.CreateMachineRequest.region": (NOTHING, _REGION),
    "flaps.v1.CreateMachineRequest.regions": (NOTHING, _REGION),
    "flaps.v1.CreateMachineRequest.idempotency_key": (NOTHING, "a key held per (app, key)"),
    "flaps.v1.CreateMachineRequest.standby_for": (REFERENCE, "the machines it stands by for"),
    "flaps.v1.CreateMachineRequest.secrets_from": (REFERENCE, "the machine whose secrets it gets"),
    "flaps.v1.ListMachinesRequest.app": (SUBJECT, "the app listed"),
    "flaps.v1.ListMachinesRequest.region": (NOTHING, _REGION),
    "flaps.v1.SupersedeMachineRequest.primary": (REFERENCE, "the member serving the slot"),
    "flaps.v1.ListWorkersRequest.region": (NOTHING, _REGION),
    "flaps.v1.SimulatePlacementRequest.app": (SUBJECT, "the app it would be made in"),
    "flaps.v1.SimulatePlacementRequest.region": (NOTHING, _REGION),
    "flaps.v1.SimulatePlacementRequest.regions": (NOTHING, _REGION),
    "flaps.v1.SimulatePlacementRequest.standby_for": (REFERENCE, "what it would stand by for"),
    "flaps.v1.CordonWorkerRequest.worker_id": (ELSEWHERE, "a worker: a fleet operation's"),
}  # fmt: skip
"""MachinesService's and PlatformService's request fields beyond tests.scope's shared ones."""


def standing_by(*targets: str) -> pb.MachineConfig:
    made = config()
    made.standbys.extend(targets)
    return made


# (rpc, the field, the request about app a (machine `a`) naming app b's machine `b` there,
# the field the error names)
Case = tuple[str, str, Callable[[str, str], Any], str]
CASES: list[Case] = [
    ("CreateMachine", "standby_for[]", lambda a, b: m.CreateMachineRequest(
        app="a", region="ams", config=config(), standby_for=[b]), "standby_for[0]"),
    ("CreateMachine", "config.standbys[]", lambda a, b: m.CreateMachineRequest(
        app="a", region="ams", config=standing_by(b)), "config.standbys[0]"),
    ("CreateMachine", "secrets_from", lambda a, b: m.CreateMachineRequest(
        app="a", region="ams", config=config(), secrets_from=b), "secrets_from"),
    ("UpdateMachine", "config.standbys[]", lambda a, b: m.UpdateMachineRequest(
        machine_id=a, config=standing_by(a, b)), "config.standbys[1]"),
    ("SupersedeMachine", "primary", lambda a, b: m.SupersedeMachineRequest(
        machine_id=a, generation=HIGH, primary=b), "primary"),
    ("SimulatePlacement", "standby_for[]", lambda a, b: platform_pb2.SimulatePlacementRequest(
        app="a", region="ams", config=config(), standby_for=[b]), "standby_for[0]"),
    ("SimulatePlacement", "config.standbys[]", lambda a, b: platform_pb2.SimulatePlacementRequest(
        app="a", region="ams", config=standing_by(b)), "config.standbys[0]"),
]  # fmt: skip
PROXY_MAY = {"StartMachine", "StopMachine", "RestartMachine", "SupersedeMachine"}
"""What the proxy's certificate may call on flaps' cluster port (tests/flaps/test_auth.py)."""


def test_every_field_of_every_request_is_classified() -> None:
    unclassified = [
        f"{name}: {f.path} ({f.declared})"
        for name, method in METHODS.items()
        for f in fields(method)
        if classify(f, FIELDS) is None
    ]
    assert unclassified == []


@pytest.mark.parametrize("rpc", sorted(METHODS))
def test_each_rpcs_rule_names_exactly_the_objects_the_table_does(rpc: str) -> None:
    """Read from a request whose every field is set: the objects RULES check (each need with
    a `ref`) are the table's references, and each reference has a case."""
    method = METHODS[rpc]
    request = filled(getattr(MESSAGES[SERVICE_OF[rpc]], method.input_type.name)())
    rule = auth.RULES[f"/{method.containing_service.full_name}/{rpc}"]
    checked = {as_path(need.ref.field) for need in rule(request) if need.ref is not None}
    assert checked == references(method, FIELDS)
    assert {path for name, path, _, _ in CASES if name == rpc} == checked


def state_of(fleet: FakeFleet) -> dict[str, tuple[int, dict[str, bytes]]]:
    """Everything a refusal must leave as it was: each worker's log position and rows."""
    return {
        worker_id: (
            flyd.store.last_seq(),
            {mid: row.machine.SerializeToString() for mid, row in flyd.worker.rows.items()},
        )
        for worker_id, flyd in fleet.workers.items()
    }


async def call(f: Flaps, rpc: str, request: Any, token: str | None, peer: str | None) -> None:
    """`rpc` with `token` on flaps' public port, or as the cluster part `peer` on its other."""
    service = SERVICE_OF[rpc]
    if peer is None:
        stub = f.stub(STUBS[service], token)
    else:
        stub = STUBS[service](channel(f.cluster_address, f.security.member_tls(peer)))
    await getattr(stub, rpc)(request, timeout=T)


CALLERS: list[tuple[str, Callable[[Flaps], str | None], str | None]] = [
    ("token of app a", lambda f: f.mint("apps = a"), None),
    ("token of apps a and b", lambda f: f.mint("apps = a,b"), None),
    ("admin token", lambda f: f.mint(), None),
    ("proxy certificate", lambda f: None, "proxy"),
]


# Every case for every caller; the proxy's certificate for the calls its part makes (its role
# refuses the others before anything is looked at).
TABLE = [
    (caller, case)
    for caller in CALLERS
    for case in CASES
    if caller[2] != "proxy" or case[0] in PROXY_MAY
]


@pytest.mark.parametrize(
    ("caller_", "case"), TABLE, ids=[f"{c[0]}-{case[0]}-{case[3]}" for c, case in TABLE]
)
async def test_an_object_of_another_app_named_is_refused_and_nothing_changes(
    flaps: Flaps, caller_: tuple[str, Callable[[Flaps], str | None], str | None], case: Case
) -> None:
    caller, token, peer = caller_
    rpc, _, request_, field = case
    before = state_of(flaps.fleet)
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await call(flaps, rpc, request_(flaps.a, flaps.b), token(flaps), peer)
    err = raised.value
    if caller == "token of app a":
        assert err.code() == DENIED, err.details()
        info = error_info(err)
        assert info is not None
        assert (info[0], info[2]["caveat"]) == ("TOKEN_CAVEAT", "apps = a")
    else:
        assert err.code() == INVALID, err.details()
        assert (err.details() or "").startswith(f"{field}: machine {flaps.b} is of app 'b'")
    assert state_of(flaps.fleet) == before


@pytest.mark.parametrize(
    ("rpc", "path", "request_", "field"), CASES, ids=[f"{c[0]}-{c[3]}" for c in CASES]
)
async def test_a_flaps_that_checks_no_tokens_holds_the_rule_too(
    flaps: Flaps, rpc: str, path: str, request_: Callable[[str, str], Any], field: str
) -> None:
    """The servicers as flaps.main builds them without token keys (no guard): the scope is
    checked before the handler all the same."""
    workers = Workers(flaps.fleet.replica)
    try:
        exchange = Exchange(flaps.fleet.replica, workers, placement.Pipeline())
        machines = SERVICE_OF[rpc] == "machines"
        servicer = MachinesServicer(exchange) if machines else PlatformServicer(exchange)
        before = state_of(flaps.fleet)
        with pytest.raises(InvalidArgument) as raised:
            await getattr(servicer, rpc)(request_(flaps.a, flaps.b), None)
        assert raised.value.field == field
        assert state_of(flaps.fleet) == before
    finally:
        await workers.close()


SUBJECT_CALLS = [
    c
    for c in CALLS
    if any((classify(f, FIELDS) or ("",))[0] == SUBJECT for f in fields(METHODS[c[1]]))
]


@pytest.mark.parametrize("call_", SUBJECT_CALLS, ids=[c[1] for c in SUBJECT_CALLS])
async def test_the_subject_of_another_app_is_refused_and_nothing_changes(
    flaps: Flaps, call_: Any
) -> None:
    """The object the call is about, for every RPC that names one: app a's token on app b's
    machine (or app b) is refused before anything happens (test_auth: which caveat, for every
    kind of token)."""
    service, rpc, make = call_
    before = state_of(flaps.fleet)
    stub = flaps.stub(STUBS[service], flaps.mint("apps = a"))
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await answer(stub, rpc, make(flaps.b, "b"))
    assert raised.value.code() == DENIED, (rpc, raised.value.details())
    assert state_of(flaps.fleet) == before


async def test_a_standby_of_the_apps_own_machine_is_made(flaps: Flaps) -> None:
    """What the rule allows: a's standby of A, named in standby_for and in its config."""
    machines = flaps.stub(machines_pb2_grpc.MachinesServiceStub, flaps.mint("apps = a"))
    made = await machines.CreateMachine(
        m.CreateMachineRequest(
            app="a", region="ams", config=standing_by(flaps.a), standby_for=[flaps.a]
        ),
        timeout=T,
    )
    assert list(made.machine.config.standbys) == [flaps.a]
    assert made.machine.slot.id == flaps.a
    platform = flaps.stub(platform_pb2_grpc.PlatformServiceStub, flaps.mint("apps = a"))
    bid = platform_pb2.SimulatePlacementRequest(
        app="a", region="ams", config=config(), standby_for=[flaps.a]
    )
    simulated = await platform.SimulatePlacement(bid, timeout=T)
    assert simulated.candidates


async def test_an_idempotency_key_names_a_machine_of_the_callers_app_only(flaps: Flaps) -> None:
    """A key is held per (app, key): app b's create under app a's key makes b's own machine,
    it never returns a's."""
    admin = flaps.stub(machines_pb2_grpc.MachinesServiceStub, flaps.mint())
    keyed = m.CreateMachineRequest(app="a", region="ams", config=config(), idempotency_key="k")
    mine = (await admin.CreateMachine(keyed, timeout=T)).machine
    await flaps.fleet.seen(mine.id)
    keyed.app = "b"
    other = (await admin.CreateMachine(keyed, timeout=T)).machine
    assert (other.app, other.id != mine.id) == ("b", True)
