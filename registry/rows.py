"""How the replica keeps machine rows, and finds them: by id, by app in id order, by key.

A `Row` is a machine as the bytes its worker sent (without the event and log tails: reads of
those go to the worker), with the few fields the view reads without parsing it. The view keeps
each worker's rows; `RowIndex` knows, over all workers, which worker holds each machine id, the
ids of each app (and of all apps) in order, and which machine an app's idempotency key made.

Every structure here is cut in parts no larger than a few thousand entries (the id-keyed dicts
in `SHARDS` shards, the ordered ids in `registry.sortedkeys` blocks), so no insert or delete,
and no resize, holds the loop for long however large the fleet grows: a dict of 200,000 ids
that doubles copies them all at once (15 ms here).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import NamedTuple, TypeAlias

from flyd.v1 import machine_pb2 as pb
from registry.sortedkeys import SortedKeys

__all__ = ["Kept", "MachineQuery", "Row", "RowIndex", "key_hash"]

SHARDS = 64


class Row(NamedTuple):
    """A machine row as the replica keeps it."""

    app: str
    state: int
    key: int
    """`key_hash` of its app and idempotency key; 0 without a key."""
    data: bytes
    """The machine, serialized, without `events` and `log_tail`."""

    def machine(self) -> pb.Machine:
        return pb.Machine.FromString(self.data)


# Rows are kept as plain tuples laid out as `Row`: a tuple of strings, ints and bytes is
# untracked by the garbage collector, and a full collection over 200,000 tracked rows would
# hold the loop for a tenth of a second or more.
Kept: TypeAlias = tuple[str, int, int, bytes]


@dataclass(frozen=True)
class MachineQuery:
    """A page of machines in id order: of `app` (None: every app), on the workers of `region`
    (None: anywhere), after the id `after`, at most `size` of them, those `keep(machine_id,
    app, state)` takes (read from the kept row, without parsing it)."""

    app: str | None
    region: str | None
    after: str
    size: int
    keep: Callable[[str, str, int], bool]


def key_hash(app: str, key: str) -> int:
    """A row's idempotency key as a small int (rows are found by it; a hit is checked)."""
    digest = hashlib.blake2b(f"{app}\0{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") | 1  # never 0, which means "no key"


class RowIndex:
    """Which worker holds each machine id; the ids of each app in order; machines by key.

    A machine id two workers claim (a conflict, which the view logs) is held by the latest;
    two rows under one key likewise, and the other holds the key again should the latest go.
    """

    def __init__(self) -> None:
        # (Dicts of strings and ints, not sets of objects: the garbage collector skips them.)
        self._owner: list[dict[str, str]] = [{} for _ in range(SHARDS)]
        self._by_key: list[dict[int, str]] = [{} for _ in range(SHARDS)]
        self._key_shadowed: dict[int, list[str]] = {}
        self._all = SortedKeys()
        self._by_app: dict[str, SortedKeys] = {}

    def owner(self, machine_id: str) -> str | None:
        return self._owner[hash(machine_id) % SHARDS].get(machine_id)

    def set_owner(self, machine_id: str, worker_id: str | None) -> None:
        shard = self._owner[hash(machine_id) % SHARDS]
        if worker_id is None:
            shard.pop(machine_id, None)
        else:
            shard[machine_id] = worker_id

    def by_key(self, key: int) -> str | None:
        """The machine holding a `key_hash`, if any."""
        return self._by_key[key % SHARDS].get(key)

    def ids(self, app: str | None) -> SortedKeys | None:
        """The machine ids of `app` (None: of every app) in order; None when it has none."""
        return self._all if app is None else self._by_app.get(app)

    def apps(self) -> Iterator[str]:
        return iter(self._by_app)

    def file(self, machine_id: str, row: Row) -> None:
        """Index the row the machine's owner holds."""
        self._all.add(machine_id)
        self._file(machine_id, row)

    def refile(self, machine_id: str, old: Row, row: Row) -> None:
        """The owner's row changed from `old` to `row` (most often only its state)."""
        if (old.app, old.key) != (row.app, row.key):
            self._unfile(machine_id, old)
            self._file(machine_id, row)

    def unfile(self, machine_id: str, row: Row) -> None:
        """Undo `file` for the row (it goes, or another worker's row takes its id)."""
        self._all.discard(machine_id)
        self._unfile(machine_id, row)

    def _file(self, machine_id: str, row: Row) -> None:
        ids = self._by_app.get(row.app)
        if ids is None:
            ids = self._by_app[row.app] = SortedKeys()
        ids.add(machine_id)
        if row.key:
            keys = self._by_key[row.key % SHARDS]
            held = keys.get(row.key)
            if held is not None and held != machine_id:
                self._key_shadowed.setdefault(row.key, []).append(held)
            keys[row.key] = machine_id

    def _unfile(self, machine_id: str, row: Row) -> None:
        ids = self._by_app.get(row.app)
        if ids is not None:
            ids.discard(machine_id)
            if not ids:
                del self._by_app[row.app]
        if not row.key:
            return
        keys = self._by_key[row.key % SHARDS]
        shadowed = self._key_shadowed.get(row.key)
        if keys.get(row.key) == machine_id:
            if shadowed:
                keys[row.key] = shadowed.pop()
            else:
                del keys[row.key]
        elif shadowed is not None and machine_id in shadowed:
            shadowed.remove(machine_id)
        if shadowed is not None and not shadowed:
            del self._key_shadowed[row.key]
