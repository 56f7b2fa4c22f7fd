"""A host's disk in a simulated world: the machine log flyd writes, with crash semantics.

flyd's real log is LMDB, one fsynced transaction per batch of commits, written by a thread of
its own (flyd.commits) so the loop goes on meanwhile; readers see a transaction once it is
durable, never before. The simulated disk keeps the same two kinds of writes apart:

- *pending*: a batch handed to the disk and not yet synced. It takes a drawn time (and now
  and then a stall of seconds); the node goes on running meanwhile. If the node dies first,
  the batch is lost, all of it, and nobody was told it was written;
- *synced*: what the log holds, and what a restarted node on the same disk reads.

A sync can fail with EIO: nothing of its batch is written and every commit in it fails, as a
real `lmdb.Error` would fail them. The durable state is a `MemoryMachineLog` (the in-memory
twin with the LMDB store's contract), or a real `LmdbMachineLog` on tmpfs, so the run can be
checked against both.

`SimDisk.crash()` is what a SIGKILL does to the files of the dead process: its handles are
closed (whatever its `finally` blocks try later reaches nothing) and its pending batches are
gone. The disk and its synced state stay for the next node.
"""

from __future__ import annotations

import errno
import random
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flyd.commits import Then
from flyd.store import LmdbMachineLog, MachineLog, MemoryMachineLog, NewRecord, Record, Snapshot
from runtime.entropy import Entropy
from sim.world import SimLoop


@dataclass
class DiskFaults:
    """How a disk misbehaves, drawn per batch: the nemesis changes these while a run goes."""

    latency: tuple[float, float] = (0.0002, 0.005)  # seconds a sync takes, uniform
    stall_p: float = 0.0  # chance that a sync stalls instead
    stall: tuple[float, float] = (1.0, 10.0)  # how long a stall lasts, uniform
    eio_p: float = 0.0  # chance that a sync fails with EIO

    def __post_init__(self) -> None:
        for name in ("stall_p", "eio_p"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"DiskFaults.{name} must be within 0..1")
        for name in ("latency", "stall"):
            low, high = getattr(self, name)
            if not 0.0 <= low <= high:
                raise ValueError(f"DiskFaults.{name} must be (low, high) with 0 <= low <= high")


@dataclass
class DiskStats:
    """What a disk did, for the run's report and for the tests that force a fault."""

    synced: int = 0
    lost: int = 0  # batches pending at a crash
    eio: int = 0
    stalls: int = 0


@dataclass
class _Pending:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    then: Then
    loop: SimLoop
    handle: Any = field(default=None, repr=False)  # the loop's timer


class SimDisk:
    """One host's disk: its machine log outlives every node that opened it."""

    def __init__(
        self,
        name: str,
        rng: random.Random,
        entropy: Entropy,
        *,
        lmdb_dir: Path | None = None,
        faults: DiskFaults | None = None,
    ) -> None:
        """`lmdb_dir`: keep the log in a real LMDB environment there (tmpfs, for speed);
        None keeps it in memory."""
        self.name = name
        self.rng = rng
        self.faults = faults or DiskFaults()
        self.stats = DiskStats()
        self._lmdb_dir = lmdb_dir
        self._entropy = entropy
        self._memory: MemoryMachineLog | None = None
        self._open: list[SimMachineLog] = []
        self._pending: list[_Pending] = []
        self._lost: list[_Pending] = []  # pending at a crash: their writers never hear back

    @property
    def pending(self) -> int:
        """Batches handed to the disk and not yet synced."""
        return len(self._pending)

    def open_log(self) -> SimMachineLog:
        """The machine log as a starting flyd opens it: everything synced so far."""
        if self._open:
            raise RuntimeError(f"disk {self.name}: the log is open already (crash its node first)")
        if self._lmdb_dir is not None:
            store: MachineLog = LmdbMachineLog(
                self._lmdb_dir, map_size=1 << 26, entropy=self._entropy
            )
        else:
            if self._memory is None:
                self._memory = MemoryMachineLog(entropy=self._entropy)
            store = self._memory
        log = SimMachineLog(self, store)
        self._open.append(log)
        return log

    def writer(self, loop: SimLoop) -> SimWriter:
        """What flyd's group commit writes through (flyd.commits' writer seam)."""
        return SimWriter(self, loop)

    def crash(self) -> None:
        """The process that had the disk open died: pending batches are lost, handles shut."""
        for pending in self._pending:
            if pending.handle is not None:
                pending.handle.cancel()
        self.stats.lost += len(self._pending)
        self._lost += self._pending
        self._pending = []
        for log in self._open:
            log.fence()
        self._open.clear()

    def release(self) -> None:
        """After the run: the batches lost at a crash fail (EBADF) on their dead writers'
        loops, so that a dead node unwinding at the world's close is not left waiting on
        them. Nothing of the run sees this."""
        lost, self._lost = self._lost, []
        for pending in lost:
            error = OSError(errno.EBADF, f"disk {self.name}: the writer died")
            pending.loop.call_soon(pending.then, None, error)

    def synced(self) -> Snapshot:
        """What the log holds, read past any node (for checkers)."""
        if self._open:
            return self._open[0].durable.snapshot()
        log = self.open_log()
        try:
            return log.snapshot()
        finally:
            log.close()

    # -- drawn per batch --

    def _draw_delay(self) -> float:
        faults = self.faults
        if faults.stall_p and self.rng.random() < faults.stall_p:
            self.stats.stalls += 1
            return self.rng.uniform(*faults.stall)
        return self.rng.uniform(*faults.latency)

    def _draw_eio(self) -> bool:
        return bool(self.faults.eio_p) and self.rng.random() < self.faults.eio_p


