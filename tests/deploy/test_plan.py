"""The deploy plan (pure: machines in, actions out), the check probe, the bad-spec exit."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import cast

import grpc
import pytest

from flyd.v1 import machine_pb2 as pb
from nonomad.client import Client, FailedPrecondition, Machine
from nonomad.deploy import _Deployer, make_plan, probe
from nonomad.spec import AppSpec, Check
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


@pytest.fixture
async def http_server() -> AsyncIterator[int]:
    """Answers /ok with 200 and anything else with 404."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        line = await reader.readline()
        status = "200 OK" if line.split()[1] == b"/ok" else "404 Not Found"
        writer.write(f"HTTP/1.1 {status}\r\nContent-Length: 0\r\n\r\n".encode())
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    yield server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()


async def test_probe_says_what_it_saw(http_server: int) -> None:
    ok = Check(type="http", path="/ok")
    assert await probe(ok, "127.0.0.1", http_server) == (True, "HTTP 200 for GET /ok")
    missing = Check(type="http", path="/missing")
    assert await probe(missing, "127.0.0.1", http_server) == (
        False,
        "HTTP 404 for GET /missing",
    )
    assert await probe(Check(type="tcp"), "127.0.0.1", http_server) == (
        True,
        "accepted a connection",
    )
    # A port nothing listens on: the server's, once it is closed.
    closed = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = closed.sockets[0].getsockname()[1]
    closed.close()
    await closed.wait_closed()
    assert await probe(Check(type="tcp"), "127.0.0.1", port) == (
        False,
        f"connection refused on 127.0.0.1:{port}",
    )


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
