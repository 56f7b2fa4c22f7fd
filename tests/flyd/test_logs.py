"""A machine's log, bounded (issue 27, attack 8): tails read within a byte budget whatever the
file holds, and a machine that can do nothing to the file its output lands in.

The reads are tested on real files, the huge ones sparse (a 4 TiB `machine.log` costs no disk);
the memory a read takes is measured with tracemalloc, not by time. The tricks a tenant tries on
its stdout run inside real machines of both drivers.
"""

from __future__ import annotations

import json
import os
import tracemalloc
from pathlib import Path

import pytest

from flyd.drivers.base import ExitStatus, LogTail
from flyd.drivers.logs import COPIER_HANDLE, LOG_NAME, MAX_LINE, read_tail
from flyd.drivers.rundir import kill_all
from tests.flyd.driver_support import (
    Exits,
    gone,
    log_lines,
    logged,
    run_machine,
    sh,
    spec,
    wait_until,
)

BUDGET = 1 << 20


def write_log(run_dir: Path, data: bytes, name: str = LOG_NAME) -> Path:
    run_dir.mkdir(exist_ok=True)
    path = run_dir / name
    path.write_bytes(data)
    return path


def lines(*texts: str) -> bytes:
    return b"".join(f"{t}\n".encode() for t in texts)


@pytest.mark.parametrize(
    ("files", "tail_lines", "max_bytes", "tail"),
    [
        # The lines asked for, across the rotated files (a line a rotation cut in two is whole),
        # and where a follow goes on from: the current file's end when it was read.
        (
            {LOG_NAME: b"ree\nfour\n", f"{LOG_NAME}.1": b"one\nth"},
            3,
            BUDGET,
            LogTail(["one", "three", "four"], follow_from=9),
        ),
        ({LOG_NAME: lines("a", "b", "c")}, 2, BUDGET, LogTail(["b", "c"], follow_from=6)),
        ({LOG_NAME: b"a\nb\nno newline yet"}, 2, BUDGET, LogTail(["b", "no newline yet"], 0, 18)),
        # The budget cuts the oldest line: dropped, and counted with what came before it.
        ({LOG_NAME: lines("first", "second", "third")}, 3, 10, LogTail(["third"], 13, 19)),
        ({LOG_NAME: b"x" * 100}, 5, 40, LogTail(["x" * 40], 60, 100)),  # no newline in the budget
        ({LOG_NAME: b""}, 5, BUDGET, LogTail([], follow_from=0)),
        ({}, 5, BUDGET, LogTail([], follow_from=0)),  # a follow starts at 0
        ({LOG_NAME: lines("a")}, 0, BUDGET, LogTail([], follow_from=2)),
    ],
)
def test_a_tail_reads_the_lines_asked_for_within_its_budget(
    tmp_path: Path, files: dict[str, bytes], tail_lines: int, max_bytes: int, tail: LogTail
) -> None:
    run_dir = tmp_path / "m1"
    run_dir.mkdir()
    for name, data in files.items():
        write_log(run_dir, data, name)
    assert read_tail(run_dir, tail_lines, backups=2, max_bytes=max_bytes) == tail


def test_a_long_line_is_cut_to_the_line_cap(tmp_path: Path) -> None:
    run_dir = tmp_path / "m1"
    write_log(run_dir, b"y" * (3 * MAX_LINE) + b"\nshort\n")
    tail = read_tail(run_dir, 2, backups=0, max_bytes=BUDGET)
    assert tail.lines == ["y" * MAX_LINE, "short"]


def huge(run_dir: Path, size: int, data: bytes = b"") -> Path:
    """A machine.log of `size` bytes that holds only `data` at its end: a sparse file."""
    run_dir.mkdir(exist_ok=True)
    path = run_dir / LOG_NAME
    with open(path, "wb") as f:
        f.truncate(size)
        if data:
            f.seek(size - len(data))
            f.write(data)
    return path


def peak_bytes(work: object) -> tuple[object, int]:
    """What `work()` returns, and the most memory it had allocated at once."""
    tracemalloc.start()
    try:
        result = work()  # type: ignore[operator]
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize(
    ("size", "end"),
    [
        (1 << 42, b""),  # ftruncate(1, 1 << 42): 4 TiB of nothing
        (256 << 20, b""),  # 256 MiB without a newline
        (1 << 42, b"\nlast words\n"),  # the machine went on printing after the hole
    ],
)
def test_a_huge_log_costs_a_read_its_budget_and_no_more(
    tmp_path: Path, size: int, end: bytes
) -> None:
    run_dir = tmp_path / "m1"
    huge(run_dir, size, end)
    tail, peak = peak_bytes(lambda: read_tail(run_dir, 10_000, backups=2, max_bytes=BUDGET))
    assert isinstance(tail, LogTail)
    assert peak < 6 * BUDGET  # the chunks, their join, the pieces: a few times the budget
    if end:
        assert tail.lines[-1] == "last words"
    else:
        # One line, the newest part of the output, cut to the line cap; the rest is counted.
        assert [len(line) for line in tail.lines] == [MAX_LINE]
        assert tail.truncated_bytes == size - MAX_LINE
    assert tail.truncated_bytes > size - BUDGET - 1


