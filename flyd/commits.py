"""Group commit: the machine log's writes, off the event loop, one transaction per batch.

A commit is durable once its transaction's fsync returned; on this host that takes from a
quarter of a millisecond to tens of milliseconds, and flyd's event loop must not stand still
meanwhile. So every write of the log goes through one `GroupCommit`: a commit is queued with
the sequence numbers it will have (handed out at once, in order), and one writer thread
writes what is queued in one transaction, with one fsync, while the loop goes on serving.
Commits queued while a transaction is written go together in the next one.

Nothing is told of a commit before its fsync: `then(last_seq)` (the runner's bookkeeping:
the rows in memory, the event stream, the operation's span) runs on the loop once the batch
holding it is durable, for each commit of the batch in order, and only then is its future
done, so a caller's answer is never sent before the fsync that holds it. A batch whose
transaction failed fails every commit queued so far (their numbers followed the failed ones),
and none of them is told anything but the error.

A store whose commits do not wait on a disk (`MachineLog.blocking` False: the in-memory log
of the unit tests) is written on the loop, in the same batches. A simulated disk (sim.disk)
brings a `Writer` of its own, which syncs each batch on the loop after a time it draws.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import queue
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from flyd.metrics import LOG_TRANSACTION_COMMITS
from flyd.store import MachineLog, NewRecord

T = TypeVar("T")
# What the writer is asked: a call, its arguments, and what the loop runs with its outcome.
Then = Callable[[Any, BaseException | None], None]
_Call = tuple[Callable[..., Any], tuple[Any, ...], asyncio.AbstractEventLoop, Then]


class Writer(Protocol):
    """Who writes a blocking store's transactions, one after another, off the loop's turn."""

    def call(self, fn: Callable[..., Any], args: tuple[Any, ...], then: Then) -> None:
        """`fn(*args)`, later; then `then(result, None)` or `then(None, error)` on the loop
        that called."""
        ...

    def stop(self) -> None:
        """Let the calls queued finish, then stop."""
        ...


@dataclass(slots=True)
class _Commit:
    records: Sequence[NewRecord]
    rows: Mapping[str, bytes | None]
    last_seq: int  # of its last record (the log's last seq before it, without records)
    then: Callable[[int], None] | None
    done: asyncio.Future[int] = field(repr=False)


class GroupCommit:
    """The one writer of a machine log: batches of commits, each batch one transaction."""

    def __init__(self, store: MachineLog, writer: Writer | None = None) -> None:
        """`writer`: who writes a blocking store's batches (default: a thread of its own)."""
        self.store = store
        self._assigned = store.last_seq()
        self._queue: list[_Commit] = []
        self._busy = False  # a batch is being written, or one is about to start
        self._writer: Writer | None = None
        if store.blocking:
            self._writer = writer if writer is not None else _Writer()
        self._closed = False
        self._idle: asyncio.Event | None = None
        self._waiting = 0  # calls of `run` waiting for the writer
        self.batches = 0  # transactions written, for tests and metrics

    @property
    def queued(self) -> int:
        """Commits waiting for the next transaction."""
        return len(self._queue)

    @property
    def assigned(self) -> int:
        """The sequence number of the last record queued (durable or not)."""
        return self._assigned

    def submit(
        self,
        records: Sequence[NewRecord],
        rows: Mapping[str, bytes | None],
        then: Callable[[int], None] | None = None,
    ) -> asyncio.Future[int]:
        """Queue records (numbered from `assigned` + 1, in this order) and rows to put (or
        delete, for None). The future is done with the seq of the last record once they are
        durable and `then` ran, or fails with the transaction's error."""
        if self._closed:
            raise RuntimeError("the machine log's writer is closed")
        loop = asyncio.get_running_loop()
        self._assigned += len(records)
        commit = _Commit(records, rows, self._assigned, then, loop.create_future())
        self._queue.append(commit)
        if not self._busy and not self._waiting:
            # Not at once: commits made in this turn of the loop join the same transaction.
            self._busy = True
            loop.call_soon(self._write_next)
        return commit.done

    def commit_now(self, records: Sequence[NewRecord], rows: Mapping[str, bytes | None]) -> int:
        """Write one commit at once, on the caller's thread: for recovery at start, before
        anything else commits. Returns the seq of its last record."""
        if self._busy or self._queue:
            raise RuntimeError("commit_now while commits are queued")
        seq = self.store.commit(records, rows)
        self._assigned = seq
        return seq

    async def run(self, work: Callable[[MachineLog], T]) -> T:
        """`work(store)` on the writer once the batch being written is (compaction); commits
        queued meanwhile wait for it."""
        self._waiting += 1
        try:
            while self._busy:
                await self._wait_idle()
        except BaseException:
            self._waiting -= 1
            self._next_or_idle()
            raise
        self._waiting -= 1
        self._busy = True
        try:
            if self._writer is None:
                return work(self.store)
            done: asyncio.Future[T] = asyncio.get_running_loop().create_future()
            self._writer.call(work, (self.store,), functools.partial(_settle, done))
            return await done
        finally:
            self._busy = False
            self._next_or_idle()

    async def close(self) -> None:
        """Refuse new commits, wait for the queued ones, and stop the writer thread."""
        self._closed = True
        while self._busy:
            await self._wait_idle()
        if self._writer is not None:
            self._writer.stop()

    async def _wait_idle(self) -> None:
        if self._idle is None:
            self._idle = asyncio.Event()
        await self._idle.wait()

    def _write_next(self) -> None:
        batch, self._queue = self._queue, []
        if not batch:
            self._busy = False
            self._next_or_idle()
            return
        records = [r for c in batch for r in c.records]
        rows: dict[str, bytes | None] = {}
        for c in batch:
            rows.update(c.rows)  # a later commit's row wins
        self.batches += 1
        LOG_TRANSACTION_COMMITS.observe(len(batch))
        if self._writer is None:
            loop = asyncio.get_running_loop()
            try:
                seq = self.store.commit(records, rows)
            except BaseException as err:  # every waiter hears of it
                loop.call_soon(self._written, batch, 0, err)
            else:
                loop.call_soon(self._written, batch, seq, None)
        else:
            self._writer.call(
                self.store.commit, (records, rows), functools.partial(self._written, batch)
            )

    def _written(self, batch: list[_Commit], seq: int, error: BaseException | None) -> None:
        try:
            if error is not None:
                # Numbers were handed out past the failed ones: whatever is queued fails
                # too. Its committers hear of it first: a store whose reads fail as well (a
                # closed or broken one) must not leave them, or close(), waiting for ever.
                failed, self._queue = batch + self._queue, []
                for c in failed:
                    if not c.done.done():
                        c.done.set_exception(error)
                self._assigned = self.store.last_seq()
            else:
                for c in batch:
                    try:
                        if c.then is not None:
                            c.then(c.last_seq)
                    except BaseException as err:  # its committer hears of it
                        c.done.set_exception(err)
                    else:
                        c.done.set_result(c.last_seq)
        finally:
            self._busy = False
            self._next_or_idle()

    def _next_or_idle(self) -> None:
        if self._busy:
            return
        if self._queue and not self._waiting:
            self._busy = True
            self._write_next()
        elif self._idle is not None:
            self._idle.set()
            self._idle = None


