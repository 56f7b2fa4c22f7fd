"""Proxy benchmark: the HTTP parser choice, and what the data plane costs per request.

1. parsers: a micro-benchmark of the candidate HTTP/1.1 parsers (httptools, i.e. llhttp, and
   h11) on a typical browser request and a typical 1 KiB JSON response. The proxy uses the
   faster one that parses incrementally and handles chunked bodies and Upgrade.
2. throughput and latency, all against the same backend (a small keep-alive HTTP server in its
   own process), each target in its own process:
   (a) direct to the backend, (b) through nonomad's proxy (`proxy.http.HttpProxy` with a
   static router), (c) through HAProxy (installed with apt-get when missing) configured the
   same way: keep-alive on both sides, `http-reuse always`, one thread.
   - max requests/s: `wrk` (installed the same way) with keep-alive connections for a fixed
     time; the Python closed-loop generator below when wrk cannot be had.
   - latency at moderate load: a constant-rate generator in its own process (wrk2's model:
     every connection keeps its schedule, latency counts from when a request was due) sends
     at 25% and at 50% of the proxy's max rate over keep-alive connections; "added" latency
     is each target's percentile minus the direct one's. The proxy (or HAProxy) runs on a
     CPU of its own and the generator and backend on the other, as on separate hosts; at 50%
     the run is repeated with no pinning, for comparison.
   The targets are measured in interleaved rounds, each after waiting (bounded) for other
   work on the machine to stop; rounds that other work disturbed anyway are left out when
   enough calm ones remain. On a shared 2-CPU VM the per-round numbers still drift by
   +-30%: read the medians, and the per-round lists in the JSON.

Targets: proxy rps >= 0.5 x HAProxy rps; proxy's added p99 <= 1 ms at 50% of its max (on
its own CPU).

`python -c "from bench.proxy_bench import main; main()" [--quick] [--strict] [--out FILE]`.
Every load loop is bounded by a request count and a time limit; every child process is
stopped at the end. Only 127.0.0.1 is used.

`run()` takes `sections`: functions `(results, ctx)` run in order after the defaults, so more
rows (cold start, failover) can be added without touching these.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import procs
from bench.report import Results, percentile
from proxy.settings import ProxySettings

HOST = "bench.nonomad.test"
DOMAIN = "nonomad.test"
TARGET_RATIO = 0.5
TARGET_ADDED_P99_MS = 1.0
RUN_DEADLINE = 300.0
START_WAIT = 15.0

# -- 1. the parser micro-benchmark ------------------------------------------------------------

REQUEST = (
    b"GET /api/v1/items?page=2&sort=desc HTTP/1.1\r\n"
    b"Host: myapp.nonomad.test\r\n"
    b"User-Agent: Mozilla/5.0 (X11; Linux x86_64) AppleWebKit/537.36 Chrome/126.0 Safari/537.36\r\n"
    b"Accept: text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8\r\n"
    b"Accept-Language: en-US,en;q=0.9\r\n"
    b"Accept-Encoding: gzip, deflate, br\r\n"
    b"Cookie: session=0123456789abcdef0123456789abcdef; theme=dark\r\n"
    b"traceparent: 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\r\n"
    b"Connection: keep-alive\r\n\r\n"
)
RESPONSE = (
    b"HTTP/1.1 200 OK\r\n"
    b"Date: Mon, 02 Nov 2026 10:00:00 GMT\r\n"
    b"Server: app\r\n"
    b"Content-Type: application/json\r\n"
    b"Cache-Control: no-cache\r\n"
    b"Content-Length: 1024\r\n"
    b"Connection: keep-alive\r\n\r\n" + b"x" * 1024
)


class _Sink:
    """Parser callbacks that keep what a proxy keeps: the headers and the body pieces."""

    __slots__ = ("body", "done", "headers")

    def __init__(self) -> None:
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []
        self.done = False

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_body(self, data: bytes) -> None:
        self.body.append(data)

    def on_message_complete(self) -> None:
        self.done = True


def _time_httptools(kind: str, n: int) -> float:
    import httptools

    sink = _Sink()
    parser: Any
    if kind == "request":
        parser, data = httptools.HttpRequestParser(sink), REQUEST
    else:
        parser, data = httptools.HttpResponseParser(sink), RESPONSE
    start = time.perf_counter()
    for _ in range(n):
        sink.headers = []
        sink.body = []
        parser.feed_data(data)
    return (time.perf_counter() - start) / n


def _time_h11(kind: str, n: int) -> float:
    import h11

    # h11 parses one cycle per Connection; the connections are made outside the timing.
    conns = []
    for _ in range(n):
        if kind == "request":
            conn = h11.Connection(h11.SERVER)
        else:
            conn = h11.Connection(h11.CLIENT)
            conn.send(h11.Request(method="GET", target="/", headers=[("Host", "a")]))
            conn.send(h11.EndOfMessage())
        conns.append(conn)
    data = REQUEST if kind == "request" else RESPONSE
    start = time.perf_counter()
    for conn in conns:
        conn.receive_data(data)
        while True:
            event = conn.next_event()
            if type(event) is h11.EndOfMessage or event is h11.NEED_DATA:
                break
    return (time.perf_counter() - start) / n


PARSERS: dict[str, Callable[[str, int], float]] = {
    "httptools (llhttp)": _time_httptools,
    "h11": _time_h11,
}


def parser_bench(quick: bool = False) -> Results:
    """µs per message for each candidate parser (best of 3 runs), as a table."""
    results = Results("HTTP/1.1 parsers: time to parse one message (best of 3)")
    n = 3_000 if quick else 30_000
    for name, timer in PARSERS.items():
        for kind in ("request", "response"):
            try:
                best = min(timer(kind, n) for _ in range(3))
            except ImportError:
                results.add(f"{name}, {kind}", None, "µs", note="not installed")
                continue
            results.add(f"{name}, {kind}", best * 1e6, "µs")
    return results


# -- 2. processes: backend, proxy, HAProxy, load ---------------------------------------------

_BACKEND_BODY = b"hello from the bench backend\n"
_BACKEND_RESPONSE = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n\r\n%b"
    % (len(_BACKEND_BODY), _BACKEND_BODY)
)


class _BackendProtocol(asyncio.Protocol):
    """Answers every request (GETs without bodies) with the same small response."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        buf = self.buf + data if self.buf else data
        n = buf.count(b"\r\n\r\n")
        if n:
            assert self.transport is not None
            self.transport.write(_BACKEND_RESPONSE * n)
            buf = buf[buf.rfind(b"\r\n\r\n") + 4 :]
        self.buf = buf


