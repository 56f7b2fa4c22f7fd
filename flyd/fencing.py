"""Fencing a returning worker's slot primaries (docs/fencing.md).

A flyd that may have been away (started again on its data dir, or frozen or starved for longer
than `fence_after`) marks every slot primary it runs, or is about to run, `fenced` before it
sends another heartbeat: no proxy routes to a fenced member. Then it confirms each one with the
other members of its slot, directly: the replicas it announces to say who the members are
(RegistryService.ListSlot), and each member's own worker says what its row holds
(WorkerService.GetMachine). A member outranking the claim supersedes it (the copy stops and
stands by for the promoted one); otherwise the fence is lifted. A member that cannot be asked
keeps the fence on, and the worker tries again with backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import grpc
import grpc.aio
import structlog

from flyd import fsm
from flyd.metrics import FENCED, SUPERSEDED
from flyd.runner import Runner
from flyd.v1 import machine_pb2 as pb
from flyd.v1 import worker_pb2, worker_pb2_grpc
from model import slots
from registry.v1 import registry_pb2, registry_pb2_grpc
from runtime.clock import Clock

log = structlog.get_logger("flyd.worker")
S = pb.MachineState
# States in which a primary serves, or is about to: what a returning worker fences.
SERVING = frozenset({S.MACHINE_STATE_STARTED, S.MACHINE_STATE_STARTING, S.MACHINE_STATE_RESTARTING})
PEER_TIMEOUT = 1.0
RETRY_MIN = 0.05
# Fenced machines confirmed at once.
CONFIRM_CONCURRENCY = 16
# How often the worker checks that it has not been away (frozen, starved).
AWAKE_TICK = 0.1


class PeerUnreachable(Exception):
    """A member's worker (or every replica) could not be asked."""


@dataclass(frozen=True)
class Peer:
    """Another member of a slot, and where its worker answers."""

    machine_id: str
    worker_id: str
    address: str


class SlotPeers(Protocol):
    """Who else is in a slot, and what their rows hold (`GrpcPeers`; a fake in tests)."""

    async def members(self, app: str, slot: str) -> list[Peer]:
        """The slot's members as the replicas know them; PeerUnreachable when none answers."""
        ...

    async def row(self, peer: Peer) -> pb.Machine | None:
        """The member's row from its own worker (None: it has no such machine any more);
        PeerUnreachable when the worker does not answer."""
        ...


class GrpcPeers:
    """`SlotPeers` over gRPC: the replicas this worker announces to, then each member's worker."""

    def __init__(
        self,
        replicas: Sequence[str],
        channel: Callable[[str], grpc.aio.Channel],
        timeout: float = PEER_TIMEOUT,
    ) -> None:
        self.replicas = tuple(replicas)
        self.timeout = timeout
        self._channel = channel

    async def members(self, app: str, slot: str) -> list[Peer]:
        found: dict[str, Peer] = {}
        answered = False
        for address in self.replicas:  # every one: a member one of them lags on is still found
            channel = self._channel(address)
            try:
                resp = await registry_pb2_grpc.RegistryServiceStub(channel).ListSlot(
                    registry_pb2.ListSlotRequest(app=app, slot=slot), timeout=self.timeout
                )
            except grpc.aio.AioRpcError as err:
                log.debug("slot_lookup_failed", replica=address, code=err.code().name)
                continue
            finally:
                await channel.close()
            answered = True
            for member in resp.members:
                found[member.machine.id] = Peer(
                    member.machine.id, member.machine.worker_id, member.worker.address
                )
        if not answered:
            raise PeerUnreachable(f"no replica answered for slot {slot} ({len(self.replicas)})")
        return list(found.values())

    async def row(self, peer: Peer) -> pb.Machine | None:
        channel = self._channel(peer.address)
        try:
            resp = await worker_pb2_grpc.WorkerServiceStub(channel).GetMachine(
                worker_pb2.GetMachineRequest(machine_id=peer.machine_id), timeout=self.timeout
            )
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.NOT_FOUND:
                return None
            raise PeerUnreachable(
                f"worker {peer.worker_id} ({peer.address}): {err.code().name}"
            ) from None
        finally:
            await channel.close()
        return resp.machine


