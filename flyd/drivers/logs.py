"""Machine output: the `machine.log` in each run dir (both drivers).

A machine's stdout and stderr go to one `machine.log` opened O_APPEND, so a machine never blocks
on flyd. flyd bounds it by copy-truncate rotation, keeping a set number of older copies
(`machine.log.1`, `.2`, ...); this module rotates it, reads its tail across the rotated files,
and follows it as it grows.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import structlog

__all__ = ["LOG_NAME", "MachineLogs", "open_output"]

log = structlog.get_logger(__name__)

LOG_NAME = "machine.log"
_FOLLOW_MAX_READ = 1 << 20
_FOLLOW_MAX_LINE = 64 << 10


@dataclass(frozen=True)
class _Rotation:
    """The last rotation of a log: machine.log.1 holds bytes [copied_from, copied_to) of it."""

    generation: int
    copied_from: int
    copied_to: int


_NO_ROTATION = _Rotation(0, 0, 0)


@dataclass
class _LogCursor:
    """Where a follower is: an offset in the log as of rotation `generation`."""

    path: Path
    offset: int
    generation: int


def open_output(run_dir: Path) -> int:
    """A file descriptor for the machine's stdout and stderr: its log, opened for appending."""
    return os.open(
        run_dir / LOG_NAME,
        os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW,
        0o640,
    )