async def _serve_until_stdin_closes(start: Callable[[], Any]) -> None:
    port = await start()
    print(port, flush=True)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    await reader.read()  # EOF: the bench is done with us


def backend_main() -> None:
    """Child process: the backend. Prints its port; runs until stdin closes."""

    async def start() -> int:
        server = await asyncio.get_running_loop().create_server(
            _BackendProtocol, "127.0.0.1", 0, backlog=1024
        )
        return int(server.sockets[0].getsockname()[1])

    asyncio.run(_serve_until_stdin_closes(start))


class StaticRouter:
    """A router with one machine for every app: the data plane's cost alone."""

    def __init__(self, port: int) -> None:
        from proxy.routing import Backend

        self.backend = Backend("bench-machine", "bench", "bench-worker", "ams", "127.0.0.1", port)

    async def acquire(
        self, app: str, *, pinned: str | None = None, exclude: frozenset[str] = frozenset()
    ) -> Any:
        return self.backend

    def try_acquire(
        self, app: str, *, pinned: str | None = None, exclude: frozenset[str] = frozenset()
    ) -> Any:
        return self.backend

    def release(self, backend: Any, *, ok: bool, connect_failed: bool = False) -> None:
        pass


def proxy_main() -> None:
    """Child process: nonomad's proxy in front of the backend port in argv[1], on the event
    loop named in argv[2] (default: the proxy's default, as `nonomad-proxy` runs it)."""
    import logging

    import structlog

    from proxy.http import HttpProxy
    from proxy.main import use_event_loop
    from proxy.stats import Stats

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    backend_port = int(sys.argv[1])
    default_loop = ProxySettings.model_fields["event_loop"].default
    use_event_loop(sys.argv[2] if len(sys.argv) > 2 else default_loop)

    probe = os.environ.get(PROBE_ENV)
    if probe:
        _install_probe(Path(probe))

    async def start() -> int:
        proxy = HttpProxy(StaticRouter(backend_port), Stats(), domain=DOMAIN, region="ams")
        _, port = await proxy.serve("127.0.0.1", 0)
        return port

    asyncio.run(_serve_until_stdin_closes(start))


