"""Machine output: the `machine.log` in each run dir (both drivers), who writes it, and reading
it back within bounds.

Who writes it. A machine's stdout and stderr are the write end of a pipe, never the log file.
Whoever holds a file's descriptor can `ftruncate` it to 4 TiB, `fallocate` the disk full, or
clear O_APPEND (fcntl) and write far past the end; on a pipe each of those fails (EINVAL,
ESPIPE). The pipe's read end is the machine's *copier*'s: a small `/bin/sh` loop (`_COPIER`)
flyd starts beside the machine's wrapper, as flyd's user, in a session of its own, that appends
what comes through the pipe to `machine.log` with `head -c`, never past `max_bytes`, and then
rotates by rename (`machine.log` -> `.1` -> ... -> `.<backups>`, the oldest dropped). So what a
machine's output takes on disk is at most `max_bytes * (backups + 1)`, whatever the machine
does to its descriptors; rotation loses no line (no copy-truncate); and the machine never
waits on flyd: the copier, like the wrapper, outlives a flyd that dies. A machine that writes
faster than its copier appends waits on its own pipe, as under any container runtime.

Why not another way: flyd reading every pipe itself would put all machines' output through
its event loop and leave machines blocked on a full pipe whenever flyd is down or restarting;
RLIMIT_FSIZE bounds every file the machine writes, not only its log; a filesystem of its own
per log is a mount per machine. A copier costs a `sh` and a `head` per running machine (a few
hundred KiB of private memory, no Python), charged to flyd's cgroup, not the machine's.

flyd knows its copier by handle (`log.json` in the run dir, as the wrapper is known by
`handle.json`): when a machine ends, the driver reports its exit only once the copier has
written everything the machine printed (see `flyd.drivers.wrapped`), also after a restart.

Reading. A tail read holds at most `max_bytes` of the log however large it is (a sparse 4 TiB
file, newline-free output: a log written by a machine of an older flyd, which held the file
itself): it reads backwards from the end in chunks until it has the lines asked for or the
budget is spent, then says how many bytes before its first line it left out
(`LogTail.truncated_bytes`); each line is cut at `max_line` bytes. Reads block: callers run
them off the event loop. `follow` polls with a stat on the loop and reads new bytes in a
thread, a bounded amount at a time, across rotations (it knows the file it reads by inode).
Only non-regular files are refused: a log that is a FIFO or a device would hang a read.
`rotate_all` is a safety net for logs a copier does not write (a machine of an older flyd):
copy-truncate, bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import stat
import subprocess
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import structlog

from flyd.drivers.base import Handle, LogTail
from flyd.drivers.procfs import open_pidfd, read_proc_stat
from model.errors import CorruptLog

__all__ = [
    "COPIER_HANDLE",
    "LOG_NAME",
    "MAX_LINE",
    "Copier",
    "LogTail",
    "MachineLogs",
    "find_copier",
    "kill_copier",
    "read_tail",
    "start_copier",
]

log = structlog.get_logger(__name__)

LOG_NAME = "machine.log"
MAX_LINE = 64 << 10
"""The longest line a read returns: a longer one (or output without newlines) is cut here."""
COPIER_HANDLE = "log.json"
_CHUNK = 64 << 10
_FOLLOW_MAX_READ = 1 << 20
_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"

# $1: the most bytes of a file, $2: how many rotated files to keep, $3: machine.log's size now.
# It runs in the run dir with the machine's output pipe as stdin. `head -c N` reads no more
# than N bytes, and stops short of N only at end of file: then every writer of the pipe (the
# machine, its wrapper, anything they left) is gone, and so is the copier. head writes through
# stdio: unbuffered (`stdbuf -o0`), each read is in the file at once. It cannot open the
# log (the run dir is gone): it exits, and the machine's next write fails (EPIPE). It cannot
# write (the disk is full): what head read is lost, and it goes on a second later.
_COPIER = """\
max=$1 keep=$2 n=$3
umask 027
size() { if [ -e machine.log ]; then wc -c < machine.log; else echo 0; fi; }
while :; do
  if [ "$n" -ge "$max" ]; then
    k=$keep
    while [ "$k" -gt 1 ]; do
      mv -f "machine.log.$((k - 1))" "machine.log.$k" 2>/dev/null
      k=$((k - 1))
    done
    if [ "$keep" -gt 0 ]; then mv -f machine.log machine.log.1 || : > machine.log
    else : > machine.log; fi
    n=$(size)
    [ "$n" -lt "$max" ] || exit 1
  fi
  exec 3>> machine.log
  stdbuf -o0 head -c "$((max - n))" >&3
  ok=$?
  exec 3>&-
  m=$(size)
  if [ "$ok" -eq 0 ] && [ "$m" -lt "$max" ]; then exit 0; fi
  [ "$ok" -eq 0 ] || sleep 1
  n=$m