class _Writer:
    """The writer thread: runs calls in order, off the loop, and hands each outcome back to
    the loop that asked (a queue and `call_soon_threadsafe`: less than an executor's futures,
    chained from one loop to the other, costs for every transaction)."""

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        # A daemon: at exit, a transaction cut short is one that never committed, as when
        # flyd is killed (nothing was told of it yet).
        self._thread = threading.Thread(target=self._serve, name="flyd-commit", daemon=True)

    def call(self, fn: Callable[..., Any], args: tuple[Any, ...], then: Then) -> None:
        """`fn(*args)` on the writer; then `then(result, None)` or `then(None, error)` on the
        calling loop."""
        self._calls.put((fn, args, asyncio.get_running_loop(), then))
        if not self._thread.is_alive():  # (started on first use, as an executor's would be)
            self._thread.start()

    def stop(self) -> None:
        """Let the calls queued finish, then end the thread."""
        if self._thread.is_alive():
            self._calls.put(None)
            self._thread.join()

    def _serve(self) -> None:
        while (item := self._calls.get()) is not None:
            fn, args, loop, then = item
            try:
                result, error = fn(*args), None
            except BaseException as err:  # the caller hears of it
                result, error = None, err
            with contextlib.suppress(RuntimeError):  # (its loop is closed: nobody waits)
                loop.call_soon_threadsafe(then, result, error)


def _settle(future: asyncio.Future[T], result: T, error: BaseException | None) -> None:
    if future.done():  # (its waiter was cancelled)
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


async def durable(future: asyncio.Future[T]) -> T:
    """Wait for a commit, even when the caller is cancelled meanwhile: the commit goes on, and
    whoever holds a machine's lock must not let go of it before the row in memory is what the
    log says. The cancellation is raised once the commit is over."""
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        while not future.done():
            with contextlib.suppress(BaseException):
                await asyncio.shield(future)
        raise