class MachineLogs:
    """The logs of the machines under one run root, each kept to `max_bytes` plus `backups`.

    It remembers the last rotation of each log it rotated, so a follower can catch up from
    `machine.log.1`. Arguments are checked by the caller.
    """

    def __init__(
        self, *, max_bytes: int, backups: int, sleep: Callable[[float], Awaitable[None]]
    ) -> None:
        self._max_bytes = max_bytes
        self._backups = backups
        self._sleep = sleep
        # The last rotation of each log, so followers can catch up from machine.log.1.
        self._rotations: dict[Path, _Rotation] = {}

    def rotate_all(self, run_root: Path) -> None:
        """Copy-truncate every machine log under `run_root` larger than `max_bytes`.

        The log moves to `machine.log.1` (at most its last `max_bytes`, from a line start),
        older copies shift up to `backups`. Lines a machine writes between the copy and the
        truncate are lost, the usual price of copy-truncate; machines never notice rotation.
        """
        try:
            run_dirs = list(run_root.iterdir())
        except FileNotFoundError:
            return
        for run_dir in run_dirs:
            if run_dir.name.startswith("."):  # spares
                continue
            try:
                self._rotate(run_dir / LOG_NAME)
            except OSError as e:
                log.warning("log_rotation_failed", path=str(run_dir / LOG_NAME), error=str(e))

    def read(self, run_dir: Path, tail_lines: int) -> list[str]:
        """The last `tail_lines` lines of the machine's output, across rotated files."""
        if tail_lines == 0:
            return []
        base = run_dir / LOG_NAME
        newest_first = [base] + [Path(f"{base}.{k}") for k in range(1, self._backups + 1)]
        chunks: list[bytes] = []  # newest last once reversed
        newlines = 0
        for path in newest_first:
            try:
                with open(path, "rb") as f:
                    end = f.seek(0, os.SEEK_END)
                    while end > 0 and newlines <= tail_lines:
                        start = max(0, end - 65536)
                        f.seek(start)
                        chunk = f.read(end - start)
                        chunks.append(chunk)
                        newlines += chunk.count(b"\n")
                        end = start
            except FileNotFoundError:
                continue
            if newlines > tail_lines:
                break
        data = b"".join(reversed(chunks))
        lines = data.split(b"\n")
        if lines and lines[-1] == b"":
            lines.pop()
        return [line.decode("utf-8", "replace") for line in lines[-tail_lines:]]

    def follow(
        self,
        run_dir: Path,
        *,
        shutdown: asyncio.Event,
        poll_interval: float,
        from_offset: int | None,
    ) -> AsyncIterator[str]:
        """Yield the machine's output lines as they are written, until `shutdown` is set.

        Starts at `from_offset` in the current `machine.log` (None: its end, so only new
        lines) and polls every `poll_interval` seconds (on the injected sleep). Across a
        rotation by the same MachineLogs it picks up what it had not read yet from `machine.log.1`;
        after several rotations between two polls, or one by another driver, it goes on from
        the start of the truncated log, and lines in between are missed (as with `tail -F`).
        Ends when the run dir is removed.
        """
        path = run_dir / LOG_NAME
        if from_offset is None:
            try:
                from_offset = path.stat().st_size
            except FileNotFoundError:
                from_offset = 0
        cursor = _LogCursor(path, from_offset, self._rotations.get(path, _NO_ROTATION).generation)
        return self._follow(cursor, shutdown, poll_interval)

    def forget(self, run_dir: Path) -> None:
        """Drop what is known of the machine's log (its run dir is being removed)."""
        self._rotations.pop(run_dir / LOG_NAME, None)

    async def _follow(
        self, cursor: _LogCursor, shutdown: asyncio.Event, poll_interval: float
    ) -> AsyncIterator[str]:
        pending = b""
        while not shutdown.is_set():
            chunk = self._read_more(cursor)
            if chunk is None:
                return  # the machine was cleaned up
            data, gap = chunk
            if gap and pending:  # the rest of that line is lost: do not glue it to another
                yield pending.decode("utf-8", "replace")
                pending = b""
            pending += data
            *lines, pending = pending.split(b"\n")
            if len(pending) > _FOLLOW_MAX_LINE:  # no newline in sight: do not buffer forever
                lines.append(pending)
                pending = b""
            for line in lines:
                yield line.decode("utf-8", "replace")
            if len(data) < _FOLLOW_MAX_READ:
                await self._sleep(poll_interval)

    def _read_more(self, cursor: _LogCursor) -> tuple[bytes, bool] | None:
        """New bytes of the log after `cursor` (which it advances) and whether some were lost.

        None when the run dir is gone.
        """
        data, gap = b"", False
        rotation = self._rotations.get(cursor.path, _NO_ROTATION)
        if rotation.generation != cursor.generation:
            recoverable = (
                rotation.generation == cursor.generation + 1
                and rotation.copied_to > 0  # zero: no backups kept
                and rotation.copied_from <= cursor.offset <= rotation.copied_to
            )
            if recoverable:
                data = _read_range(
                    Path(f"{cursor.path}.1"),
                    cursor.offset - rotation.copied_from,
                    rotation.copied_to - rotation.copied_from,
                )
            gap = not recoverable
            cursor.generation, cursor.offset = rotation.generation, 0
        try:
            with open(cursor.path, "rb") as f:
                size = f.seek(0, os.SEEK_END)
                if size < cursor.offset:  # truncated by someone else
                    gap, cursor.offset = True, 0
                f.seek(cursor.offset)
                more = f.read(min(size - cursor.offset, _FOLLOW_MAX_READ))
        except FileNotFoundError:
            if not cursor.path.parent.exists():
                return None
            more = b""
        cursor.offset += len(more)
        return data + more, gap

    def _rotate(self, log_path: Path) -> None:
        try:
            st = os.lstat(log_path)
        except FileNotFoundError:
            return
        if not stat.S_ISREG(st.st_mode) or st.st_size <= self._max_bytes:
            return
        copied_from = copied_to = 0
        if self._backups > 0:
            for k in range(self._backups, 1, -1):
                with contextlib.suppress(FileNotFoundError):
                    os.replace(f"{log_path}.{k - 1}", f"{log_path}.{k}")
            tmp = Path(f"{log_path}.1.tmp")
            with open(log_path, "rb") as src, open(tmp, "wb") as dst:
                copied_to = src.seek(0, os.SEEK_END)
                copied_from = max(0, copied_to - self._max_bytes)
                if copied_from > 0:
                    # Start at a line start: read one byte early, drop up to the first newline.
                    src.seek(copied_from - 1)
                    data = src.read(copied_to - copied_from + 1)
                    cut = data.find(b"\n") + 1 or len(data)
                    data, copied_from = data[cut:], copied_from - 1 + cut
                else:
                    src.seek(0)
                    data = src.read(copied_to)
                dst.write(data)
            os.replace(tmp, f"{log_path}.1")
        os.truncate(log_path, 0)
        generation = self._rotations.get(log_path, _NO_ROTATION).generation + 1
        self._rotations[log_path] = _Rotation(generation, copied_from, copied_to)


def _read_range(path: Path, start: int, end: int) -> bytes:
    try:
        with open(path, "rb") as f:
            f.seek(start)
            return f.read(max(0, end - start))
    except FileNotFoundError:
        return b""
