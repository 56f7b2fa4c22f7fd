"""Proxy benchmark: the load generators, and the conditions a measurement runs in.

`run_wrk` (max requests/s with wrk), `run_loadgen` (the Python generator in its own process:
closed-loop, or paced at a constant rate in wrk2's manner, latency counted from when each
request was due) and `run_paced`; what they measured is a `Load`. Around them: how busy the
machine is (`wait_quiet` before a round, `calm_rounds` after), CPU pinning (`pinned`,
`own_cpu_layout`), and the scheduler's view of a process (`schedstat`, `sched_delta`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import procs
from bench.report import percentile

HOST = "bench.nonomad.test"


@dataclass
class Load:
    """What one run of a load generator measured."""

    requests: int
    errors: int
    seconds: float
    latencies_ms: list[float] = field(default_factory=list)
    p50_ms: float | None = None
    p99_ms: float | None = None
    sched: dict[str, float] = field(default_factory=dict)  # the generator's own, when known
    service_ms: list[float] = field(default_factory=list)  # paced: from the actual send
    late_ms: list[float] = field(default_factory=list)  # paced: the generator's own lateness

    @property
    def rps(self) -> float:
        return self.requests / self.seconds if self.seconds > 0 else 0.0

    def pct_late(self, p: float) -> float:
        return percentile(self.late_ms, p) if self.late_ms else float("nan")

    def pct(self, p: float) -> float:
        if self.latencies_ms:
            return percentile(self.latencies_ms, p)
        value = self.p50_ms if p == 50 else self.p99_ms if p == 99 else None
        return float("nan") if value is None else value


def run_wrk(wrk: str, port: int, connections: int, seconds: float) -> Load:
    """Max throughput with wrk (one thread) for a fixed time."""
    cmd = [
        wrk,
        "-t1",
        f"-c{connections}",
        f"-d{max(1, round(seconds))}s",
        "--latency",
        "-H",
        f"Host: {HOST}",
        f"http://127.0.0.1:{port}/",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 30).stdout
    rps = re.search(r"Requests/sec:\s+([\d.]+)", out)
    total = re.search(r"(\d+) requests in ([\d.]+)(\w+)", out)
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    socket_errors = re.search(
        r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out
    )
    if rps is None or total is None:
        raise RuntimeError(f"could not read wrk's output:\n{out}")
    unit = {"s": 1.0, "ms": 0.001, "m": 60.0}.get(total.group(3), 1.0)
    n = int(total.group(1))
    load = Load(
        requests=n,
        errors=(int(errors.group(1)) if errors else 0)
        + (sum(int(g) for g in socket_errors.groups()) if socket_errors else 0),
        seconds=n / float(rps.group(1)) if float(rps.group(1)) else float(total.group(2)) * unit,
    )
    load.p50_ms = _wrk_latency(out, "50%")
    load.p99_ms = _wrk_latency(out, "99%")
    return load


def _wrk_latency(out: str, label: str) -> float | None:
    match = re.search(rf"^\s+{re.escape(label)}\s+([\d.]+)(us|ms|s)\s*$", out, re.MULTILINE)
    if match is None:
        return None
    return float(match.group(1)) * {"us": 0.001, "ms": 1.0, "s": 1000.0}[match.group(2)]


def loadgen_main() -> None:
    """Child process: `PORT CONNECTIONS REQUESTS SECONDS RATE` (RATE 0: as fast as possible).

    Sends GETs over keep-alive connections until REQUESTS are answered or SECONDS pass.
    Prints one JSON line with the latencies.

    With a RATE it is a constant-throughput generator in the manner of wrk2: connection i
    sends its k-th request at `start + (k + i / CONNECTIONS) * CONNECTIONS / RATE`, one
    request in flight per connection. A connection whose answer comes late sends its next
    request at once, and keeps its schedule: a stall is caught up, then the connections are
    spread out again (a generator that moves a late connection's schedule to "now" lines the
    connections up after one stall, and they send in bursts from then on). A request's
    latency counts from when it was due, not from when it went, so a stall is charged to every
    request it held back (no coordinated omission); how late the generator itself sent is
    reported too, to show it kept up.

    It is a bare select loop over non-blocking sockets rather than asyncio: at ten thousand
    requests a second the generator's own cost would otherwise crowd the CPUs it shares with
    what it measures. select, not epoll: epoll's timeout is whole milliseconds, which would
    send a millisecond's requests at once.
    """
    port, conns, total, seconds, rate = (
        int(sys.argv[1]),
        int(sys.argv[2]),
        int(sys.argv[3]),
        float(sys.argv[4]),
        float(sys.argv[5]),
    )
    _precise_timers()
    before = schedstat(os.getpid())
    doc = _loadgen(port, conns, total, seconds, rate)
    doc["schedstat"] = sched_delta(before, schedstat(os.getpid()))
    print(json.dumps(doc), flush=True)


def _precise_timers() -> None:
    """Wake this process when its timeout ends, not up to 50 µs later (the kernel's default
    timer slack, which would make every paced request that much late)."""
    import ctypes

    pr_set_timerslack = 29
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_timerslack, 1, 0, 0, 0)


def schedstat(pid: int) -> tuple[int, int, int]:
    """(ns on a CPU, ns runnable but waiting for one, timeslices) from /proc; zeros when the
    kernel does not keep them."""
    try:
        on_cpu, waiting, slices = Path(f"/proc/{pid}/schedstat").read_text().split()[:3]
    except (OSError, ValueError):
        return (0, 0, 0)
    return (int(on_cpu), int(waiting), int(slices))


def sched_delta(before: tuple[int, int, int], after: tuple[int, int, int]) -> dict[str, float]:
    """What the scheduler did to a process between two `schedstat` readings: CPU time, time
    spent runnable but not running, and the mean wait per timeslice (µs)."""
    on_cpu, waiting, slices = (a - b for a, b in zip(after, before, strict=True))
    return {
        "cpu_ms": on_cpu / 1e6,
        "runqueue_wait_ms": waiting / 1e6,
        "slices": slices,
        "wait_per_slice_us": waiting / slices / 1e3 if slices else 0.0,
    }


def _loadgen(port: int, conns: int, total: int, seconds: float, rate: float) -> dict[str, Any]:
    import heapq
    import select
    import socket

    request = f"GET / HTTP/1.1\r\nHost: {HOST}\r\n\r\n".encode()
    socks: list[socket.socket] = []
    for _ in range(conns):
        sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        socks.append(sock)
    by_fd = {sock.fileno(): i for i, sock in enumerate(socks)}
    watched = list(by_fd)
    clock = time.perf_counter
    start = clock()
    deadline = start + seconds
    interval = conns / rate if rate > 0 else 0.0
    # (when its next request is due, connection) for every connection with nothing in flight
    idle = [(start + interval * i / conns, i) for i in range(conns)]
    due_at = [0.0] * conns  # of the request in flight
    free_at = [start] * conns  # when its last answer was read
    sent_at = [0.0] * conns  # 0.0: nothing in flight
    bufs = [b""] * conns
    latencies: list[float] = []  # from when each request was due
    service: list[float] = []  # from when it was sent
    late: list[float] = []  # how late the generator sent it
    errors = 0
    budget = total
    in_flight = 0
    try:
        while watched and (budget > 0 or in_flight):
            now = clock()
            if now >= deadline:
                break
            while idle and budget > 0 and idle[0][0] <= now:
                due, i = heapq.heappop(idle)
                if socks[i].fileno() not in watched:
                    continue  # the server closed it
                socks[i].send(request)
                sent = clock()
                due_at[i] = due if interval else sent
                sent_at[i] = sent
                late.append((sent - max(due, free_at[i])) * 1000)
                in_flight += 1
                budget -= 1
            wait = min(idle[0][0] - now, 0.05) if idle and budget > 0 else 0.05
            readable, _, _ = select.select(watched, (), (), max(wait, 0.0))
            for fd in readable:
                i = by_fd[fd]
                try:
                    data = socks[i].recv(65536)
                except BlockingIOError:
                    continue
                if not data:
                    watched.remove(fd)
                    if sent_at[i]:
                        errors += 1
                        in_flight -= 1
                        sent_at[i] = 0.0
                    continue
                buf = bufs[i] + data if bufs[i] else data
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    bufs[i] = buf
                    continue
                head = buf[:end].lower()
                at = head.find(b"content-length:")
                length = 0
                if at >= 0:
                    line_end = head.find(b"\r\n", at)
                    length = int(head[at + 15 : line_end if line_end >= 0 else len(head)])
                if len(buf) < end + 4 + length:
                    bufs[i] = buf
                    continue
                bufs[i] = buf[end + 4 + length :]
                if sent_at[i]:
                    done = clock()
                    latencies.append((done - due_at[i]) * 1000)
                    service.append((done - sent_at[i]) * 1000)
                    sent_at[i] = 0.0
                    free_at[i] = done
                    in_flight -= 1
                    heapq.heappush(idle, (due_at[i] + interval if interval else done, i))
                if buf[9:12] != b"200":
                    errors += 1
    finally:
        for sock in socks:
            sock.close()
    return {
        "requests": len(latencies),
        "errors": errors,
        "seconds": clock() - start,
        "latencies_ms": latencies,
        "service_ms": service,
        "late_ms": late,
    }


def run_loadgen(
    port: int,
    conns: int,
    total: int,
    seconds: float,
    rate: float = 0.0,
    cpus: frozenset[int] | None = None,
) -> Load:
    pin = f"import os; os.sched_setaffinity(0, {set(cpus)!r}); " if cpus else ""
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            pin + "from bench.proxy_load import loadgen_main; loadgen_main()",
            str(port),
            str(conns),
            str(total),
            str(seconds),
            str(rate),
        ],
        cwd=procs.REPO_ROOT,
        env=procs.clean_env(),
        capture_output=True,
        text=True,
        timeout=seconds + 60,
    )
    if out.returncode != 0:
        raise RuntimeError(f"load generator failed: {out.stderr[-2000:]}")
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    load = Load(doc["requests"], doc["errors"], doc["seconds"], doc["latencies_ms"])
    load.sched = doc.get("schedstat", {})
    load.service_ms = doc.get("service_ms", [])
    load.late_ms = doc.get("late_ms", [])
    return load


PACED_CONNECTIONS = 16


def run_paced(port: int, rate: float, seconds: float, cpus: frozenset[int] | None) -> Load:
    """`rate` requests a second for `seconds` over the paced connections."""
    return run_loadgen(port, PACED_CONNECTIONS, int(rate * seconds), seconds, rate, cpus=cpus)


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) a process has used, from /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_busy(seconds: float = 1.0) -> float:
    """How busy this machine's CPUs are (%) over `seconds`, from /proc/stat: what else runs
    here skews every number below."""

    def sample() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
        return sum(fields), idle

    try:
        total0, idle0 = sample()
        time.sleep(seconds)
        total1, idle1 = sample()
    except (OSError, ValueError, IndexError):
        return float("nan")
    if total1 == total0:
        return 0.0
    return 100.0 * (1 - (idle1 - idle0) / (total1 - total0))


QUIET_BUSY = 10.0  # % of the CPUs other work may use while a round runs
QUIET_WAIT = 30.0  # longest wait for it to drop that low before a round


def wait_quiet() -> float:
    """Before a round: wait (bounded) until other work leaves the CPUs alone; how busy they
    were when the round started (%)."""
    deadline = time.monotonic() + QUIET_WAIT
    busy = machine_busy(0.5)
    while busy >= QUIET_BUSY and time.monotonic() < deadline:
        busy = machine_busy(1.0)
    return busy


def calm_rounds(busy: Sequence[float]) -> list[int]:
    """The rounds to count: those other work left alone, if there are enough of them."""
    calm = [i for i, b in enumerate(busy) if b < QUIET_BUSY]
    return calm if len(calm) >= max(2, len(busy) // 2) else list(range(len(busy)))


def median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def own_cpu_layout() -> dict[str, frozenset[int]]:
    """Where each process runs while latency at moderate load is measured: the proxy under
    test (or HAProxy) alone on one CPU, the load generator and the backend (its clients and
    its machines: the rest of the world) on another. A 2-CPU VM shared by three busy processes
    otherwise measures where the scheduler put them: a loopback send wakes its reader on the
    sender's CPU, so the backend keeps landing on the proxy's CPU and each waits for the
    other. Empty (no pinning) with fewer than two CPUs."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return {}
    world = frozenset({cpus[0]})
    return {"loadgen": world, "backend": world, "proxy": frozenset({cpus[1]})}


@contextlib.contextmanager
def pinned(pid: int, cpus: frozenset[int] | None) -> Iterator[None]:
    """Run `pid` on `cpus` (None: leave it be), then back where it was allowed before."""
    if not cpus:
        yield
        return
    before = os.sched_getaffinity(pid)
    os.sched_setaffinity(pid, cpus)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(pid, before)