done
"""

# Copiers of this process no longer watched (a failed start, a closed driver): reaped on the
# next start. OCI starts copiers in a thread, hence the lock.
_unreaped: list[subprocess.Popen[bytes]] = []
_unreaped_lock = threading.Lock()


@dataclass(eq=False)
class Copier:
    """A machine's copier process: `pidfd` readable once it has exited."""

    handle: Handle
    pidfd: int
    popen: subprocess.Popen[bytes] | None  # None when found again after a flyd restart

    def close(self) -> None:
        """Stop watching it (it runs on, and is reaped later if it is our child)."""
        os.close(self.pidfd)
        if self.popen is not None and self.popen.poll() is None:
            with _unreaped_lock:
                _unreaped.append(self.popen)


def start_copier(
    run_dir: Path, *, max_bytes: int, backups: int, boot_id: str
) -> tuple[int, Copier]:
    """Start the machine's copier; returns the write end of its pipe (for the machine's stdout
    and stderr: the caller closes it once the machine has it) and the copier. Raises OSError.

    Blocking only for the fork/exec.
    """
    with _unreaped_lock:
        _unreaped[:] = [p for p in _unreaped if p.poll() is None]
    read_fd, write_fd = os.pipe2(os.O_CLOEXEC)
    try:
        size = _regular_size(run_dir / LOG_NAME)
        argv = ["/bin/sh", "-c", _COPIER, "nonomad-log", str(max_bytes), str(backups), str(size)]
        popen = subprocess.Popen(
            argv,
            stdin=read_fd,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            cwd=run_dir,
            env={"PATH": _PATH},
            start_new_session=True,  # a signal to the machine's process group never reaches it
        )
    except BaseException:
        os.close(write_fd)
        raise
    finally:
        os.close(read_fd)
    proc = read_proc_stat(popen.pid)
    assert proc is not None, "an unreaped child always has a /proc entry"
    handle = Handle(pid=popen.pid, start_time=proc.start_time, boot_id=boot_id)
    try:
        _write_handle(run_dir / COPIER_HANDLE, handle)
        pidfd = os.pidfd_open(popen.pid)
    except BaseException:
        os.close(write_fd)  # end of file: the copier exits
        with _unreaped_lock:
            _unreaped.append(popen)
        raise
    return write_fd, Copier(handle, pidfd, popen)


def find_copier(run_dir: Path, boot_id: str) -> Copier | None:
    """The machine's copier if it still runs (after a flyd restart), else None."""
    handle = _read_handle(run_dir / COPIER_HANDLE)
    pidfd = open_pidfd(handle, boot_id) if handle is not None else None
    if handle is None or pidfd is None:
        return None
    return Copier(handle, pidfd, popen=None)


def kill_copier(run_dir: Path, boot_id: str) -> None:
    """SIGKILL the machine's copier, if it runs (a worker torn down as a whole)."""
    copier = find_copier(run_dir, boot_id)
    if copier is not None:
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(copier.pidfd, signal.SIGKILL)
        os.close(copier.pidfd)


