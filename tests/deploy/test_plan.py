"""The deploy plan (pure: machines in, actions out), the gate on flyd's readiness, the bad-spec
exit."""

from __future__ import annotations

from pathlib import Path
from typing import cast

import grpc
import pytest

from flyd.v1 import machine_pb2 as pb
from nonomad.client import ApiError, Client, DeadlineExceeded, FailedPrecondition, Machine
from nonomad.deploy import (
    SlotPlan,
    _Deployer,
    _Failed,
    _named,
    _NotReady,
    _why,
    check_budgets,
    make_plan,
)
from nonomad.spec import AppSpec
from tests.deploy.support import make_spec, run_cli, spec_data, write_spec

S = pb.MachineState


def machine(
    spec: AppSpec,
    slot: str,
    region: str = "ams",
    *,
    machine_id: str = "",
    standby_for: str = "",
    state: int = S.MACHINE_STATE_STARTED,
    created: int = 1,
) -> Machine:
    m = Machine(
        id=machine_id or f"{region}-1-{slot}",
        name=slot,
        app=spec.app,
        region=region,
        worker_id=f"{region}-1",
        state=state,  # type: ignore[arg-type]
        config=spec.machine_config(region, slot, standby_for=standby_for),
    )
    m.created_at.FromSeconds(created)
    return m


def actions(spec: AppSpec, machines: list[Machine]) -> dict[str, tuple[str, str]]:
    return {p.slot: (p.action, p.machine_id) for p in make_plan(spec, machines).slots}


def test_an_empty_app_creates_every_slot_and_standby() -> None:
    spec = make_spec(regions={"ams": 2, "syd": 1})
    assert actions(spec, []) == {
        "web-ams-1": ("create", ""),
        "web-ams-1-standby": ("create", ""),
        "web-ams-2": ("create", ""),
        "web-ams-2-standby": ("create", ""),
        "web-syd-1": ("create", ""),
        "web-syd-1-standby": ("create", ""),
    }


def test_matching_machines_are_unchanged_and_another_digest_is_an_update() -> None:
    spec = make_spec(regions={"ams": 1})
    old = make_spec(regions={"ams": 1}, env={"V": "1"})
    primary = machine(old, "web-ams-1", machine_id="p")
    standby = machine(old, "web-ams-1-standby", machine_id="s", standby_for="p")
    assert actions(old, [primary, standby]) == {
        "web-ams-1": ("unchanged", "p"),
        "web-ams-1-standby": ("unchanged", "s"),
    }
    assert actions(spec, [primary, standby]) == {
        "web-ams-1": ("update", "p"),
        "web-ams-1-standby": ("update", "s"),
    }
    failed = machine(spec, "web-ams-1", machine_id="p", state=S.MACHINE_STATE_FAILED)
    assert actions(spec, [failed])["web-ams-1"] == ("update", "p")


def test_a_standby_of_another_primary_is_replaced() -> None:
    spec = make_spec(regions={"ams": 1})
    primary = machine(spec, "web-ams-1", machine_id="p2")
    standby = machine(spec, "web-ams-1-standby", machine_id="s", standby_for="p1")
    assert actions(spec, [primary, standby])["web-ams-1-standby"] == ("replace", "s")
    # No primary at all: it will be new, so its standby must be remade after it.
    assert actions(spec, [standby]) == {
        "web-ams-1": ("create", ""),
        "web-ams-1-standby": ("replace", "s"),
    }


def test_machines_beyond_the_spec_are_destroyed_and_others_left_alone() -> None:
    spec = make_spec(regions={"ams": 1}, standbys=0)
    wide = make_spec(regions={"ams": 2, "syd": 1})
    machines = [
        machine(wide, "web-ams-1", machine_id="a1"),
        machine(wide, "web-ams-1-standby", machine_id="a1s", standby_for="a1"),
        machine(wide, "web-ams-2", machine_id="a2"),
        machine(wide, "web-syd-1", "syd", machine_id="s1"),
        machine(wide, "web-ams-3", machine_id="gone", state=S.MACHINE_STATE_DESTROYED),
        Machine(id="hand-made", name="hand-made", app="web", region="ams"),  # not deployed
    ]
    plan = make_plan(spec, machines)
    reasons = {p.machine_id: (p.action, p.reason) for p in plan.slots}
    assert reasons == {
        "a1": ("unchanged", ""),  # counts and standbys are not part of a machine's config
        "a1s": ("destroy", "the spec asks for no standbys"),
        "a2": ("destroy", "the spec asks for 1 in ams"),
        "s1": ("destroy", "region syd is not in the spec"),
    }
    assert plan.counts() == {"unchanged": 1, "destroy": 3}


def test_of_two_machines_in_one_slot_the_current_one_stays() -> None:
    spec = make_spec(regions={"ams": 1}, standbys=0)
    old = make_spec(regions={"ams": 1}, standbys=0, env={"V": "1"})
    older = machine(old, "web-ams-1", machine_id="older", created=1)
    current = machine(spec, "web-ams-1", machine_id="current", created=2)
    plan = make_plan(spec, [older, current])
    assert [(p.slot, p.action, p.machine_id, p.reason) for p in plan.slots] == [
        ("web-ams-1", "unchanged", "current", ""),
        ("web-ams-1", "destroy", "older", "duplicate of current"),
    ]