class SimWriter:
    """flyd.commits' writer on a simulated disk: each call (a batch's transaction, or a
    compaction) is pending for a drawn time, then runs on the loop and is synced."""

    def __init__(self, disk: SimDisk, loop: SimLoop) -> None:
        self.disk = disk
        self.loop = loop

    def call(self, fn: Callable[..., Any], args: tuple[Any, ...], then: Then) -> None:
        pending = _Pending(fn, args, then, self.loop)
        self.disk._pending.append(pending)
        pending.handle = self.loop.call_later(self.disk._draw_delay(), self._sync, pending)

    def _sync(self, pending: _Pending) -> None:
        self.disk._pending.remove(pending)
        try:
            result = pending.fn(*pending.args)
        except Exception as err:  # the committers hear of it
            pending.then(None, err)
        else:
            pending.then(result, None)

    def stop(self) -> None:
        """Nothing to stop: group commit waits for its batches before it stops the writer."""


class SimMachineLog:
    """flyd's handle on the disk's log: the durable store's contract, with the disk's EIO,
    closed for good when its node dies."""

    blocking = True  # commits go through the writer, off the caller's step

    def __init__(self, disk: SimDisk, durable: MachineLog) -> None:
        self.disk = disk
        self.durable = durable
        self._fenced = False

    def fence(self) -> None:
        self._fenced = True
        if isinstance(self.durable, LmdbMachineLog):
            self.durable.close()

    def _check(self) -> MachineLog:
        if self._fenced:
            raise OSError(errno.EBADF, f"disk {self.disk.name}: the log was closed by a crash")
        return self.durable

    def epoch(self) -> str:
        return self._check().epoch()

    def last_seq(self) -> int:
        return self._check().last_seq()

    def first_seq(self) -> int:
        return self._check().first_seq()

    def commit(self, records: Iterable[NewRecord], rows: Mapping[str, bytes | None]) -> int:
        store = self._check()
        if self.disk._draw_eio():
            self.disk.stats.eio += 1
            raise OSError(errno.EIO, f"disk {self.disk.name}: input/output error")
        seq = store.commit(records, rows)
        self.disk.stats.synced += 1
        return seq

    def row(self, machine_id: str) -> bytes | None:
        return self._check().row(machine_id)

    def rows(self) -> dict[str, bytes]:
        return self._check().rows()

    def read(self, after_seq: int, limit: int = 1000) -> list[Record]:
        return self._check().read(after_seq, limit)

    def snapshot(self) -> Snapshot:
        return self._check().snapshot()

    def compact(self, keep: int) -> int:
        return self._check().compact(keep)

    def close(self) -> None:
        """flyd's own close at a clean stop: the disk may be opened again."""
        if not self._fenced:
            self.fence()
            if self in self.disk._open:
                self.disk._open.remove(self)