PROBE_ENV = "NONOMAD_PROXY_BENCH_PROBE"


def _install_probe(path: Path) -> None:
    """(`--section latency --probe` only) Time the proxy's own callbacks with perf_counter: a
    client's request bytes in, the machine's answer bytes in (and written on), so the latency
    the load generator sees can be split into the proxy's work, the machine's, and the rest
    (waiting to be scheduled, or behind other callbacks). SIGUSR1 writes what was recorded
    since the last one to `path` (JSON) and starts afresh."""
    import signal

    from proxy.forward import Client
    from proxy.upstream import Upstream

    clock = time.perf_counter
    started: dict[int, float] = {}
    sent: dict[int, float] = {}
    rows: list[tuple[float, float, float, float]] = []  # client cb start/end, upstream cb start/end
    client_received = Client.data_received
    upstream_received = Upstream.data_received

    def on_client_data(self: Any, data: bytes) -> None:
        t0 = clock()
        client_received(self, data)
        started[id(self)] = t0
        sent[id(self)] = clock()

    def on_upstream_data(self: Any, data: bytes) -> None:
        client = self.client
        t0 = clock()
        upstream_received(self, data)
        t1 = clock()
        if client is not None and id(client) in started:
            rows.append((started.pop(id(client)), sent.pop(id(client)), t0, t1))

    def dump(signum: int, frame: Any) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(rows))
        tmp.rename(path)
        rows.clear()

    Client.data_received = on_client_data  # type: ignore[method-assign]
    Upstream.data_received = on_upstream_data  # type: ignore[method-assign]
    signal.signal(signal.SIGUSR1, dump)


@dataclass
class Child:
    """A child process that printed the port it serves on."""

    name: str
    proc: subprocess.Popen[bytes]
    port: int

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        with contextlib.suppress(ProcessLookupError):
            self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def _start_python_child(
    name: str, func: str, args: Sequence[str], log: Path, env: dict[str, str] | None = None
) -> Child:
    with open(log, "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-c", f"from bench.proxy_bench import {func}; {func}()", *args],
            cwd=procs.REPO_ROOT,
            env={**procs.clean_env(), **(env or {})},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
        )
    assert proc.stdout is not None
    line = proc.stdout.readline()  # bounded: the child prints its port or dies
    if not line.strip():
        proc.kill()
        proc.wait(5)
        raise RuntimeError(f"{name} failed to start; see {log}")
    return Child(name, proc, int(line))


def ensure_tool(binary: str, package: str) -> str | None:
    """The path of `binary`, installing Debian's `package` (as root) when it is missing."""
    path = _which(binary)
    if path is not None:
        return path
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return None
    procs.progress(f"installing {package} with apt-get")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", package]
    ok = subprocess.run(install, env=env, capture_output=True, timeout=300).returncode == 0
    if not ok:
        subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True, timeout=300)
        subprocess.run(install, env=env, capture_output=True, timeout=300)
    return _which(binary)


def _which(binary: str) -> str | None:
    sbin = Path("/usr/sbin") / binary  # not on every PATH
    return shutil.which(binary) or (str(sbin) if sbin.exists() else None)


