"""One suite for both machine log backends, plus what only LMDB can show (reopening)."""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import lmdb
import pytest

from flyd.store import (
    Compacted,
    LmdbMachineLog,
    MachineLog,
    MemoryMachineLog,
    NewRecord,
    RecordType,
)
from model.errors import CorruptLog

Factory = Callable[[], MachineLog]


@pytest.fixture(params=["memory", "lmdb"])
def open_log(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Factory]:
    """Returns a function that opens the log; for LMDB each call reopens the same files."""
    opened: list[MachineLog] = []
    memory = MemoryMachineLog()

    def factory() -> MachineLog:
        if request.param == "memory":
            return memory
        for log in opened:
            log.close()
        opened.clear()
        log = LmdbMachineLog(tmp_path / "db")
        opened.append(log)
        return log

    yield factory
    for log in opened:
        log.close()


def change(body: bytes) -> NewRecord:
    return NewRecord(RecordType.MACHINE_CHANGE, body)


def test_empty_log(open_log: Factory) -> None:
    log = open_log()
    assert (log.last_seq(), log.first_seq()) == (0, 1)
    assert log.read(0) == []
    assert log.rows() == {}
    assert log.snapshot().seq == 0


def test_commit_appends_records_and_rows_together(open_log: Factory) -> None:
    log = open_log()
    assert log.commit([change(b"a"), change(b"b")], {"m1": b"row1"}) == 2
    assert log.commit([change(b"c")], {"m1": b"row1'", "m2": b"row2"}) == 3
    records = log.read(0)
    assert [(r.seq, r.body, r.version) for r in records] == [
        (1, b"a", 1),
        (2, b"b", 1),
        (3, b"c", 1),
    ]
    assert log.read(2) == records[2:]
    assert log.row("m1") == b"row1'"
    assert log.rows() == {"m1": b"row1'", "m2": b"row2"}


def test_none_deletes_a_row(open_log: Factory) -> None:
    log = open_log()
    log.commit([change(b"a")], {"m1": b"x", "m2": b"y"})
    log.commit([change(b"b")], {"m1": None})
    assert log.rows() == {"m2": b"y"}
    assert log.row("m1") is None


def test_read_is_limited_and_resumable(open_log: Factory) -> None:
    log = open_log()
    for i in range(10):
        log.commit([change(bytes([i]))], {})
    first = log.read(0, limit=4)
    assert [r.seq for r in first] == [1, 2, 3, 4]
    assert [r.seq for r in log.read(first[-1].seq, limit=100)] == list(range(5, 11))


def test_compaction_sends_old_readers_to_the_snapshot(open_log: Factory) -> None:
    log = open_log()
    for i in range(10):
        log.commit([change(bytes([i]))], {f"m{i % 3}": bytes([i])})
    assert log.compact(keep=4) == 6
    assert log.first_seq() == 7
    assert [r.seq for r in log.read(6)] == [7, 8, 9, 10]
    with pytest.raises(Compacted) as err:
        log.read(5)
    assert err.value.first_seq == 7
    snap = log.snapshot()
    assert snap.seq == 10
    assert snap.rows == {"m0": bytes([9]), "m1": bytes([7]), "m2": bytes([8])}
    # Appending after compaction continues the numbering.
    assert log.commit([change(b"z")], {}) == 11


def test_compacting_everything_keeps_the_position(open_log: Factory) -> None:
    log = open_log()
    for i in range(3):
        log.commit([change(bytes([i]))], {})
    log.compact(keep=0)
    log = open_log()
    assert (log.first_seq(), log.last_seq()) == (4, 3)
    assert log.read(3) == []
    assert log.commit([change(b"d")], {}) == 4


def test_compacting_more_than_held_is_a_no_op(open_log: Factory) -> None:
    log = open_log()
    log.commit([change(b"a")], {})
    assert log.compact(keep=100) == 0
    assert log.first_seq() == 1


def test_state_survives_reopen(open_log: Factory) -> None:
    log = open_log()
    log.commit([change(b"a"), change(b"b")], {"m1": b"row"})
    log.compact(keep=1)
    log = open_log()
    assert (log.first_seq(), log.last_seq()) == (2, 2)
    assert log.row("m1") == b"row"
    assert [r.body for r in log.read(1)] == [b"b"]


def test_the_epoch_is_the_logs_own_and_survives_reopen(open_log: Factory, tmp_path: Path) -> None:
    epoch = open_log().epoch()
    assert len(epoch) == 16
    assert open_log().epoch() == epoch
    assert MemoryMachineLog().epoch() != epoch  # another log (a wiped data dir): another epoch
    other = LmdbMachineLog(tmp_path / "wiped")
    assert other.epoch() != epoch
    other.close()


# --- what only the LMDB store can show: foreign or damaged records on disk ---


def _poke(path: Path, seq: int, raw: bytes) -> None:
    env = lmdb.open(str(path), max_dbs=4)
    db = env.open_db(b"log")  # outside the write txn: opening inside it would deadlock
    with env.begin(write=True) as txn:
        txn.put(struct.pack(">Q", seq), raw, db=db)
    env.close()


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (struct.pack(">HH", 99, 1) + b"x", "unknown type 99"),
        (struct.pack(">HH", 1, 2) + b"x", "version 2"),
        (struct.pack(">HH", 1, 0) + b"x", "version 0"),
        (b"\x00", "truncated"),
    ],
)
def test_unknown_records_are_loud_errors(tmp_path: Path, raw: bytes, message: str) -> None:
    log = LmdbMachineLog(tmp_path / "db")
    log.commit([change(b"a")], {})
    log.close()
    _poke(tmp_path / "db", 2, raw)
    log = LmdbMachineLog(tmp_path / "db")
    with pytest.raises(CorruptLog, match=message):
        log.read(0)
    log.close()


def test_a_gap_in_the_log_is_a_loud_error(tmp_path: Path) -> None:
    log = LmdbMachineLog(tmp_path / "db")
    log.commit([change(b"a")], {})
    log.close()
    _poke(tmp_path / "db", 3, NewRecord(RecordType.MACHINE_CHANGE, b"c").encode())
    log = LmdbMachineLog(tmp_path / "db")
    with pytest.raises(CorruptLog, match="expected record 2, found 3"):
        log.read(0)
    log.close()


def test_a_foreign_store_is_refused(tmp_path: Path) -> None:
    env = lmdb.open(str(tmp_path / "db"), max_dbs=4)
    meta = env.open_db(b"meta")
    with env.begin(write=True) as txn:
        txn.put(b"format", b"something-else", db=meta)
    env.close()
    with pytest.raises(CorruptLog, match="unknown store format"):
        LmdbMachineLog(tmp_path / "db")
