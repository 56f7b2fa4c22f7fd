"""The machine log: flyd's durable record of every machine on this worker.

Two tables change together in one write transaction: an append-only log of
typed, versioned records (what followers stream) and the current row of each
machine (what recovery reads). The log is compacted from the front; a reader
asking for a position that is gone gets `Compacted` and resyncs from a
snapshot of the rows, read in the same transaction as the log's head.

`LmdbMachineLog` is the real store; `MemoryMachineLog` has the same contract
for unit tests, and one test suite runs against both.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import Protocol

import lmdb

from model.errors import CorruptLog
from runtime.entropy import SYSTEM, Entropy


class RecordType(IntEnum):
    """Record types of the log. Never renumber: old logs must keep meaning what they meant."""

    # Body: a serialized flyd.v1.MachineChange (the event and the row after it).
    MACHINE_CHANGE = 1


# The newest body version this flyd writes and understands, per record type.
RECORD_VERSIONS: dict[RecordType, int] = {RecordType.MACHINE_CHANGE: 1}

_HEADER = struct.Struct(">HH")


@dataclass(frozen=True, slots=True)
class Record:
    """One log record: its position, type, body version and body bytes."""

    seq: int
    type: RecordType
    version: int
    body: bytes


@dataclass(frozen=True, slots=True)
class NewRecord:
    """A record to append; the log assigns its sequence number."""

    type: RecordType
    body: bytes
    version: int = 0  # 0: the current version of the type

    def encode(self) -> bytes:
        version = self.version or RECORD_VERSIONS[self.type]
        return _HEADER.pack(int(self.type), version) + self.body


def decode_record(seq: int, raw: bytes) -> Record:
    """Decode a stored record, failing loudly on anything this flyd does not know."""
    if len(raw) < _HEADER.size:
        raise CorruptLog(f"log record {seq} is truncated ({len(raw)} bytes)")
    type_no, version = _HEADER.unpack_from(raw)
    try:
        rtype = RecordType(type_no)
    except ValueError:
        raise CorruptLog(f"log record {seq} has unknown type {type_no}") from None
    newest = RECORD_VERSIONS[rtype]
    if version < 1 or version > newest:
        raise CorruptLog(
            f"log record {seq} ({rtype.name}) has version {version}; this flyd reads 1..{newest}"
        )
    return Record(seq, rtype, version, raw[_HEADER.size :])


class Compacted(Exception):
    """The requested position was compacted away; resync from a snapshot."""

    def __init__(self, first_seq: int) -> None:
        super().__init__(f"log positions before {first_seq} were compacted")
        self.first_seq = first_seq


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Every current row and the log position they reflect, read consistently."""

    seq: int
    rows: dict[str, bytes]


class MachineLog(Protocol):
    """What flyd needs from its storage. Each call is atomic.

    `blocking`: whether a commit waits on a disk (fsync), so that flyd runs commits in a
    writer thread of their own (flyd.commits) rather than on its event loop.
    """

    blocking: bool

    def epoch(self) -> str:
        """Chosen when the log was created: tells this log from another (a wiped data dir)
        whose sequence numbers happen to overlap."""
        ...

    def last_seq(self) -> int:
        """Sequence number of the newest record (0 when empty)."""
        ...

    def first_seq(self) -> int:
        """Sequence number of the oldest record still kept (last_seq + 1 when none is)."""
        ...

    def commit(self, records: Iterable[NewRecord], rows: Mapping[str, bytes | None]) -> int:
        """Append records and put (or delete, for None) rows in one transaction.

        Returns the sequence number of the last record appended.
        """
        ...

    def row(self, machine_id: str) -> bytes | None: ...

    def rows(self) -> dict[str, bytes]: ...

    def read(self, after_seq: int, limit: int = 1000) -> list[Record]:
        """Records with seq > after_seq, oldest first; raises Compacted if some are gone."""
        ...

    def snapshot(self) -> Snapshot: ...

    def compact(self, keep: int) -> int:
        """Drop all but the newest `keep` records; returns how many were dropped."""
        ...

    def close(self) -> None: ...


def _check_contiguous(records: list[Record], after_seq: int) -> None:
    expected = after_seq + 1
    for rec in records:
        if rec.seq != expected:
            raise CorruptLog(f"log gap: expected record {expected}, found {rec.seq}")
        expected += 1


class MemoryMachineLog:
    """In-memory MachineLog with the LMDB store's semantics, for unit tests."""

    blocking = False

    def __init__(self, *, entropy: Entropy = SYSTEM) -> None:
        """`entropy`: where a new log's epoch comes from (runtime.entropy)."""
        self._epoch = entropy.token_hex(8)
        self._log: dict[int, bytes] = {}
        self._rows: dict[str, bytes] = {}
        self._first = 1
        self._last = 0

    def epoch(self) -> str:
        return self._epoch

    def last_seq(self) -> int:
        return self._last

    def first_seq(self) -> int:
        return self._first

    def commit(self, records: Iterable[NewRecord], rows: Mapping[str, bytes | None]) -> int:
        encoded = [r.encode() for r in records]
        for raw in encoded:
            self._last += 1
            self._log[self._last] = raw
        for key, value in rows.items():
            if value is None:
                self._rows.pop(key, None)
            else:
                self._rows[key] = value
        return self._last

    def row(self, machine_id: str) -> bytes | None:
        return self._rows.get(machine_id)

    def rows(self) -> dict[str, bytes]:
        return dict(self._rows)

    def read(self, after_seq: int, limit: int = 1000) -> list[Record]:
        if after_seq + 1 < self._first:
            raise Compacted(self._first)
        end = min(self._last, after_seq + limit)
        out = [decode_record(s, self._log[s]) for s in range(after_seq + 1, end + 1)]
        _check_contiguous(out, after_seq)
        return out

    def snapshot(self) -> Snapshot:
        return Snapshot(self._last, dict(self._rows))

    def compact(self, keep: int) -> int:
        cut = self._last - keep
        dropped = 0
        for seq in range(self._first, cut + 1):
            del self._log[seq]
            dropped += 1
        self._first = max(self._first, cut + 1)
        return dropped

    def close(self) -> None:
        pass