_HAPROXY_CONFIG = """\
global
    maxconn 4096
    nbthread 1
    log stdout format raw local0 err

defaults
    mode http
    timeout connect 2s
    timeout client 60s
    timeout server 60s
    timeout http-keep-alive 60s
    timeout http-request 10s
    option http-keep-alive
    http-reuse always

frontend bench
    bind 127.0.0.1:{port}
    default_backend machines

backend machines
    server m1 127.0.0.1:{backend_port}
"""


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_haproxy(binary: str, backend_port: int, tmp: Path) -> Child:
    port = _free_port()
    config = tmp / "haproxy.cfg"
    config.write_text(_HAPROXY_CONFIG.format(port=port, backend_port=backend_port))
    log = tmp / "haproxy.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [binary, "-db", "-f", str(config)],
            stdin=subprocess.PIPE,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    child = Child("haproxy", proc, port)
    deadline = time.monotonic() + START_WAIT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"haproxy exited; see {log}")
        with contextlib.suppress(OSError):
            import socket

            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return child
        time.sleep(0.05)
    child.stop()
    raise RuntimeError("haproxy did not start listening")


# -- the load generators --------------------------------------------------------------------------


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
    before = _schedstat(os.getpid())
    doc = _loadgen(port, conns, total, seconds, rate)
    doc["schedstat"] = _sched_delta(before, _schedstat(os.getpid()))
    print(json.dumps(doc), flush=True)


def _precise_timers() -> None:
    """Wake this process when its timeout ends, not up to 50 µs later (the kernel's default
    timer slack, which would make every paced request that much late)."""
    import ctypes

    pr_set_timerslack = 29
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_timerslack, 1, 0, 0, 0)


def _schedstat(pid: int) -> tuple[int, int, int]:
    """(ns on a CPU, ns runnable but waiting for one, timeslices) from /proc; zeros when the
    kernel does not keep them."""
    try:
        on_cpu, waiting, slices = Path(f"/proc/{pid}/schedstat").read_text().split()[:3]
    except (OSError, ValueError):
        return (0, 0, 0)
    return (int(on_cpu), int(waiting), int(slices))


