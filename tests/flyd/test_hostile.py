"""flyd against hostile requests (issue 19), in-process on the fake driver: each defect the
hostile run found, as its repro.

1. Unbounded configs made a worker's snapshot and list answers too large to send: requests are
   bounded (named field and bound), snapshots come in parts, lists in pages, and destroyed rows
   keep only their image and size.
2. An id with a trailing newline passed the name check and could never be destroyed.
4. Creates completed after their caller gave up.
5. A megabyte of name came back as a megabyte of error text.
6. A malformed protobuf answered UNKNOWN with a Python class name.
And: SIGSTOP froze a machine that still showed as started.
"""

# ruff: noqa: F811 - the servicer fixtures are imported from servicer_support, then asked for by name

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import Any

import grpc
import pytest

from flyd import fsm
from flyd import worker as worker_module
from flyd.runner import Runner
from flyd.v1 import machine_pb2 as pb
from flyd.v1 import worker_pb2 as w
from model import pages
from model.errors import DeadlineExceeded, Unavailable
from registry.view import View
from runtime.clock import ManualClock
from tests.flyd.servicer_support import (  # noqa: F401 - the servicer fixtures
    Stub,
    create,
    draining,
    flyd,
    grpc_add_to_server,
    grpc_servicer,
    grpc_stub_cls,
    heartbeat_interval,
    log_read_bytes,
    streams_per_caller,
    wait,
)
from tests.flyd.support import (
    CREATED,
    DESTROYED,
    IMAGE,
    STARTED,
    Flyd,
    Node,
    config,
    until,
)
from tests.servicers import INVALID, T, refused

DESTROYING = pb.MACHINE_STATE_DESTROYING


def big(cfg: pb.MachineConfig, **fields: Any) -> pb.MachineConfig:
    """`cfg` with `fields` set (lists extended, maps updated)."""
    out = pb.MachineConfig()
    out.CopyFrom(cfg)
    for name, value in fields.items():
        target = getattr(out, name)
        if isinstance(value, dict):
            target.update(value)
        else:
            target.extend(value)
    return out


# The hostile run's oversized requests, each refused naming the field and its bound.
OVERSIZED: list[tuple[str, Callable[[], Any], str, str]] = [
    (
        "CreateMachine",
        lambda: w.CreateMachineRequest(app="web", config=big(config(), cmd=["a" * 2**20])),
        "config.cmd[0]",
        "at most 4096 characters",
    ),
    (
        "CreateMachine",
        lambda: w.CreateMachineRequest(app="web", config=big(config(), cmd=["a"] * 100_000)),
        "config.cmd",
        "at most 256 entries",
    ),
    (
        "CreateMachine",
        lambda: w.CreateMachineRequest(
            app="web",
            config=big(config(), checks=[pb.CheckConfig(tcp=pb.TcpCheck())] * 100_000),
        ),
        "config.checks",
        "at most 16 entries",
    ),
    (
        "CreateMachine",
        lambda: w.CreateMachineRequest(app="web", config=big(config(), standbys=["m"] * 10_000)),
        "config.standbys",
        "at most 16 entries",
    ),
    (
        "CreateMachine",
        lambda: w.CreateMachineRequest(
            app="web", config=big(config(), env={f"K{i}": "v" * 4000 for i in range(100)})
        ),
        "config",
        "at most 65536 bytes encoded",
    ),
    (
        "AcquireLease",
        lambda: w.AcquireLeaseRequest(machine_id="m1", owner="o" * 2**20),
        "owner",
        "at most 256 characters",
    ),
    (
        "GetMachine",
        lambda: w.GetMachineRequest(machine_id="m" * 2**20),
        "machine_id",
        "at most 1024 characters",
    ),
]


@pytest.mark.parametrize(("rpc", "request_of", "field", "bound"), OVERSIZED)
async def test_an_oversized_field_is_refused_naming_it_and_its_bound(
    servicer_stub: Stub,
    flyd: Flyd,
    rpc: str,
    request_of: Callable[[], Any],
    field: str,
    bound: str,
) -> None:
    err = await refused(getattr(servicer_stub, rpc)(request_of(), timeout=T), INVALID, field)
    assert bound in (err.details() or "")
    assert len(err.details() or "") < 200  # no echo of the value
    assert flyd.worker.rows == {}