def read_tail(
    run_dir: Path, tail_lines: int, *, backups: int, max_bytes: int, max_line: int = MAX_LINE
) -> LogTail:
    """The last `tail_lines` lines of the log and its rotated files, reading at most
    `max_bytes` of them (see the module docstring). Blocking.
    """
    base = run_dir / LOG_NAME
    if tail_lines <= 0:
        st = _stat_regular(base)
        return LogTail([], follow_from=st.st_size if st is not None else 0)
    follow_from = 0  # the current log's size when it was read (none yet: a follow from 0)
    newest_first = [base] + [Path(f"{base}.{k}") for k in range(1, backups + 1)]
    chunks: list[bytes] = []  # newest first
    newlines = 0
    budget = max_bytes
    skipped = 0  # bytes before the chunks, once the budget is spent
    for path in newest_first:
        if newlines > tail_lines:
            break
        fd = _open_regular(path)
        if fd is None:
            continue
        try:
            end = os.fstat(fd).st_size
            if path == base:
                follow_from = end
            while end > 0 and newlines <= tail_lines and budget > 0:
                size = min(_CHUNK, end, budget)
                chunk = os.pread(fd, size, end - size)
                chunks.append(chunk)
                budget -= size
                newlines += chunk.count(b"\n")
                end -= size
                if len(chunk) < size:  # it shrank meanwhile (rotated): the rest is elsewhere
                    end = 0
            if newlines <= tail_lines:  # the budget ran out first
                skipped += end
        finally:
            os.close(fd)
    data = b"".join(reversed(chunks))
    del chunks
    # At most tail_lines + 2 pieces, whatever the data: the last is what follows the last
    # newline (b"" when the log ends with one), the first what precedes the lines asked for.
    pieces = data.rsplit(b"\n", tail_lines + 1)
    if pieces and pieces[-1] == b"":
        pieces.pop()
    if len(pieces) > tail_lines:
        pieces = pieces[len(pieces) - tail_lines :]
    elif skipped and len(pieces) > 1:
        # The budget cut the oldest line: it would show as a whole line, which it is not.
        skipped += len(pieces[0]) + 1
        pieces = pieces[1:]
    elif skipped and pieces:
        # Output without a newline in the whole budget: its newest part, the end of a line.
        skipped += max(0, len(pieces[0]) - max_line)
        pieces = [pieces[0][-max_line:]]
    lines = [p[:max_line].decode("utf-8", "replace") for p in pieces]
    return LogTail(lines, truncated_bytes=skipped, follow_from=follow_from)


@dataclass
class _Cursor:
    """Where a follower is: `offset` into the file of inode `inode` (None: none seen yet)."""

    path: Path
    inode: int | None
    offset: int