def _sched_delta(before: tuple[int, int, int], after: tuple[int, int, int]) -> dict[str, float]:
    """What the scheduler did to a process between two `_schedstat` readings: CPU time, time
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
            pin + "from bench.proxy_bench import loadgen_main; loadgen_main()",
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


# -- 3. the run -----------------------------------------------------------------------------------


@dataclass
class Context:
    """What the sections share: settings, a temp dir, the children started (stopped at the end)."""

    quick: bool
    tmp: Path
    children: list[Child] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)

    def start(self, name: str, func: str, *args: str, env: dict[str, str] | None = None) -> Child:
        child = _start_python_child(name, func, args, self.tmp / f"{name}.log", env)
        self.children.append(child)
        return child

    def adopt(self, child: Child) -> Child:
        self.children.append(child)
        return child

    def stop_all(self) -> None:
        for child in reversed(self.children):
            child.stop()
        self.children.clear()


Section = Callable[[Results, Context], None]


def _cpu_seconds(pid: int) -> float:
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


def _calm(busy: Sequence[float]) -> list[int]:
    """The rounds to count: those other work left alone, if there are enough of them."""
    calm = [i for i, b in enumerate(busy) if b < QUIET_BUSY]
    return calm if len(calm) >= max(2, len(busy) // 2) else list(range(len(busy)))


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def throughput_section(results: Results, ctx: Context) -> None:
    """Rows (a) direct, (b) nonomad proxy, (c) HAProxy: max rps and latency at moderate load.

    This machine's speed drifts from one second to the next (a shared VM), so the targets are
    measured in interleaved rounds (direct, proxy, haproxy, direct, ...) and compared round by
    round: the ratio is the median of the per-round ratios.
    """
    quick = ctx.quick
    backend = ctx.start("backend", "backend_main")
    targets: dict[str, Child] = {"direct": backend}
    targets["nonomad proxy"] = ctx.start("proxy", "proxy_main", str(backend.port))
    haproxy = ensure_tool("haproxy", "haproxy")
    if haproxy is not None:
        targets["haproxy"] = ctx.adopt(start_haproxy(haproxy, backend.port, ctx.tmp))
    else:
        results.errors.append("haproxy is not installed and could not be installed")
    wrk = ensure_tool("wrk", "wrk")
    conns = 32
    rounds = 3 if quick else 7
    max_seconds = 2.0 if quick else 4.0

    for child in targets.values():  # warm every path (pools, caches) before measuring
        run_loadgen(child.port, 4, 1000, 5.0)

    peak: dict[str, list[Load]] = {name: [] for name in targets}
    proxy_cpu_us: list[float] = []
    round_busy: list[float] = []
    for r in range(rounds):
        round_busy.append(wait_quiet())
        procs.progress(
            f"max throughput, round {r + 1}/{rounds} (other work: {round_busy[-1]:.0f}%)"
        )
        for name, child in targets.items():
            before = _cpu_seconds(child.proc.pid)
            if wrk is not None:
                load = run_wrk(wrk, child.port, conns, max_seconds)
            else:
                load = run_loadgen(child.port, conns, 10_000_000, max_seconds)
            if name == "nonomad proxy" and load.requests:
                used = _cpu_seconds(child.proc.pid) - before
                proxy_cpu_us.append(used / load.requests * 1e6)
            if load.errors:
                results.errors.append(f"{name}: {load.errors} errors at max load")
            peak[name].append(load)
    calm = _calm(round_busy)
    results.add("rounds counted (others disturbed by other work)", len(calm), f"of {rounds}")
    for name, loads in peak.items():
        results.add(
            f"{name}: max requests/s ({conns} conns, median)",
            round(_median([loads[i].rps for i in calm])),
            "req/s",
        )
    if "haproxy" in peak:
        ratios = [
            peak["nonomad proxy"][i].rps / peak["haproxy"][i].rps
            for i in calm
            if peak["haproxy"][i].rps > 0
        ]
        results.add(
            "proxy rps / haproxy rps (median of rounds)",
            round(_median(ratios), 2),
            "x",
            target=(">=", TARGET_RATIO),
        )
        results.details["ratio_by_round"] = [round(x, 3) for x in ratios]
    results.add(
        "proxy CPU per request at max load",
        _median([proxy_cpu_us[i] for i in calm if i < len(proxy_cpu_us)]),
        "µs",
    )
    results.details["other_work_busy_pct_by_round"] = [round(b, 1) for b in round_busy]

    proxy_max = _median([peak["nonomad proxy"][i].rps for i in calm])
    own_cpu = _own_cpu_layout()
    for share in (0.25, 0.5):
        _latency_rows(
            results,
            targets,
            backend,
            rate=max(100.0, round(proxy_max * share, -2)),
            ctx=ctx,
            share=share,
            target=share == 0.5,
            pins=own_cpu,
        )
    if own_cpu:  # the same at 50%, the scheduler placing all three: for comparison
        _latency_rows(
            results,
            targets,
            backend,
            rate=max(100.0, round(proxy_max * 0.5, -2)),
            ctx=ctx,
            share=0.5,
            target=False,
            pins={},
        )
    results.details.update(
        {
            "max_load_tool": "wrk -t1" if wrk is not None else "python closed-loop generator",
            "backend": "asyncio protocol in its own process, 29-byte body, keep-alive",
            "proxy_event_loop": ProxySettings.model_fields["event_loop"].default,
            "haproxy": "nbthread 1, http-reuse always, keep-alive both sides",
            "moderate_load": "paced at 25% and at 50% of the proxy's own median max req/s "
            f"(the same rate for every target), over {PACED_CONNECTIONS} keep-alive connections; "
            "the proxy measured (or HAProxy) on a CPU of its own, the generator and the backend "
            "on the other, as a proxy on its own host would be; at 50% also with no pinning",
            "moderate_load_cpus": {k: sorted(v) for k, v in own_cpu.items()},
            "moderate_connections": PACED_CONNECTIONS,
            "max_connections": conns,
            "cpus": os.cpu_count(),
            "max_rps_by_round": {n: [round(x.rps) for x in loads] for n, loads in peak.items()},
            "wrk_p50_p99_ms": {
                n: [[x.p50_ms, x.p99_ms] for x in loads] for n, loads in peak.items()
            },
            "proxy_cpu_us_by_round": [round(x, 1) for x in proxy_cpu_us],
        }
    )


PACED_CONNECTIONS = 16


def run_paced(port: int, rate: float, seconds: float, cpus: frozenset[int] | None) -> Load:
    """`rate` requests a second for `seconds` over the paced connections."""
    return run_loadgen(port, PACED_CONNECTIONS, int(rate * seconds), seconds, rate, cpus=cpus)


def _own_cpu_layout() -> dict[str, frozenset[int]]:
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
def _pinned(pid: int, cpus: frozenset[int] | None) -> Iterator[None]:
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


def _latency_rows(
    results: Results,
    targets: dict[str, Child],
    backend: Child,
    *,
    rate: float,
    ctx: Context,
    share: float,
    target: bool,
    pins: dict[str, frozenset[int]],
) -> None:
    """Latency of every target at one paced rate (interleaved rounds, latencies pooled);
    "added" is a target's percentile minus direct's. `pins`: CPUs for `loadgen`, `backend`
    and `proxy` (whichever target is measured), as `_own_cpu_layout` gives; empty: none."""
    seconds = 2.0 if ctx.quick else 4.0
    rounds = 2 if ctx.quick else 3
    pooled: dict[str, Load] = {name: Load(0, 0, 0.0) for name in targets}
    where = "own CPU" if pins else "CPUs shared"
    with _pinned(backend.proc.pid, pins.get("backend")):
        for r in range(rounds):
            busy = wait_quiet()
            procs.progress(
                f"latency at {rate:.0f} req/s ({where}), round {r + 1}/{rounds} "
                f"(other work: {busy:.0f}%)"
            )
            for name, child in targets.items():
                cpus = pins.get("proxy") if child is not backend else None
                with _pinned(child.proc.pid, cpus):
                    load = run_paced(child.port, rate, seconds, pins.get("loadgen"))
                total = pooled[name]
                total.requests += load.requests
                total.errors += load.errors
                total.seconds += load.seconds
                total.latencies_ms += load.latencies_ms
                total.late_ms += load.late_ms
    direct = pooled["direct"]
    at = f"at {rate:.0f} req/s ({share:.0%} of proxy max, {where})"
    results.details.setdefault("paced_generator_late_p99_ms", {})[at] = {
        name: round(load.pct_late(99), 3) for name, load in pooled.items()
    }
    for name, load in pooled.items():
        if load.errors:
            results.errors.append(f"{name}: {load.errors} errors {at}")
        if name == "direct":
            results.add(f"direct: p50 {at}", load.pct(50), "ms")
            results.add(f"direct: p99 {at}", load.pct(99), "ms")
            continue
        results.add(f"{name}: added p50 {at}", load.pct(50) - direct.pct(50), "ms")
        results.add(
            f"{name}: added p99 {at}",
            load.pct(99) - direct.pct(99),
            "ms",
            target=("<=", TARGET_ADDED_P99_MS) if target and name == "nonomad proxy" else None,
        )


DEFAULT_SECTIONS: tuple[Section, ...] = (throughput_section,)


def _dist(values_ms: Sequence[float]) -> str:
    if not values_ms:
        return "-"
    return " / ".join(f"{percentile(list(values_ms), p):.3f}" for p in (50, 99, 99.9))


def _parse_pin(spec: str) -> dict[str, frozenset[int]]:
    """`loadgen=0,proxy=1,backend=1` (a CPU set per process: `proxy=0+1`)."""
    pins: dict[str, frozenset[int]] = {}
    for part in filter(None, spec.split(",")):
        name, _, cpus = part.partition("=")
        if name not in ("loadgen", "proxy", "backend") or not cpus:
            raise SystemExit(f"--pin: expected loadgen|proxy|backend=CPU[+CPU], got {part!r}")
        pins[name] = frozenset(int(c) for c in cpus.split("+"))
    return pins


def latency_only(
    rate: float,
    rounds: int,
    seconds: float,
    pin: str = "",
    probe: bool = False,
    probe_out: Path | None = None,
    haproxy: bool = False,
) -> int:
    """`--section latency`: only the paced-latency measurement at `rate` (direct and proxy,
    interleaved rounds, latencies pooled, as in the full run), with where the time goes: the
    scheduler's run-queue wait of each process (/proc/PID/schedstat) and, with `probe`, the
    proxy's own callback timings."""
    pins = _parse_pin(pin)
    procs.raise_fd_limit()
    with tempfile.TemporaryDirectory(prefix="proxy-bench-") as tmp:
        ctx = Context(False, Path(tmp))
        probe_file = Path(tmp) / "probe.json"
        try:
            backend = ctx.start("backend", "backend_main")
            env = {PROBE_ENV: str(probe_file)} if probe else None
            proxy = ctx.start("proxy", "proxy_main", str(backend.port), env=env)
            for name, child in (("backend", backend), ("proxy", proxy)):
                if name in pins:
                    os.sched_setaffinity(child.proc.pid, pins[name])
            targets = {"direct": backend, "proxy": proxy}
            binary = ensure_tool("haproxy", "haproxy") if haproxy else None
            if binary is not None:
                targets["haproxy"] = ctx.adopt(start_haproxy(binary, backend.port, ctx.tmp))
                if "proxy" in pins:
                    os.sched_setaffinity(targets["haproxy"].proc.pid, pins["proxy"])
            for child in targets.values():
                run_loadgen(child.port, 4, 1000, 5.0)
            pooled: dict[str, list[float]] = {name: [] for name in targets}
            probe_rows: list[list[float]] = []
            for r in range(rounds):
                busy = wait_quiet()
                line = [f"round {r + 1}/{rounds} at {rate:.0f} req/s (other work {busy:.0f}%):"]
                for name, child in targets.items():
                    if probe:
                        proxy.proc.send_signal(signal.SIGUSR1)  # drop what warm-up recorded
                        _wait_file(probe_file)
                    watched = (("proxy", child), ("backend", backend))
                    sched_before = {n: _schedstat(c.proc.pid) for n, c in watched}
                    load = run_paced(child.port, rate, seconds, pins.get("loadgen"))
                    sched = {
                        n: _sched_delta(sched_before[n], _schedstat(c.proc.pid)) for n, c in watched
                    }
                    sched["loadgen"] = load.sched
                    if name == "proxy" and probe:
                        proxy.proc.send_signal(signal.SIGUSR1)
                        probe_rows += _wait_file(probe_file)
                    pooled[name] += load.latencies_ms
                    n_req = max(1, load.requests)
                    waits = ", ".join(
                        f"{n} {d.get('cpu_ms', 0) * 1e3 / n_req:.0f} µs CPU/req, "
                        f"{d.get('slices', 0) / n_req:.2f} wakeups/req, "
                        f"{d.get('runqueue_wait_ms', 0):.0f} ms waiting "
                        f"({d.get('wait_per_slice_us', 0):.0f} µs a wakeup)"
                        for n, d in sched.items()
                        if d and (n != "proxy" or name != "direct")
                    )
                    line.append(
                        f"  {name:7} p50/p99/p99.9 {_dist(load.latencies_ms)} ms "
                        f"(from the send: {_dist(load.service_ms)}), "
                        f"{load.rps:.0f} req/s, errors {load.errors}, "
                        f"generator late p50/p99/p99.9 {_dist(load.late_ms)} ms"
                        f"\n    scheduler: {waits}"
                    )
                procs.progress("\n".join(line))
            direct = pooled["direct"]
            print(f"pooled over {rounds} rounds at {rate:.0f} req/s, p50/p99/p99.9 (ms)")
            for name, lat in pooled.items():
                print(f"  {name:7} {_dist(lat)}")
                if name != "direct":
                    print(
                        f"  {name:7} added p50 {percentile(lat, 50) - percentile(direct, 50):.3f}"
                        f" ms, added p99 {percentile(lat, 99) - percentile(direct, 99):.3f} ms"
                        f" (target for the proxy <= {TARGET_ADDED_P99_MS})"
                    )
            if probe_rows and probe_out is not None:
                probe_out.write_text(json.dumps(probe_rows))
            if probe_rows:
                own = [(b - a + d - c) * 1e3 for a, b, c, d in probe_rows]
                machine = [(c - b) * 1e3 for a, b, c, d in probe_rows]
                inside = [(d - a) * 1e3 for a, b, c, d in probe_rows]
                print("  proxy probe (its callbacks, perf_counter), p50/p99/p99.9 (ms):")
                print(f"    proxy's own work per request     {_dist(own)}")
                print(f"    request sent -> answer read      {_dist(machine)}")
                print(f"    request read -> answer written   {_dist(inside)}")
        finally:
            ctx.stop_all()
    return 0