async def test_a_long_name_is_quoted_by_a_short_prefix(servicer_stub: Stub) -> None:
    err = await refused(create(servicer_stub, app="a" * 1000), INVALID, "app")
    assert "(1000 chars)" in (err.details() or "")
    assert len(err.details() or "") < 200


@pytest.mark.parametrize(
    "payload",
    [b"\xff\xff\xff", b"\x0a\x05ab", b"\x1a\x02\xc3\x28"],  # garbage, truncated, bad UTF-8
    ids=["garbage", "truncated", "bad utf-8"],
)
async def test_a_malformed_request_is_invalid_argument_in_plain_words(
    servicer_stub: Stub, grpc_addr: str, flyd: Flyd, payload: bytes
) -> None:
    async with grpc.aio.insecure_channel(grpc_addr) as channel:
        raw = channel.unary_unary("/flyd.v1.WorkerService/CreateMachine")
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await raw(payload, timeout=T)
    assert caught.value.code() == INVALID
    assert caught.value.details() == (
        "request: not a valid flyd.v1.CreateMachineRequest (malformed or truncated)"
    )
    assert flyd.worker.rows == {}


# -- answers that cannot outgrow a message -----------------------------------------------------


async def test_a_snapshot_in_parts_rebuilds_every_machine_in_a_fresh_replica(
    servicer_stub: Stub, flyd: Flyd, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Defect 1's repro, scaled to the parts' size: machines whose configs are as large as the
    bounds allow, some destroyed; a replica reading the snapshot from scratch has them all."""
    monkeypatch.setattr(pages, "PAGE_BYTES", 150_000)
    heavy = big(config(memory=64), cmd=["a" * 4000] * 15)  # ~60 KB: under the config's bound
    for i in range(10):
        await create(servicer_stub, f"m{i}", heavy, skip_launch=True)
    for i in range(0, 10, 2):
        request = w.DestroyMachineRequest(machine_id=f"m{i}")
        await servicer_stub.DestroyMachine(request, timeout=T)
        await wait(servicer_stub, DESTROYED, f"m{i}")

    call = servicer_stub.WatchEvents(w.WatchEventsRequest(from_seq=0), timeout=T)
    view = View(suspect_after=1, dead_after=2)
    view.add(flyd.worker.info(), 0.0)
    parts = []
    async for item in call:
        assert item.ByteSize() < 4 << 20
        parts.append(item.snapshot)
        view.apply("w1", item, 0.0)
        if not item.snapshot.more:
            break
    call.cancel()
    assert [p.part for p in parts] == list(range(len(parts)))
    assert len(parts) > 1
    assert {m.id for m in view.machines()} == {f"m{i}" for i in range(10)}
    for i in range(0, 10, 2):  # destroyed rows keep their image and size, not the rest
        row = view.machine(f"m{i}")
        assert row is not None
        assert row.state == DESTROYED
        assert list(row.config.cmd) == []
        assert row.config.image == IMAGE


async def test_list_machines_comes_in_pages(
    servicer_stub: Stub, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pages, "PAGE_BYTES", 150_000)
    heavy = big(config(memory=64), cmd=["a" * 4000] * 15)
    for i in range(6):
        await create(servicer_stub, f"m{i}", heavy, skip_launch=True)
    seen: list[str] = []
    request = w.ListMachinesRequest()
    while True:
        page = await servicer_stub.ListMachines(request, timeout=T)
        assert 0 < len(page.machines) <= 3
        seen += [m.id for m in page.machines]
        if not page.next_page_token:
            break
        request.page_token = page.next_page_token
    assert seen == [f"m{i}" for i in range(6)]
    by_size = await servicer_stub.ListMachines(w.ListMachinesRequest(page_size=2), timeout=T)
    assert [m.id for m in by_size.machines] == ["m0", "m1"]
    await refused(
        servicer_stub.ListMachines(w.ListMachinesRequest(page_size=1001), timeout=T),
        INVALID,
        "page_size",
    )


# -- names -------------------------------------------------------------------------------------


async def test_an_id_with_a_trailing_newline_is_refused(servicer_stub: Stub, flyd: Flyd) -> None:
    await refused(create(servicer_stub, "fzmid\n"), INVALID, "machine_id")
    await refused(create(servicer_stub, app="web\n"), INVALID, "app")
    assert flyd.worker.rows == {}


async def test_a_row_accepted_before_the_fix_can_be_destroyed(
    servicer_stub: Stub, flyd: Flyd
) -> None:
    """Defect 2: such a row (in the log from an older flyd) failed every spawn and every
    cleanup; it is found by its id and destroyed, its reservation released."""
    await create(servicer_stub, "m1", skip_launch=True)  # pulls the image
    digest = flyd.worker.rows["m1"].image_digest
    old = pb.Machine(id="fzmid\n", app="web", worker_id="w1", config=config())
    flyd.worker.images.use(digest)
    await flyd.worker.runner.commit(
        "fzmid\n", [fsm.create(old, image_digest=digest, skip_launch=True, now=0.0)]
    )
    request = w.DestroyMachineRequest(machine_id="fzmid\n", force=True)
    await servicer_stub.DestroyMachine(request, timeout=T)
    assert (await wait(servicer_stub, DESTROYED, "fzmid\n")).state == DESTROYED
    assert flyd.worker.reserved().machines == 1  # m1 only


async def test_a_destroyed_row_from_an_older_flyd_is_stripped_on_recovery(node: Node) -> None:
    """Defect 1 in a log written before destroyed rows were stripped: such a row keeps its
    whole config. The next flyd strips it as it recovers, in memory and in the log, so it no
    longer weighs on every snapshot."""
    first = node.boot()
    heavy = big(config(), cmd=["a" * 4000] * 10, env={"K": "v" * 4000})
    await first.worker.create(machine_id="m1", name="", app="web", config=heavy, skip_launch=True)
    row = first.worker.rows["m1"]
    await first.kill()
    # What the older flyd left: destroyed, with everything it held.
    machine = pb.Machine()
    machine.CopyFrom(row.machine)
    machine.state = DESTROYED
    old = fsm.encode_row(dataclasses.replace(row, machine=machine, op=None, lease=None))
    store = node.open_log()
    store.commit([], {"m1": old})
    store.close()

    second = node.boot()
    kept = second.worker.rows["m1"].machine
    assert kept.state == DESTROYED
    assert (kept.config.image, list(kept.config.cmd), dict(kept.config.env)) == (IMAGE, [], {})
    assert kept.config.guest == heavy.guest
    await second.kill()
    store = node.open_log()
    try:
        stored = store.row("m1")
        assert stored is not None
        assert len(stored) < len(old) // 10
        assert fsm.decode_row(stored).machine == kept
    finally:
        store.close()
    third = node.boot()  # a stripped row is left as it is
    assert third.worker.rows["m1"].machine == kept


# -- cleanup that fails ------------------------------------------------------------------------


async def test_a_failed_cleanup_is_retried_with_a_backoff(
    servicer_stub: Stub, flyd: Flyd, clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    failures = [Unavailable("cgroup busy"), Unavailable("cgroup busy")]
    real = flyd.driver.cleanup

    async def flaky(machine_id: str) -> None:
        if failures:
            raise failures.pop(0)
        await real(machine_id)

    monkeypatch.setattr(flyd.driver, "cleanup", flaky)
    await create(servicer_stub, skip_launch=True)
    machine = (
        await servicer_stub.DestroyMachine(w.DestroyMachineRequest(machine_id="m1"), timeout=T)
    ).machine
    assert machine.state == DESTROYING
    events = await servicer_stub.ListMachineEvents(
        w.ListMachineEventsRequest(machine_id="m1"), timeout=T
    )
    assert events.events[-1].reason == "cleanup failed: cgroup busy; retrying in 0.5s"

    def cleaned() -> bool:
        clock.advance(fsm.Policy().backoff_max)  # whatever backoff it is in is over
        return flyd.worker.rows["m1"].state == DESTROYED

    await until(flyd.worker, cleaned)
    assert failures == []


async def test_a_cleanup_that_always_fails_ends_destroyed_and_says_so(
    servicer_stub: Stub, flyd: Flyd, clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def broken(machine_id: str) -> None:
        raise Unavailable("cgroup busy")

    monkeypatch.setattr(flyd.driver, "cleanup", broken)
    await create(servicer_stub, skip_launch=True)
    await servicer_stub.DestroyMachine(w.DestroyMachineRequest(machine_id="m1"), timeout=T)

    def settled() -> bool:
        clock.advance(fsm.Policy().backoff_max)
        return flyd.worker.rows["m1"].state == DESTROYED

    await until(flyd.worker, settled)
    reason = flyd.worker.rows["m1"].machine.events[-1].reason
    assert f"cleanup failed {fsm.MAX_CLEANUP_ATTEMPTS} times" in reason
    assert flyd.worker.reserved().machines == 0


# -- deadlines ---------------------------------------------------------------------------------


async def test_a_create_whose_caller_gave_up_leaves_no_machine(
    servicer_stub: Stub, flyd: Flyd, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Defect 4: the spawn outlasts the caller's deadline; nothing is committed."""
    real = flyd.driver.start
    gate = asyncio.Event()

    async def slow(spec: Any) -> Any:
        await gate.wait()
        return await real(spec)

    monkeypatch.setattr(flyd.driver, "start", slow)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await create_with_timeout(servicer_stub, 0.2)
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    gate.set()
    await holds(lambda: not flyd.worker.reservations.pending)
    assert flyd.worker.rows == {}
    assert flyd.driver.host.processes == {}


async def test_a_create_committed_past_its_deadline_is_rolled_back(
    flyd: Flyd, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The commit races the deadline and wins by a hair: the answer cannot reach the caller,
    so the machine is destroyed and its row dropped (its id is free for a retry)."""
    monkeypatch.setattr(Runner, "_check_in_time", staticmethod(lambda *_: None))
    loop = asyncio.get_running_loop()
    worker = flyd.worker
    with pytest.raises(DeadlineExceeded, match="rolled back"):
        await worker.create(
            machine_id="m1",
            name="",
            app="web",
            config=config(),
            skip_launch=False,
            deadline=loop.time() - 1,
        )
    await holds(lambda: "m1" not in worker.rows)  # dropped: no change of its own to wake on
    assert worker.reserved().machines == 0
    again = await worker.create(
        machine_id="m1", name="", app="web", config=config(), skip_launch=True
    )
    assert again.state == CREATED


async def test_a_create_ready_within_the_margin_of_its_deadline_is_rolled_back(
    flyd: Flyd, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ready before the deadline, but with less time left than its answer needs to travel
    (COMMIT_MARGIN, made an hour here): the caller would hear of it too late."""
    monkeypatch.setattr(Runner, "_check_in_time", staticmethod(lambda *_: None))
    monkeypatch.setattr(worker_module, "COMMIT_MARGIN", 3600.0)
    loop = asyncio.get_running_loop()
    with pytest.raises(DeadlineExceeded, match="rolled back"):
        await flyd.worker.create(
            machine_id="m1",
            name="",
            app="web",
            config=config(),
            skip_launch=False,
            deadline=loop.time() + 1800,
        )
    await holds(lambda: "m1" not in flyd.worker.rows)
    assert flyd.worker.reserved().machines == 0


async def test_a_create_past_its_commit_deadline_is_not_committed(flyd: Flyd) -> None:
    loop = asyncio.get_running_loop()
    with pytest.raises(DeadlineExceeded, match="nothing was created"):
        await flyd.worker.create(
            machine_id="m1",
            name="",
            app="web",
            config=config(),
            skip_launch=False,
            deadline=loop.time(),
        )
    assert flyd.worker.rows == {}
    assert flyd.driver.host.processes == {}


async def holds(check: Callable[[], bool]) -> None:
    """Wait (bounded) for `check()`, for what no committed change announces."""
    async with asyncio.timeout(T):
        while not check():  # noqa: ASYNC110 - nothing to wait on: no change announces it
            await asyncio.sleep(0.01)


async def create_with_timeout(stub: Stub, timeout: float) -> None:
    request = w.CreateMachineRequest(machine_id="m1", app="web", config=config())
    await stub.CreateMachine(request, timeout=timeout)


# -- frozen machines ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["SIGSTOP", "STOP", "19", "SIGTSTP", "SIGTTIN", "SIGTTOU"])
async def test_a_signal_that_would_freeze_the_machine_is_refused(
    servicer_stub: Stub, flyd: Flyd, name: str
) -> None:
    await create(servicer_stub)
    request = w.SignalMachineRequest(machine_id="m1", signal=name)
    err = await refused(servicer_stub.SignalMachine(request, timeout=T), INVALID, "signal")
    assert "freeze" in (err.details() or "")
    assert flyd.driver.signals == []
    assert flyd.worker.rows["m1"].state == STARTED
