"""nonomad.client against real flaps and flyd processes."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from nonomad.client import (
    ApiError,
    Client,
    FailedPrecondition,
    GuestConfig,
    InvalidArgument,
    MachineConfig,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
    parse_state,
    state_name,
)
from tests.flaps.conftest import Fleet, eventually


def config(memory_mib: int = 64, *command: str) -> MachineConfig:
    return MachineConfig(
        image="demo:v1",
        guest=GuestConfig(cpu_millicores=100, memory_mib=memory_mib),
        entrypoint=list(command or ("sleep", "1000")),
    )


async def two_workers(fleet: Fleet, *flaps_args: str) -> Client:
    fleet.add_worker("ams-1", "ams", "--capacity.memory-mib", "512")
    fleet.add_worker("ams-2", "ams", "--capacity.memory-mib", "512")
    fleet.add_flaps(*flaps_args)
    return fleet.client(timeout=20)


async def test_a_machine_lifecycle_through_the_sdk(fleet: Fleet) -> None:
    async with await two_workers(fleet) as flaps:
        await eventually(lambda: _fits(flaps), 30, "both workers alive")
        machine = await flaps.create_machine(
            "web",
            config(64, "sh", "-c", "echo line-1; echo line-2; exec sleep 1000"),
            region="ams",
            idempotency_key="sdk-1",
        )
        assert state_name(machine.state) == "started"
        again = await flaps.create_machine("web", config(), region="ams", idempotency_key="sdk-1")
        assert again.id == machine.id

        got = await flaps.get_machine(machine.id)
        assert got.instance_id == machine.instance_id

        async def listed() -> bool:
            return [x.id for x in await flaps.list_machines("web", state="started")] == [machine.id]

        await eventually(listed, 10, "the machine listed as started")

        async def logged() -> bool:
            lines = [line async for line in flaps.machine_logs(machine.id, tail_lines=10)]
            return lines == ["line-1", "line-2"]

        await eventually(logged, 10, "the machine's two log lines")

        await flaps.stop_machine(machine.id, kill_timeout=2)
        stopped = await flaps.wait_machine(machine.id, "stopped", wait=20)
        assert stopped.state == parse_state("STOPPED")
        await flaps.start_machine(machine.id)
        await flaps.wait_machine(machine.id, "started", wait=20)
        await flaps.restart_machine(machine.id)
        await flaps.wait_machine(machine.id, "started", wait=20)
        await flaps.signal_machine(machine.id, "SIGCONT")  # harmless to sleep
        events = await flaps.list_machine_events(machine.id)
        assert {"create", "stop", "start", "restart", "signal"} <= {e.type for e in events}

        with pytest.raises(FailedPrecondition) as running:
            await flaps.destroy_machine(machine.id)
        assert running.value.reason == "WRONG_STATE"
        await flaps.destroy_machine(machine.id, force=True)
        await flaps.wait_machine(machine.id, "destroyed", wait=20)


async def _fits(flaps: Client) -> bool:
    regions = await flaps.list_regions(guest=GuestConfig(cpu_millicores=100, memory_mib=64))
    return [(r.name, r.alive_workers) for r in regions] == [("ams", 2)]


async def test_leases_standbys_and_platform_calls(fleet: Fleet) -> None:
    async with await two_workers(fleet) as flaps:
        await eventually(lambda: _fits(flaps), 30, "both workers alive")
        workers = await flaps.list_workers(region="ams")
        assert sorted(w.info.id for w in workers) == ["ams-1", "ams-2"]
        plan = await flaps.simulate_placement("web", config(), region="ams")
        assert {c.worker_id for c in plan.candidates} == {"ams-1", "ams-2"}

        watching = asyncio.Event()
        decisions = flaps.watch_placements(subscribed=watching.set)
        first = asyncio.create_task(anext(decisions))
        await asyncio.wait_for(watching.wait(), 20)
        placed = await flaps.create_machine("why", config(), region="ams")
        seen = (await asyncio.wait_for(first, 20)).event
        await decisions.aclose()
        assert (seen.app, seen.outcome, seen.machine_id) == ("why", "placed", placed.id)
        why = await flaps.get_placement(placed.id)
        assert why is not None
        assert (why.worker_id, [r.region for r in why.regions]) == (placed.worker_id, ["ams"])
        await flaps.destroy_machine(placed.id, force=True)

        primary, lease = await flaps.create_machine_with_lease(
            "web", config(), 60, region="ams", skip_launch=True
        )
        assert lease.nonce
        with pytest.raises(FailedPrecondition) as info:
            await flaps.start_machine(primary.id)
        assert "lease" in info.value.message
        assert info.value.reason == "LEASE_HELD"
        await flaps.start_machine(primary.id, lease_nonce=lease.nonce)
        await flaps.release_lease(primary.id, lease.nonce)
        refreshed = await flaps.acquire_lease(primary.id, 30, owner="test")
        await flaps.release_lease(primary.id, refreshed.nonce)

        standby = await flaps.create_machine(
            "web", config(), region="ams", standby_for=[primary.id]
        )
        assert standby.worker_id != primary.worker_id
        assert state_name(standby.state) in ("created", "stopped")
        # The first of the app's machines only (one call, a page of one).
        assert len(await flaps.list_machines("web")) == 2
        (first,) = await flaps.list_machines("web", limit=1)
        assert first.id in (primary.id, standby.id)
        with pytest.raises(ValueError, match="limit must be 1 or more"):
            await flaps.list_machines("web", limit=0)


async def test_errors_are_typed_and_carry_the_status(fleet: Fleet) -> None:
    async with await two_workers(fleet) as flaps:
        await eventually(lambda: _fits(flaps), 30, "both workers alive")
        with pytest.raises(NotFound) as not_found:
            await flaps.get_machine("ams-1-000000000000")
        assert not_found.value.method == "GetMachine"

        with pytest.raises(InvalidArgument) as invalid:
            await flaps.create_machine("web", config(), region="nowhere")
        assert "region" in invalid.value.message

        with pytest.raises(ResourceExhausted) as full:
            await flaps.create_machine("web", config(memory_mib=4096), region="ams")
        assert full.value.rejections == {"insufficient_memory": 2}
        assert (full.value.reason, full.value.metadata) == (
            "NO_CAPACITY",
            {"insufficient_memory": "2"},
        )
        assert isinstance(full.value, ApiError)

        with pytest.raises(ValueError, match="wait must be in"):
            await flaps.wait_machine("ams-1-000000000000", "started", wait=120)
        with pytest.raises(ValueError, match="unknown machine state 'sleeping'"):
            await flaps.list_machines("web", state="sleeping")


async def test_tokens_and_tls(fleet: Fleet) -> None:
    async with await two_workers(fleet) as admin:
        await eventually(lambda: _fits(admin), 30, "both workers alive")
        assert fleet.security is not None
        address, tls = fleet.flaps[0].address, fleet.security.client_tls()
        web_reader = fleet.security.keyring().mint(["apps = web", "ops = read"])
        async with Client(address, tls=tls) as anonymous:
            with pytest.raises(Unauthenticated, match="missing `authorization: Bearer"):
                await anonymous.list_regions()
        async with Client(address, tls=tls, token="not-a-token") as wrong:
            with pytest.raises(Unauthenticated, match="not a nonomad token"):
                await wrong.list_workers()
        async with Client(address, tls=tls, token=web_reader) as reader:
            assert await reader.list_machines("web") == []
            with pytest.raises(PermissionDenied, match='"ops = read"') as denied:
                await reader.create_machine("web", config(), region="ams")
            assert denied.value.reason == "TOKEN_CAVEAT"
            assert denied.value.metadata["caveat"] == "ops = read"
            with pytest.raises(PermissionDenied, match='"apps = web" does not allow app api'):
                await reader.list_machines("api")
        # One channel for two callers: each call is checked against its own token, and
        # closing the second leaves the first's channel open.
        reader = admin.with_token(web_reader)
        assert await reader.list_machines("web") == []
        with pytest.raises(PermissionDenied, match='"apps = web" does not allow app api'):
            await reader.list_machines("api")
        await reader.close()
        assert await admin.list_machines("api") == []
        # TLS is not optional: plaintext to a TLS port does not connect.
        async with Client(address, token=web_reader, timeout=2) as plaintext:
            with pytest.raises(Unavailable):
                await plaintext.list_machines("web")


def test_states_parse_by_name_or_number() -> None:
    assert parse_state("started") == parse_state("MACHINE_STATE_STARTED") == 3
    assert parse_state(5) == parse_state("Stopped")
    assert state_name(parse_state("destroyed")) == "destroyed"
    with pytest.raises(ValueError, match="unknown machine state number 99"):
        parse_state(99)


async def test_client_arguments_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="timeout must be > 0"):
        Client("127.0.0.1:1", timeout=0)
    with pytest.raises(ValueError, match="token or token_file"):
        Client("127.0.0.1:1", token="a", token_file=tmp_path / "t")
    await asyncio.sleep(0)