def _wait_file(path: Path, timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"the proxy wrote no probe data to {path}")
        time.sleep(0.01)
    doc = json.loads(path.read_text())
    path.unlink()
    return doc


def run(
    quick: bool = False,
    out: Path | None = None,
    strict: bool = False,
    sections: Sequence[Section] = (),
) -> int:
    """Run the parser table and the sections; print tables; write JSON to `out` when given."""
    parsers = parser_bench(quick)
    print(parsers.table())
    print()
    title = "proxy: requests/s and added latency (same backend, 127.0.0.1)"
    if quick:
        title += " [quick]"
    results = Results(title)
    results.details["parsers_us"] = {m.name: m.value for m in parsers.metrics}
    procs.raise_fd_limit()
    with tempfile.TemporaryDirectory(prefix="proxy-bench-") as tmp:
        ctx = Context(quick, Path(tmp))
        started = time.monotonic()
        try:
            for section in (*DEFAULT_SECTIONS, *sections):
                if time.monotonic() - started > RUN_DEADLINE:
                    results.errors.append(f"run deadline passed before {section.__name__}")
                    break
                section(results, ctx)
        except Exception as err:  # report what was measured, and why the rest was not
            results.errors.append(f"{type(err).__name__}: {err}")
        finally:
            ctx.stop_all()
    print(results.table())
    if out is not None:
        doc = results.to_json()
        doc["parsers"] = parsers.to_json()
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=2) + "\n")
    if results.errors or (strict and results.missed):
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="proxy_bench", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="shorter loops (a smoke test)")
    parser.add_argument("--out", type=Path, help="also write the results as JSON here")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    parser.add_argument(
        "--section",
        choices=["all", "latency"],
        default="all",
        help="latency: only the paced latency of direct and proxy at --rate (a quick loop for "
        "looking into the tail)",
    )
    parser.add_argument("--rate", type=float, default=12_900.0, help="(latency) req/s")
    parser.add_argument("--rounds", type=int, default=3, help="(latency) interleaved rounds")
    parser.add_argument("--seconds", type=float, default=4.0, help="(latency) per run")
    parser.add_argument(
        "--pin", default="", help="(latency) CPU affinity, e.g. loadgen=0,proxy=1,backend=1"
    )
    parser.add_argument(
        "--probe", action="store_true", help="(latency) time the proxy's own callbacks too"
    )
    parser.add_argument(
        "--probe-out", type=Path, help="(latency, --probe) write the raw callback times here"
    )
    parser.add_argument(
        "--haproxy", action="store_true", help="(latency) measure HAProxy too (same rate)"
    )
    args = parser.parse_args(argv)
    if args.section == "latency":
        return latency_only(
            args.rate,
            args.rounds,
            args.seconds,
            args.pin,
            args.probe,
            args.probe_out,
            args.haproxy,
        )
    return run(quick=args.quick, out=args.out, strict=args.strict)


if __name__ == "__main__":
    sys.exit(main())