_U64 = struct.Struct(">Q")
_META_FIRST = b"first_seq"
_META_FORMAT = b"format"
_META_EPOCH = b"epoch"
_FORMAT = b"nonomad-flyd-log-1"


class LmdbMachineLog:
    """The machine log in an LMDB environment: synchronous, durable commits.

    Each commit is one transaction, fsynced before it returns: from a quarter of a millisecond
    to tens of milliseconds on a busy disk, so flyd commits from a writer thread, several
    operations' commits in one transaction (flyd.commits). Reads (their own read transactions)
    may run on any thread meanwhile.
    """

    blocking = True

    def __init__(self, path: Path, *, map_size: int = 1 << 30, entropy: Entropy = SYSTEM) -> None:
        """`entropy`: where a new log's epoch comes from (runtime.entropy)."""
        path.mkdir(parents=True, exist_ok=True)
        self._env = lmdb.open(str(path), map_size=map_size, max_dbs=4, subdir=True)
        self._log = self._env.open_db(b"log")
        self._rows = self._env.open_db(b"machines")
        self._meta = self._env.open_db(b"meta")
        with self._env.begin(write=True) as txn:
            fmt = txn.get(_META_FORMAT, db=self._meta)
            if fmt is None:
                txn.put(_META_FORMAT, _FORMAT, db=self._meta)
                txn.put(_META_FIRST, _U64.pack(1), db=self._meta)
            elif fmt != _FORMAT:
                raise CorruptLog(f"{path}: unknown store format {fmt!r}")
            epoch = txn.get(_META_EPOCH, db=self._meta)
            if epoch is None:  # a new log (or one from before epochs: it gets one now)
                epoch = entropy.token_hex(8).encode()
                txn.put(_META_EPOCH, epoch, db=self._meta)
            self._epoch = bytes(epoch).decode()
            self._last = self._read_last(txn)
            self._first = self._read_first(txn)
        if self._last and self._first > self._last + 1:
            raise CorruptLog(f"{path}: first_seq {self._first} is past last_seq {self._last}")

    def _read_last(self, txn: lmdb.Transaction) -> int:
        cursor = txn.cursor(db=self._log)
        if cursor.last():
            return int(_U64.unpack(cursor.key())[0])
        # An empty log after compaction still remembers where it was.
        first = txn.get(_META_FIRST, db=self._meta)
        return _U64.unpack(first)[0] - 1 if first else 0

    def _read_first(self, txn: lmdb.Transaction) -> int:
        raw = txn.get(_META_FIRST, db=self._meta)
        if raw is None:
            raise CorruptLog("machine log has no first_seq")
        return int(_U64.unpack(raw)[0])

    def epoch(self) -> str:
        return self._epoch

    def last_seq(self) -> int:
        return self._last

    def first_seq(self) -> int:
        return self._first

    def commit(self, records: Iterable[NewRecord], rows: Mapping[str, bytes | None]) -> int:
        seq = self._last
        with self._env.begin(write=True) as txn:
            for rec in records:
                seq += 1
                txn.put(_U64.pack(seq), rec.encode(), db=self._log, append=True)
            for key, value in rows.items():
                if value is None:
                    txn.delete(key.encode(), db=self._rows)
                else:
                    txn.put(key.encode(), value, db=self._rows)
        self._last = seq
        return seq

    def row(self, machine_id: str) -> bytes | None:
        with self._env.begin() as txn:
            value = txn.get(machine_id.encode(), db=self._rows)
        return bytes(value) if value is not None else None

    def rows(self) -> dict[str, bytes]:
        with self._env.begin() as txn:
            return self._all_rows(txn)

    def _all_rows(self, txn: lmdb.Transaction) -> dict[str, bytes]:
        return {bytes(k).decode(): bytes(v) for k, v in txn.cursor(db=self._rows)}

    def read(self, after_seq: int, limit: int = 1000) -> list[Record]:
        with self._env.begin() as txn:
            first = self._read_first(txn)
            if after_seq + 1 < first:
                raise Compacted(first)
            out: list[Record] = []
            cursor = txn.cursor(db=self._log)
            if cursor.set_range(_U64.pack(after_seq + 1)):
                for key, value in cursor:
                    out.append(decode_record(_U64.unpack(key)[0], bytes(value)))
                    if len(out) >= limit:
                        break
        _check_contiguous(out, after_seq)
        return out

    def snapshot(self) -> Snapshot:
        with self._env.begin() as txn:
            return Snapshot(self._read_last(txn), self._all_rows(txn))

    def compact(self, keep: int) -> int:
        cut = self._last - keep
        if cut < self._first:
            return 0
        dropped = 0
        with self._env.begin(write=True) as txn:
            cursor = txn.cursor(db=self._log)
            while cursor.first() and _U64.unpack(cursor.key())[0] <= cut:
                cursor.delete()
                dropped += 1
            txn.put(_META_FIRST, _U64.pack(cut + 1), db=self._meta)
        self._first = cut + 1
        return dropped

    def iter_all(self) -> Iterator[Record]:
        """Every kept record, oldest first (for tools and tests)."""
        after = self._first - 1
        while batch := self.read(after):
            yield from batch
            after = batch[-1].seq

    def close(self) -> None:
        self._env.close()