def test_a_log_that_is_not_a_regular_file_reads_as_empty(tmp_path: Path) -> None:
    run_dir = tmp_path / "m1"
    run_dir.mkdir()
    os.mkfifo(run_dir / LOG_NAME)  # a plain open would wait for a writer, forever
    (tmp_path / "secret").write_text("not the machine's\n")
    os.symlink(tmp_path / "secret", run_dir / f"{LOG_NAME}.1")
    assert read_tail(run_dir, 10, backups=1, max_bytes=BUDGET).lines == []


# -- from inside a machine -----------------------------------------------------------------------

TRICKS = r"""
import errno, fcntl, json, os
def attempt(name, call):
    try:
        call()
        said[name] = "done"
    except OSError as e:
        said[name] = errno.errorcode[e.errno]
said = {}
attempt("ftruncate", lambda: os.ftruncate(1, 1 << 42))
attempt("fallocate", lambda: os.posix_fallocate(1, 0, 1 << 30))
attempt("lseek", lambda: os.lseek(1, 1 << 40, os.SEEK_SET))
attempt("pwrite", lambda: os.pwrite(1, b"far", 1 << 40))
# No O_APPEND to clear on a pipe, nor an offset to write at once it is gone.
flags = fcntl.fcntl(1, fcntl.F_GETFL)
attempt("setfl", lambda: fcntl.fcntl(1, fcntl.F_SETFL, flags & ~os.O_APPEND))
attempt("pwrite_after_setfl", lambda: os.pwrite(1, b"far", 1 << 40))
# A second descriptor of its stdout, opened anew through /proc, is the same pipe (a container
# may not even open it: the pipe is host root's).
def reopen():
    fd = os.open("/proc/self/fd/1", os.O_WRONLY | os.O_TRUNC)
    try:
        os.ftruncate(fd, 1 << 42)
    finally:
        os.close(fd)
attempt("reopen_ftruncate", reopen)
print(json.dumps(said), flush=True)
chunk = b"z" * 4095 + b"\n"
for _ in range(300_000 // len(chunk)):  # then 300 KB of output
    os.write(1, chunk)
print("done", flush=True)
"""

LIMIT = 64 << 10


async def test_a_machine_can_do_nothing_to_its_log_but_write_to_it(
    make_driver, run_root: Path, image: Path
) -> None:
    exits = Exits()
    driver = make_driver(exits, max_log_bytes=LIMIT, log_backups=1)
    await run_machine(driver, spec("m1", ["python3", "-c", TRICKS], image))
    assert await exits.wait("m1") == ExitStatus(0, None)

    # Its tricks failed (next test), and its 300 KB of output went to two files of 64 KiB.
    logs = sorted(run_root.joinpath("m1").glob(f"{LOG_NAME}*"))
    assert [p.name for p in logs] == [LOG_NAME, f"{LOG_NAME}.1"]
    for path in logs:
        st = path.stat()
        assert st.st_size <= LIMIT
        assert st.st_blocks * 512 <= LIMIT + 4096  # nothing allocated beyond what was written
    assert log_lines(driver, "m1", 1) == ["done"]


async def test_tricks_on_stdout_fail_as_on_a_pipe(make_driver, image: Path) -> None:
    exits = Exits()
    driver = make_driver(exits)
    script = TRICKS.replace("for _ in range(300_000 // len(chunk)):", "for _ in range(0):")
    await run_machine(driver, spec("m1", ["python3", "-c", script], image))
    await exits.wait("m1")
    said = json.loads(log_lines(driver, "m1", 2)[0])
    assert said.pop("reopen_ftruncate") in ("EINVAL", "EACCES")
    assert said == {
        "ftruncate": "EINVAL",
        "fallocate": "ESPIPE",
        "lseek": "ESPIPE",
        "pwrite": "ESPIPE",
        "setfl": "done",
        "pwrite_after_setfl": "ESPIPE",
    }


async def test_output_written_before_an_exit_is_in_the_log_when_it_is_reported(
    make_driver, image: Path
) -> None:
    # Through the copier: the exit waits until it has written the last bytes.
    exits = Exits()
    driver = make_driver(exits)
    await run_machine(driver, spec("m1", sh("seq 1 20000; echo last >&2"), image))
    await exits.wait("m1")
    assert log_lines(driver, "m1", 2) == ["20000", "last"]


async def test_tearing_a_worker_down_ends_the_copiers_too(
    make_driver, run_root: Path, image: Path
) -> None:
    exits = Exits()
    driver = make_driver(exits)
    # Something of the machine's escapes its process group and keeps its stdout open.
    await run_machine(driver, spec("m1", sh("setsid sleep 1000 & echo up; sleep 1000"), image))
    await logged(driver, "m1", "up")
    copier = json.loads((run_root / "m1" / COPIER_HANDLE).read_text())["pid"]
    await driver.close()
    kill_all(run_root)
    await wait_until(lambda: gone(copier), "the copier to end")