class MachineLogs:
    """The logs of the machines under one run root, each kept to `max_bytes` per file plus
    `backups` rotated files. Arguments are checked by the caller.
    """

    def __init__(
        self, *, max_bytes: int, backups: int, sleep: Callable[[float], Awaitable[None]]
    ) -> None:
        self.max_bytes = max_bytes
        self.backups = backups
        self._sleep = sleep

    def read(self, run_dir: Path, tail_lines: int, max_bytes: int) -> LogTail:
        """The last `tail_lines` lines of the machine's output (`read_tail`). Blocking."""
        return read_tail(run_dir, tail_lines, backups=self.backups, max_bytes=max_bytes)

    def rotate_all(self, run_root: Path) -> None:
        """Copy-truncate every log under `run_root` larger than `max_bytes` (the safety net
        for logs no copier writes). Blocking: flyd runs it in a thread.

        The log's last `max_bytes` (from a line start) move to `machine.log.1`, older copies
        shift up to `backups`. A copier's own logs never qualify.
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
        lines) and polls every `poll_interval` seconds (on the injected sleep). When the
        copier rotates the log it reads the rest of its file from `machine.log.1` first; after
        two rotations between polls, or a copy-truncate, it goes on from the start of the
        current log, and lines in between are missed (as with `tail -F`). Ends when the run
        dir is removed.
        """
        path = run_dir / LOG_NAME
        st = _stat_regular(path)
        inode = st.st_ino if st is not None else None
        if from_offset is None:
            from_offset = st.st_size if st is not None else 0
        return self._follow(_Cursor(path, inode, from_offset), shutdown, poll_interval)

    async def _follow(
        self, cursor: _Cursor, shutdown: asyncio.Event, poll_interval: float
    ) -> AsyncIterator[str]:
        pending = b""
        while not shutdown.is_set():
            # A stat on the loop; a thread only when there is something to read.
            st = _stat_regular(cursor.path)
            if st is None and cursor.inode is None:
                if not cursor.path.parent.exists():
                    return  # the machine was cleaned up
                await self._sleep(poll_interval)
                continue
            if st is not None and st.st_ino == cursor.inode and st.st_size == cursor.offset:
                await self._sleep(poll_interval)
                continue
            chunk = await asyncio.to_thread(_read_more, cursor, _FOLLOW_MAX_READ)
            if chunk is None:
                return  # the machine was cleaned up
            data, gap = chunk
            if gap and pending:  # the rest of that line is lost: do not glue it to another
                yield pending.decode("utf-8", "replace")
                pending = b""
            pending += data
            *lines, pending = pending.split(b"\n")
            if len(pending) > MAX_LINE:  # no newline in sight: do not buffer forever
                lines.append(pending)
                pending = b""
            for line in lines:
                yield line[:MAX_LINE].decode("utf-8", "replace")
            if len(data) < _FOLLOW_MAX_READ:
                await self._sleep(poll_interval)

    def _rotate(self, log_path: Path) -> None:
        try:
            st = os.lstat(log_path)
        except FileNotFoundError:
            return
        if not stat.S_ISREG(st.st_mode) or st.st_size <= self.max_bytes:
            return
        if (log_path.parent / COPIER_HANDLE).exists():
            # A copier writes it, and bounds it: truncating it under the copier would make the
            # copier take the shorter file for the end of its pipe.
            return
        if self.backups > 0:
            for k in range(self.backups, 1, -1):
                with contextlib.suppress(FileNotFoundError):
                    os.replace(f"{log_path}.{k - 1}", f"{log_path}.{k}")
            tmp = Path(f"{log_path}.1.tmp")
            fd = os.open(log_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                end = os.fstat(fd).st_size
                start = max(0, end - self.max_bytes)
                # Start at a line start: read one byte early, drop up to the first newline.
                data = os.pread(fd, end - start + 1, start - 1) if start else os.pread(fd, end, 0)
                if start:
                    data = data[data.find(b"\n") + 1 or len(data) :]
            finally:
                os.close(fd)
            tmp.write_bytes(data)
            os.replace(tmp, f"{log_path}.1")
        os.truncate(log_path, 0)


def _read_more(cursor: _Cursor, limit: int) -> tuple[bytes, bool] | None:
    """Up to `limit` new bytes of the log after `cursor` (which it advances), and whether some
    were lost. None when the run dir is gone. Blocking.
    """
    fd = _open_regular(cursor.path)
    if fd is None and not cursor.path.parent.exists():
        return None
    try:
        st = os.fstat(fd) if fd is not None else None
        data, gap = b"", False
        if cursor.inode is not None and (st is None or st.st_ino != cursor.inode):
            # Rotated: the rest of the file we were reading is machine.log.1, if it still is.
            rest = _rest_of(Path(f"{cursor.path}.1"), cursor, limit)
            if rest is None:
                gap = True
            elif len(rest) == limit:
                return rest, False  # more of it next time
            else:
                data = rest
            cursor.inode, cursor.offset = None, 0
        if fd is None or st is None:
            return data, gap  # between the copier's rename and its next write
        if cursor.inode is None:
            cursor.inode = st.st_ino
        elif st.st_size < cursor.offset:  # truncated in place (copy-truncate)
            gap, cursor.offset = True, 0
        more = os.pread(fd, limit - len(data), cursor.offset)
        cursor.offset += len(more)
        return data + more, gap
    finally:
        if fd is not None:
            os.close(fd)


def _rest_of(path: Path, cursor: _Cursor, limit: int) -> bytes | None:
    """Up to `limit` bytes of `path` from the cursor's offset if it is the cursor's file (by
    inode), advancing the cursor; None when it is not."""
    fd = _open_regular(path)
    if fd is None:
        return None
    try:
        if os.fstat(fd).st_ino != cursor.inode:
            return None
        data = os.pread(fd, limit, cursor.offset)
    finally:
        os.close(fd)
    cursor.offset += len(data)
    return data


def _open_regular(path: Path) -> int | None:
    """A descriptor to read `path` if it is a regular file (not a link, FIFO or device), else
    None. O_NONBLOCK: opening a FIFO must not wait for a writer."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:  # ELOOP: a symlink
        log.warning("machine_log_unreadable", path=str(path), error=str(e))
        return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        log.warning("machine_log_not_a_file", path=str(path))
        return None
    return fd


def _stat_regular(path: Path) -> os.stat_result | None:
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    return st if stat.S_ISREG(st.st_mode) else None


def _regular_size(path: Path) -> int:
    st = _stat_regular(path)
    return st.st_size if st is not None else 0


def _write_handle(path: Path, handle: Handle) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    try:
        os.write(fd, json.dumps(handle.to_dict()).encode())
    finally:
        os.close(fd)


def _read_handle(path: Path) -> Handle | None:
    try:
        return Handle.from_dict(json.loads(path.read_bytes()))
    except (OSError, ValueError, CorruptLog):
        return None