class Fencing:
    """The fences of one worker: putting them on when it comes back, and confirming them.

    `peers` None (the worker announces to no replica): nobody to confirm with, so nothing is
    fenced, and flyd says so at start. `monotonic` measures time away (real time in flyd: the
    injected clock of a test jumps without the worker having been away).
    """

    def __init__(
        self,
        runner: Runner,
        clock: Clock,
        *,
        peers: SlotPeers | None,
        fence_after: float,
        stop_params: Callable[[fsm.Row], tuple[int, float]],
        retry_max: float = 2.0,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.runner = runner
        self.rows = runner.rows
        self.clock = clock
        self.peers = peers
        self.fence_after = fence_after
        self.retry_max = retry_max
        self._stop_params = stop_params
        self._monotonic = monotonic
        self._awake = monotonic()
        self._fencing: asyncio.Future[None] | None = None
        self._wake = asyncio.Event()
        self._slots = asyncio.Semaphore(CONFIRM_CONCURRENCY)
        self.fenced_total = 0
        self.superseded_total = 0

    def pending(self) -> list[str]:
        """Machines fenced now, by id."""
        return sorted(mid for mid, row in self.rows.items() if row.machine.slot.fenced)

    def _returning(self) -> list[str]:
        return [
            mid
            for mid, row in self.rows.items()
            if row.state in SERVING
            and slots.is_primary(row.machine)
            and not row.machine.slot.fenced
        ]

    def fence_recovered(self) -> int:
        """At start, before anyone can follow the worker: fence every slot primary it runs.

        Synchronous: no operation runs yet (recovery only scheduled them), so the commits need
        no machine lock."""
        if self.peers is None:
            return 0
        fenced = 0
        for mid in self._returning():
            t = fsm.step(
                self.rows[mid],
                fsm.Fence("flyd started again on its data dir"),
                now=self.clock.now(),
                policy=self.runner.policy,
            )
            if t is not None:
                self.runner.commit_now(mid, [t])
                fenced += 1
        self._count(fenced)
        self._awake = self._monotonic()
        return fenced

    async def check_awake(self) -> bool:
        """Whether the worker was away (no check for longer than `fence_after`); if so, its
        slot primaries are fenced before this returns. Called before every heartbeat, so the
        fences go out first; concurrent callers all wait for the same fencing."""
        if self.peers is None:
            return False
        if self._fencing is not None:
            await asyncio.shield(self._fencing)
            return True
        now = self._monotonic()
        away = now - self._awake
        self._awake = now
        if away <= self.fence_after:
            return False
        # A task of its own, not the caller's: the caller is often a stream's heartbeat, and a
        # replica tears a stream silent for long down (a long freeze) and so cancels it. The
        # fencing must still finish and wake the confirming loop, or the fence stays on.
        fencing = self._fencing = asyncio.ensure_future(self._fence_all(away))
        await asyncio.shield(fencing)
        return True

    async def _fence_all(self, away: float) -> None:
        fenced = 0
        try:
            reason = f"flyd was away for {away:.3g}s (frozen or starved)"
            for mid in self._returning():
                with contextlib.suppress(Exception):  # (a machine destroyed meanwhile)
                    before = self.rows[mid].machine.slot.fenced
                    await self.runner.drive(mid, fsm.Fence(reason))
                    fenced += int(not before and self.rows[mid].machine.slot.fenced)
            log.warning("worker_was_away", seconds=round(away, 3), fenced=fenced)
        finally:
            self._count(fenced)
            self._awake = self._monotonic()
            self._fencing = None

    def _count(self, fenced: int) -> None:
        if fenced:
            self.fenced_total += fenced
            FENCED.inc(fenced)
            self._wake.set()

    def poke(self) -> None:
        """Try the fenced machines again now (a new fence, a supersede)."""
        self._wake.set()

    async def run(self, shutdown: asyncio.Event) -> None:
        """Confirm fenced machines until `shutdown`: every one at once, the ones that could not
        be confirmed again after a backoff (doubling up to `retry_max`)."""
        if self.peers is None:
            log.warning(
                "fencing_off",
                consequence="a returning worker cannot check whether its slots moved on: "
                "announce it to a replica (--announce) to fence and confirm them",
            )
            await shutdown.wait()
            return
        backoff = RETRY_MIN
        while not shutdown.is_set():
            self._wake.clear()
            waiting = self.pending()
            settled = await asyncio.gather(*(self._bounded(mid) for mid in waiting))
            unsettled = [mid for mid, ok in zip(waiting, settled, strict=True) if not ok]
            if not unsettled:
                backoff = RETRY_MIN
                await _first(self._wake.wait(), shutdown.wait())
                continue
            delay, backoff = backoff, min(backoff * 2, self.retry_max)
            await _first(
                self._wake.wait(),
                shutdown.wait(),
                self.clock.sleep_until(self.clock.now() + delay),
            )

    async def _bounded(self, machine_id: str) -> bool:
        async with self._slots:
            return await self.confirm(machine_id)

    async def tick(self, shutdown: asyncio.Event) -> None:
        """Notice a freeze even with nobody following the worker."""
        while not shutdown.is_set() and self.peers is not None:
            await self.check_awake()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(shutdown.wait(), AWAKE_TICK)

    async def confirm(self, machine_id: str) -> bool:
        """Ask the other members of the fenced machine's slot for their claims and act on what
        they say; False when some member could not be asked (it stays fenced)."""
        row = self.rows.get(machine_id)
        if row is None or not row.machine.slot.fenced or self.peers is None:
            return True
        machine = row.machine
        slot, key = machine.slot, slots.key(machine)
        # Members of its app's slot only: another app's row naming the same slot id is not one.
        claims = [
            other.machine
            for other in self.rows.values()
            if other.machine.id != machine_id and slots.key(other.machine) == key
        ]
        try:
            peers = await self.peers.members(machine.app, slot.id)
            others = [p for p in peers if p.machine_id not in self.rows]  # (nor itself)
            got = await asyncio.gather(*(self.peers.row(p) for p in others))
        except PeerUnreachable as err:
            log.info("fence_kept", machine_id=machine_id, slot=slot.id, reason=str(err))
            return False
        claims += [m for m in got if m is not None and slots.key(m) == key]
        best = slots.top([machine, *claims])
        assert best is not None
        row = self.rows.get(machine_id)
        if row is None or not row.machine.slot.fenced:
            return True  # promoted or superseded while we asked
        if best != slots.claim(row.machine):
            sig, timeout = self._stop_params(row)
            await self.runner.drive(machine_id, fsm.Supersede(best[0], best[1], sig, timeout))
            self.superseded_total += 1
            SUPERSEDED.inc()
            log.warning(
                "machine_superseded",
                machine_id=machine_id,
                slot=slot.id,
                generation=best[0],
                primary=best[1],
                state=fsm.state_name(self.rows[machine_id].state),
            )
        else:
            await self.runner.drive(machine_id, fsm.Confirm(slot.generation))
            log.info(
                "fence_lifted",
                machine_id=machine_id,
                slot=slot.id,
                generation=slot.generation,
                members=len(claims) + 1,
            )
        return True


async def _first(*aws: Awaitable[object]) -> None:
    """Wait for the first of the awaitables; cancel the rest."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()
