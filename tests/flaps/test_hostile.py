"""flaps against callers who give up (issue 19, defect 4), and ids accepted before names were
checked fully (defect 2): a DEADLINE_EXCEEDED answer means no machine, and what a worker
accepted can be destroyed through any flaps."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import grpc
import pytest

from flaps.v1 import machines_pb2 as m
from flyd import fsm
from model.errors import Unavailable
from tests.flaps.servicer_support import Machines, MachinesServer, bid, exchange, fleet
from tests.flaps.support import FakeFleet
from tests.flyd.support import DESTROYED, config
from tests.servicers import DEADLINE, T, seconds

__all__ = ["exchange", "fleet"]


async def holds(check: Callable[[], bool]) -> None:
    """Wait (bounded) for `check()`, for what no single event announces."""
    async with asyncio.timeout(DEADLINE):
        while not check():  # noqa: ASYNC110 - the fleet's workers are in this loop: poll them
            await asyncio.sleep(0.01)


def gone(fleet: FakeFleet) -> bool:
    """No machine of the fleet is anything but destroyed (or dropped)."""
    return all(
        row.state == DESTROYED
        for flyd in fleet.workers.values()
        for row in flyd.worker.rows.values()
    )


class TestDeadlines(MachinesServer):
    async def test_a_create_whose_caller_gave_up_leaves_no_machine(
        self, servicer_stub: Machines, fleet: FakeFleet, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The issue's repro: the caller's deadline passes while its worker spawns. flaps gave
        the worker only what the caller had left, so the worker committed nothing."""
        gate = asyncio.Event()
        for flyd in fleet.workers.values():
            real = flyd.driver.start

            async def slow(spec: Any, real: Any = real) -> Any:
                await gate.wait()
                return await real(spec)

            monkeypatch.setattr(flyd.driver, "start", slow)
        for _ in range(3):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await servicer_stub.CreateMachine(m.CreateMachineRequest(**bid()), timeout=0.3)
            assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        gate.set()
        await holds(lambda: not any(f.worker.reservations.pending for f in fleet.workers.values()))
        assert fleet.machine_ids() == set()

    async def test_a_machine_its_caller_never_hears_of_is_destroyed(
        self, servicer_stub: Machines, fleet: FakeFleet, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Placed, but the lease asked for fails: without an idempotency key nobody could find
        the machine again, so flaps destroys it."""
        for flyd in fleet.workers.values():

            async def no_lease(*args: Any, **kwargs: Any) -> Any:
                raise Unavailable("leases are down")

            monkeypatch.setattr(flyd.worker, "acquire_lease", no_lease)
        request = m.CreateMachineRequest(**bid(lease_ttl=seconds(60)))
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await servicer_stub.CreateMachine(request, timeout=T)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        [machine_id] = fleet.machine_ids()
        await holds(lambda: gone(fleet))
        assert fleet.owner_of(machine_id).worker.rows[machine_id].state == DESTROYED

    async def test_with_an_idempotency_key_the_machine_stays_for_the_retry(
        self, servicer_stub: Machines, fleet: FakeFleet, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        calls: list[int] = []
        for flyd in fleet.workers.values():
            real = flyd.worker.acquire_lease

            async def flaky(*args: Any, real: Any = real, **kwargs: Any) -> Any:
                calls.append(1)
                if len(calls) == 1:
                    raise Unavailable("leases are down")
                return await real(*args, **kwargs)

            monkeypatch.setattr(flyd.worker, "acquire_lease", flaky)
        request = m.CreateMachineRequest(**bid(lease_ttl=seconds(60), idempotency_key="k-1"))
        with pytest.raises(grpc.aio.AioRpcError):
            await servicer_stub.CreateMachine(request, timeout=T)
        [machine_id] = fleet.machine_ids()
        await fleet.seen(machine_id)
        again = await servicer_stub.CreateMachine(request, timeout=T)
        assert again.machine.id == machine_id
        assert again.machine.state != DESTROYED

    @pytest.mark.parametrize("key", ["", "k-1"], ids=["without a key", "with a key"])
    async def test_a_claim_whose_caller_leaves_after_the_commit_is_rolled_back(
        self,
        servicer_stub: Machines,
        fleet: FakeFleet,
        monkeypatch: pytest.MonkeyPatch,
        key: str,
    ) -> None:
        """The worker commits, but its answer is not back when flaps' caller goes: without an
        idempotency key flaps destroys the machine it was creating (the worker's own answer
        never comes, so only flaps can); with one, it stays for the retry."""
        committed = asyncio.Event()
        for flyd in fleet.workers.values():
            real = flyd.worker.create

            async def create(*args: Any, real: Any = real, **kwargs: Any) -> Any:
                machine = await real(*args, **kwargs)
                committed.set()
                await asyncio.Event().wait()  # the answer is held until the call is cancelled
                return machine

            monkeypatch.setattr(flyd.worker, "create", create)
        request = m.CreateMachineRequest(**bid(idempotency_key=key))
        call = servicer_stub.CreateMachine(request, timeout=T)
        async with asyncio.timeout(DEADLINE):
            await committed.wait()
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        [machine_id] = fleet.machine_ids()
        if key:
            await fleet.seen(machine_id)
            assert fleet.owner_of(machine_id).worker.rows[machine_id].state != DESTROYED
        else:
            await holds(lambda: gone(fleet))

    async def test_a_claim_past_its_callers_deadline_leaves_no_machine(
        self, servicer_stub: Machines, fleet: FakeFleet, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The same with a deadline: DEADLINE_EXCEEDED means no machine."""
        for flyd in fleet.workers.values():
            real = flyd.worker.create

            async def create(*args: Any, real: Any = real, **kwargs: Any) -> Any:
                kwargs["deadline"] = None  # the worker would commit however late
                machine = await real(*args, **kwargs)
                await asyncio.Event().wait()
                return machine

            monkeypatch.setattr(flyd.worker, "create", create)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await servicer_stub.CreateMachine(m.CreateMachineRequest(**bid()), timeout=0.5)
        assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await holds(lambda: bool(fleet.machine_ids()) and gone(fleet))


class TestNames(MachinesServer):
    async def test_a_row_accepted_before_the_fix_is_destroyed_through_flaps(
        self, servicer_stub: Machines, fleet: FakeFleet
    ) -> None:
        """Defect 2: `w1-fzmid\\n`, in worker w1's log from before ids were checked fully."""
        created = await servicer_stub.CreateMachine(
            m.CreateMachineRequest(**bid(skip_launch=True)), timeout=T
        )
        owner = fleet.owner_of(created.machine.id)
        worker = owner.worker
        digest = worker.rows[created.machine.id].image_digest
        worker_id = worker.identity.worker_id
        old_id = f"{worker_id}-fzmid\n"
        old = fsm.create(
            fsm.pb.Machine(id=old_id, app="web", worker_id=worker_id, config=config()),
            image_digest=digest,
            skip_launch=True,
            now=0.0,
        )
        worker.images.use(digest)
        await worker.runner.commit(old_id, [old])
        request = m.DestroyMachineRequest(machine_id=old_id, force=True)
        await servicer_stub.DestroyMachine(request, timeout=T)
        wait = m.WaitMachineRequest(machine_id=old_id, state=DESTROYED, timeout=seconds(5))
        assert (await servicer_stub.WaitMachine(wait, timeout=T)).machine.state == DESTROYED