# -- flyd's word on readiness -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("message", "reason", "check"),
    [
        (
            "machine m1 is started, not ready after 2.5s: check admin: nothing listening on "
            "port 9090",
            "check admin: nothing listening on port 9090",
            "admin",
        ),
        (
            "machine m1 is started, not ready after 32s: check web-2: answered 500 after 10s",
            "check web-2: answered 500 after 10s",
            "web-2",  # not "web", whose name it starts with
        ),
        (
            "machine m1 is restarting, not ready after 3s: crash-looping: exit 1, 1 restart; "
            "last log: Fatal Python error: init_fs_encoding",
            "crash-looping: exit 1, 1 restart; last log: Fatal Python error: init_fs_encoding",
            "",
        ),
        (
            "machine m1 failed; it will not be ready: failed: gave up after 1 retry",
            "failed: gave up after 1 retry",
            "",
        ),
        ("WaitMachine: DEADLINE_EXCEEDED: Deadline Exceeded", "", ""),
    ],
)
def test_flyds_reason_and_the_check_it_names(message: str, reason: str, check: str) -> None:
    assert _why(message) == (reason or message)
    assert _named(_why(message), ["web", "web-2", "admin"]) == check


class _Waits:
    """A client whose WaitMachine(ready) answers as flyd would: ready, or an error."""

    def __init__(self, error: Exception | None) -> None:
        self.error = error
        self.asked: list[dict[str, object]] = []

    async def wait_machine(self, machine_id: str, state: str, **kw: object) -> Machine:
        self.asked.append({"state": state, **kw})
        if self.error is not None:
            raise self.error
        return Machine(id=machine_id, ready=pb.MachineCondition(ready=True))


def _error(kind: type[ApiError], message: str, reason: str = "") -> ApiError:
    err = kind(grpc.StatusCode.UNKNOWN, message, "WaitMachine")
    err.reason = reason
    return err


async def test_the_gate_is_flyds_readiness_of_this_instance() -> None:
    spec = make_spec()
    started = Machine(id="m1", instance_id="i2", state=S.MACHINE_STATE_STARTED)
    slot = SlotPlan("web-ams-1", "ams", 1, "primary", "update", machine=started)

    ready = _Waits(None)
    deployer = _Deployer(cast(Client, ready), spec, None, wait_timeout=30)
    machine, bad = await deployer.wait_ready(slot, started, deployer.budgets)
    assert (machine.ready.ready, bad) == (True, None)
    # The spec's one check: its grace period (30 s) and timeout (2 s) bound the wait.
    assert deployer.budgets == {"root": 32.0}
    assert ready.asked == [
        {"state": "started", "wait": pytest.approx(32.0), "instance_id": "i2", "ready": True}
    ]

    # A failed machine: at once, with flyd's reason and no check.
    failed = _Waits(_error(FailedPrecondition, "machine m1 failed; it will not be ready: boom"))
    deployer = _Deployer(cast(Client, failed), spec, None, wait_timeout=30)
    _, bad = await deployer.wait_ready(slot, started, deployer.budgets)
    assert bad == _NotReady("", "boom")

    # A check whose budget is spent: flyd's reason, naming it.
    late = _Waits(
        _error(DeadlineExceeded, "machine m1 is started, not ready after 1s: check root: x")
    )
    deployer = _Deployer(cast(Client, late), spec, None, wait_timeout=30)
    _, bad = await deployer.wait_ready(slot, started, {"root": 0.0})
    assert bad == _NotReady("root", "check root: x")

    # Replaced by someone else meanwhile: the deploy fails on that, not on readiness.
    replaced = _Waits(_error(FailedPrecondition, "now instance i3", "INSTANCE_REPLACED"))
    deployer = _Deployer(cast(Client, replaced), spec, None, wait_timeout=30)
    with pytest.raises(_Failed, match="now instance i3"):
        await deployer.wait_ready(slot, started, deployer.budgets)


def test_a_previous_configs_checks_get_the_rollback_grace_and_their_timeout() -> None:
    config = make_spec(
        checks=[{"type": "http", "timeout": "3s"}, {"name": "tcp", "type": "tcp"}]
    ).machine_config("ams", "web-ams-1")
    config.checks[0].name = ""  # written by another client: flyd calls it check-0
    assert check_budgets(config, 10.0) == {"check-0": 13.0, "tcp": 12.0}


async def test_a_bad_spec_exits_2_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_spec(tmp_path, spec_data(services=[{"internal_port": 70000}]))
    async with Client("127.0.0.1:1") as unused:  # never called: the spec fails first
        code, out, err = await run_cli(unused, path, capsys)
    assert code == 2
    assert out == ""
    assert err == (
        f"nonomad deploy: {path}: services[0].internal_port: Input should be less than 65536\n"
    )


# -- retrying an update while the worker says the machine is busy ------------------------------


class _Updates:
    """A client whose UpdateMachine first fails with the given FAILED_PRECONDITION reasons."""

    def __init__(self, *reasons: str) -> None:
        self.reasons = list(reasons)
        self.calls = 0

    async def update_machine(self, machine_id: str, config: object, **kw: object) -> Machine:
        self.calls += 1
        if self.reasons:
            err = FailedPrecondition(
                grpc.StatusCode.FAILED_PRECONDITION, "refused", "UpdateMachine"
            )
            err.reason = self.reasons.pop(0)
            raise err
        return Machine(id=machine_id)


async def test_an_update_is_retried_while_the_machine_is_busy_and_only_then() -> None:
    spec = make_spec()
    config = spec.machine_config("ams", "web-1")
    busy = _Updates("MACHINE_BUSY", "MACHINE_BUSY")
    deployer = _Deployer(cast(Client, busy), spec, None, wait_timeout=30)
    updated = await deployer.update("m1", config, launch=True, nonce="")
    assert (updated.id, busy.calls) == ("m1", 3)

    for reason in ("MACHINE_DESTROYED", "LEASE_HELD", ""):
        final = _Updates(reason)
        deployer = _Deployer(cast(Client, final), spec, None, wait_timeout=30)
        with pytest.raises(FailedPrecondition):
            await deployer.update("m1", config, launch=True, nonce="")
        assert final.calls == 1, reason
