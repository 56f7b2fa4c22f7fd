"""Started means serving: real machines that do not serve say why, in `machines list`, in
WaitMachine on flyd and flaps, and in the SDK; `--wait` fails with the reason.

Two real flyd (their readiness grace cut to 2 s) and a flaps; the machines are real processes.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from google.protobuf.duration_pb2 import Duration

from flaps.v1 import machines_pb2
from flyd.v1 import machine_pb2 as pb
from flyd.v1 import worker_pb2
from nonomad.client import DeadlineExceeded, GuestConfig, MachineConfig
from tests.cli.conftest import CliFleet, Result
from tests.flaps.conftest import Fleet, eventually

GRACE = "2"
# Binds a port of its own choosing and ignores $PORT (what `python3 -m http.server` does).
IGNORES_PORT = (
    "import socket, time; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); "
    "time.sleep(1000)"
)
CRASHES = "echo starting; echo \"KeyError: 'PORT'\" >&2; exit 1"


@pytest.fixture
async def ready_fleet(fleet: Fleet) -> CliFleet:
    assert fleet.security is not None
    for worker in ("ams-1", "ams-2"):
        fleet.add_worker(worker, "ams", "--capacity.memory-mib", "512", "--ready-grace", GRACE)
    fleet.add_flaps()
    await fleet.until_alive()
    return CliFleet(fleet, fleet.security)


def failed_with(result: Result, *fragments: str) -> None:
    assert result.code != 0, result.out
    for fragment in fragments:
        assert fragment in result.err, result.err


async def test_machines_that_do_not_serve_say_why(ready_fleet: CliFleet) -> None:
    cli = ready_fleet
    run = ("machines", "run", "web", "--image", "demo:v1", "--region", "ams", "--memory", "64")
    healthy, ignorer, lonely, crasher = await asyncio.gather(
        cli(*run, "--port", "8080", "--wait", "--json"),
        cli(
            *run, "--port", "8080", "--wait", "--timeout", "4", "--", "python3", "-c", IGNORES_PORT
        ),
        cli(*run, "--wait", "--json", "--", "sleep", "1000"),
        cli(*run, "--wait", "--timeout", "4", "--", "sh", "-c", CRASHES),
    )
    # The demo serves $PORT: ready. A machine without services is ready once it keeps running.
    assert healthy.json()["ready"]["ready"] is True
    assert lonely.json()["ready"] == {
        "ready": True,
        "reason": "no services: nothing to probe; it keeps running",
        "since": lonely.json()["ready"]["since"],
    }
    # --wait fails, saying why.
    failed_with(ignorer, "DEADLINE_EXCEEDED", "not ready after", "nothing listening on 8080")
    failed_with(crasher, "not ready after", "crash-looping: exit 1", "last log: KeyError: 'PORT'")

    async with cli.client() as flaps:
        machines = {m.config.entrypoint[0] if m.config.entrypoint else "demo": m.id
                    for m in await flaps.list_machines("web")}  # fmt: skip
        ignorer_id, crasher_id = machines["python3"], machines["sh"]

        # The row says it once the grace ran out: every reader of the registry sees it.
        async def said() -> bool:
            rows = {m.id: m for m in await flaps.list_machines("web")}
            return rows[ignorer_id].ready.reason == f"nothing listening on 8080 after {GRACE}s"

        await eventually(said, 20, "the reason in flaps' ListMachines")
        # The SDK's wait says it.
        with pytest.raises(DeadlineExceeded, match="nothing listening on 8080 after 2s"):
            await flaps.wait_machine(ignorer_id, "started", wait=0.5, ready=True)
        with pytest.raises(ValueError, match="ready"):
            await flaps.wait_machine(ignorer_id, "stopped", ready=True)
        # flyd's own WaitMachine says it, and refuses ready for another state.
        row = await flaps.get_machine(crasher_id)
        worker = cli.fleet.worker(row.worker_id)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await worker.WaitMachine(
                worker_pb2.WaitMachineRequest(
                    machine_id=crasher_id, state=pb.MACHINE_STATE_STARTED,
                    timeout=Duration(nanos=200_000_000), ready=True,
                ),
                timeout=10,
            )  # fmt: skip
        assert caught.value.code() in (
            grpc.StatusCode.DEADLINE_EXCEEDED,
            grpc.StatusCode.FAILED_PRECONDITION,  # its restart policy gave up meanwhile
        )
        assert "crash-looping: exit 1" in (caught.value.details() or "")
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await worker.WaitMachine(
                worker_pb2.WaitMachineRequest(
                    machine_id=crasher_id, state=pb.MACHINE_STATE_STOPPED, ready=True
                ),
                timeout=10,
            )
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "ready" in (caught.value.details() or "")
        # flaps passes the field through, the refusal too.
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await cli.fleet.machines().WaitMachine(
                machines_pb2.WaitMachineRequest(
                    machine_id=crasher_id, state=pb.MACHINE_STATE_STOPPED, ready=True
                ),
                timeout=10,
            )
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "ready" in (caught.value.details() or "")

    listed = await cli("machines", "list", "web")
    assert listed.code == 0, listed.err
    lines = {line.split()[0]: line for line in listed.out.splitlines()[1:]}
    assert f"started, not ready: nothing listening on 8080 after {GRACE}s" in lines[ignorer_id]
    assert "crash-looping: exit 1" in lines[crasher_id]
    assert "started (no services" in lines[lonely.json()["id"]]
    assert " started " in lines[healthy.json()["id"]]
    waited = await cli("machines", "wait", ignorer_id, "started", "--timeout", "1")
    failed_with(waited, f"nothing listening on 8080 after {GRACE}s")


async def test_a_failing_check_says_what_it_answered(ready_fleet: CliFleet) -> None:
    config = MachineConfig(image="demo:v1", guest=GuestConfig(cpu_millicores=100, memory_mib=64))
    config.services.add(internal_port=8080)
    # The demo answers GET only: a POST gets 501.
    config.checks.add(name="web", http=pb.HttpCheck(path="/", method="POST"))
    async with ready_fleet.client() as flaps:
        machine = await flaps.create_machine("checked", config, region="ams")
        with pytest.raises(DeadlineExceeded, match="check web: POST / answered 501"):
            await flaps.wait_machine(machine.id, "started", wait=3, ready=True)
    listed = await ready_fleet("machines", "list", "checked")
    assert "not ready: check web: POST / answered 501" in listed.out, listed.out
