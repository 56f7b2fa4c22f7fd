"""flyd.commits: the machine log's one writer, against the in-memory log (written on the loop)
and LMDB (written by a thread of its own)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

from flyd.commits import GroupCommit, durable
from flyd.store import LmdbMachineLog, MachineLog, MemoryMachineLog, NewRecord, RecordType


def record(body: str) -> NewRecord:
    return NewRecord(RecordType.MACHINE_CHANGE, body.encode())


class Refusing:
    """A log whose next commit fails (a full disk), then works again."""

    def __init__(self, inner: MachineLog) -> None:
        self.inner = inner
        self.blocking = inner.blocking
        self.refuse = False

    def commit(self, records: Iterable[NewRecord], rows: Mapping[str, bytes | None]) -> int:
        if self.refuse:
            self.refuse = False
            raise OSError("no space left on device")
        return self.inner.commit(records, rows)

    def last_seq(self) -> int:
        return self.inner.last_seq()


@pytest.fixture(params=["memory", "lmdb"])
def log(request: pytest.FixtureRequest, tmp_path: Path) -> MachineLog:
    return MemoryMachineLog() if request.param == "memory" else LmdbMachineLog(tmp_path / "db")


async def test_commits_of_one_turn_share_a_transaction_in_order(log: MachineLog) -> None:
    commits = GroupCommit(log)
    told: list[int] = []
    futures = [
        commits.submit([record(f"a{i}"), record(f"b{i}")], {f"m{i}": b"row"}, told.append)
        for i in range(3)
    ]
    assert commits.assigned == 6  # numbered at once, before anything is written
    assert await asyncio.gather(*futures) == [2, 4, 6]
    assert told == [2, 4, 6]  # each told once durable, in commit order
    assert commits.batches == 1
    assert [r.body for r in log.read(0)] == [b"a0", b"b0", b"a1", b"b1", b"a2", b"b2"]
    await commits.close()


async def test_a_failed_transaction_fails_what_was_queued_behind_it(log: MachineLog) -> None:
    refusing = Refusing(log)
    commits = GroupCommit(refusing)  # type: ignore[arg-type]
    await commits.submit([record("kept")], {})
    refusing.refuse = True
    told: list[int] = []
    first = commits.submit([record("lost")], {"m1": b"row"}, told.append)
    await asyncio.sleep(0)  # its transaction begins; the next commit waits for it
    second = commits.submit([record("also lost")], {}, told.append)
    for future in (first, second):
        with pytest.raises(OSError, match="no space"):
            await future
    assert told == []
    assert log.row("m1") is None
    # Numbers go on from the log: no gap where the failed ones were.
    assert await commits.submit([record("next")], {}) == 2
    assert [r.body for r in log.read(0)] == [b"kept", b"next"]
    await commits.close()


async def test_a_cancelled_caller_waits_for_its_commit(log: MachineLog) -> None:
    commits = GroupCommit(log)
    done = commits.submit([record("x")], {"m1": b"row"})
    waiter = asyncio.ensure_future(durable(done))
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert done.done()  # the caller was let go only once the commit was over
    assert log.row("m1") == b"row"
    await commits.close()
