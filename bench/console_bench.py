"""The web console's page loads with 1,000 machines in the local cluster (target: under 200 ms).

Real processes on 127.0.0.1, secure as `nonomad up` runs them: four workers in two regions
(ams, syd) announcing to flaps, one proxy following them and flaps, and `nonomad-console`
following flaps' replica with its read-only token. 1,000 machines are made through flaps'
CreateMachine: app `big` has 500 (250 primaries, each with a standby on another worker), nine
apps have the other 500. A few of big's primaries run the demo app (their log tail, events and
routes are real); the others are created without being launched: rows like any other, which the
pages read the same way, without 1,000 processes on the benchmark's machine.

The benchmark logs in as the operator does (the admin token over HTTP, a session cookie on
every request after; the browser with the one-time login URL `nonomad up` prints), so each
load pays what the console's front door checks (Host, session, headers). Measured, once the
console's replica holds every machine, with a live stream of each kind
held open meanwhile as open tabs hold them (the fleet's, both apps' first pages, the running
machine's and its log's, the events'; each read as it comes; they render on every heartbeat
and change, on the loop the pages are served from):

- over HTTP (a kept-alive connection, one request after another): each page as HTML and as
  its JSON twin, from the request sent to the last byte of the answer: the fleet, the apps,
  big's first page (100 of its 500 machines a page, with their slots and the proxy's health
  and load; its counts over all 500), a small app's, a running machine's (its config, events,
  log tail and placement decision: calls to flaps and the worker), and the live events;
- in a real browser (headless chromium, bench.browser; skipped with the reason when it is not
  installed): the same HTML pages navigated to, until the load event (the server's answer,
  the parsing and the layout of the page, its stylesheet and script); each page opens its own
  stream too, as it does for a user.

Targets: p95 of every page at most 200 ms. `python -m bench --only console [--quick]`.
Bounded: a fixed number of loads, every wait and request has a deadline, and the cluster's
set-up is cut off after RUN_DEADLINE.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import secrets
import shutil
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from bench import browser, procs, report
from bench.procs import progress
from bench.proxy_control_bench import Fleet, Service
from bench.report import Results, percentile
from flaps.v1.platform_pb2 import WORKER_STATUS_ALIVE
from flyd.v1 import machine_pb2 as pb
from model.images.owners import PUBLIC
from model.tokens import read_token
from model.validate import DEFAULT_DISK_MIB
from nonomad.cli_local import build_demo
from nonomad.client import Client
from nonomad.console.login import login_url
from nonomad.security import ClusterSecurity, provision
from runtime import CLUSTER_PREFIX

RUN_DEADLINE = 300.0
WAIT = 60.0  # any single wait
TARGET_MS = 200.0
MACHINES = 1000
BIG = 500  # machines of app `big`, half of them standbys
APPS = 9  # the other apps, sharing the rest
RUNNING = 6  # big's primaries that run
CONCURRENT_CREATES = 16
REGIONS = {"ams": ("ams-1", "ams-2"), "syd": ("syd-1", "syd-2")}


def _guest() -> pb.GuestConfig:
    return pb.GuestConfig(cpu_millicores=10, memory_mib=16)


def _config() -> pb.MachineConfig:
    return pb.MachineConfig(
        image="demo:v1",
        guest=_guest(),
        services=[pb.ServiceConfig(internal_port=8080, autostart=False)],
    )


class Cluster:
    """The secure local cluster: workers, flaps, proxy, console (bench.proxy_control_bench's
    process plumbing)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.fleet = Fleet(root, f"nonomad-bench-{secrets.token_hex(4)}", procs.clean_env())
        self.security: ClusterSecurity = provision(
            root / "security",
            ["flaps", "proxy", "console", *(f"flyd-{w}" for ws in REGIONS.values() for w in ws)],
        )
        self.console = ""

    def start(self) -> None:
        s = self.security
        flaps = self.fleet.add(
            "flaps", ["--listen", "127.0.0.1:0", "--grace-period", "2", *s.flaps_args()]
        )
        cluster = flaps.announced[CLUSTER_PREFIX]
        workers = []
        for n, (region, ids) in enumerate((r, w) for r, ws in REGIONS.items() for w in ws):
            low = 31000 + 1000 * n  # a port for each machine's service, launched or not
            args = [
                "--listen", "127.0.0.1:0",
                "--data-dir", str(self.root / ids),
                "--image-source", str(self.root / "images"),
                "--worker-id", ids,
                "--region", region,
                "--ports", f"{low}-{low + 999}",
                "--cgroup-prefix", self.fleet.prefix,
                "--grace-period", "2",
                "--driver", "process",
                "--capacity.machines", "1000",
                "--capacity.cpu-millicores", "16000",
                "--capacity.memory-mib", "16384",
                "--capacity.disk-mib", str(1000 * DEFAULT_DISK_MIB),
                "--announce", cluster,
                *s.worker_args(ids),
            ]  # fmt: skip
            worker = Service("flyd", args, self.root / "logs" / f"{ids}.log", self.fleet.env)
            self.fleet.services.append(worker)
            self.fleet.workers[ids] = worker
            workers.append(worker.start())
        follow = [arg for w in workers for arg in ("--workers", w.address)]
        proxy = self.fleet.add(
            "proxy",
            [
                *("--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0"),
                *("--flaps", cluster, "--peers", cluster, "--region", "ams"),
                *follow,
                *s.proxy_args(),
            ],
        )
        console = self.fleet.add(
            "nonomad.console",
            [
                *("--listen", "127.0.0.1:0", "--flaps", flaps.address),
                *("--upstream", cluster, "--proxy", proxy.address),
                *s.console_args(),
            ],
        )
        self.console = console.address
        self.flaps = flaps.address

    def client(self) -> Client:
        return Client(
            self.flaps,
            tls=self.security.client_tls(),
            token_file=self.security.admin_token,
            timeout=30,
        )


async def _fill(client: Client) -> list[str]:
    """The 1,000 machines; returns the ids of big's running primaries."""
    config = _config()
    gate = asyncio.Semaphore(CONCURRENT_CREATES)

    async def make(app: str, launch: bool = False, standby_for: str = "") -> pb.Machine:
        async with gate:
            return await client.create_machine(
                app,
                config,
                region=region_of(app),
                skip_launch=not launch,
                standby_for=[standby_for] if standby_for else (),
            )

    def region_of(app: str) -> str:  # big and half the others in ams, the rest in syd
        return "ams" if app == "big" or int(app.rpartition("-")[2]) % 2 else "syd"

    async def slot(i: int) -> str:
        primary = await make("big", launch=i < RUNNING)
        await make("big", standby_for=primary.id)
        return primary.id

    others = [f"app-{i}" for i in range(APPS)]
    rest = [others[i % APPS] for i in range(MACHINES - BIG)]
    primaries = await asyncio.gather(*(slot(i) for i in range(BIG // 2)))
    await asyncio.gather(*(make(app) for app in rest))
    return list(primaries[:RUNNING])


def _login(address: str, token: str) -> str:
    """A session of the console for `token` (logged in as a program does): its Cookie header."""
    host, _, port = address.rpartition(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=WAIT)
    try:
        bearer = {"Authorization": f"Bearer {token}", "Accept": "application/json"}
        conn.request("POST", "/login", headers=bearer)
        reply = conn.getresponse()
        reply.read()
        if reply.status != 200:
            raise RuntimeError(f"POST /login: {reply.status}")
        cookies = reply.headers.get_all("Set-Cookie") or []
    finally:
        conn.close()
    (session,) = [c for c in cookies if c.startswith("nonomad-console-")]
    return session.partition(";")[0]


class Http:
    """One kept-alive connection to the console, with a session's cookie."""

    def __init__(self, address: str, cookie: str) -> None:
        host, _, port = address.rpartition(":")
        self.conn = http.client.HTTPConnection(host, int(port), timeout=WAIT)
        self.cookie = cookie

    def get(self, path: str, accept: str = "text/html") -> tuple[int, bytes, float]:
        """(status, body, milliseconds from sending the request to the body's last byte)."""
        t0 = time.perf_counter()
        self.conn.request("GET", path, headers={"Accept": accept, "Cookie": self.cookie})
        reply = self.conn.getresponse()
        body = reply.read()
        return reply.status, body, (time.perf_counter() - t0) * 1000

    def json(self, path: str) -> Any:
        status, body, _ = self.get(path, "application/json")
        if status != 200:
            raise RuntimeError(f"GET {path}: {status} {body[:200]!r}")
        return json.loads(body)


class OpenStream:
    """A page's live stream held open, read as it comes (in a thread, so it never backs up)
    until `close`."""

    def __init__(self, address: str, path: str, cookie: str) -> None:
        host, _, port = address.rpartition(":")
        self.path = path
        self.conn = http.client.HTTPConnection(host, int(port), timeout=WAIT)
        self.conn.request("GET", path, headers={"Accept": "text/event-stream", "Cookie": cookie})
        self.reply = self.conn.getresponse()
        kind = self.reply.headers.get("Content-Type", "")
        if self.reply.status != 200 or not kind.startswith("text/event-stream"):
            raise RuntimeError(f"GET {path}: {self.reply.status} {kind}")
        assert self.conn.sock is not None
        self.conn.sock.settimeout(None)  # a quiet stream is fine; `close` ends the read
        self.received = 0
        self.started = threading.Event()
        self.thread = threading.Thread(target=self._read, name=f"stream {path}", daemon=True)
        self.thread.start()

    def _read(self) -> None:
        with contextlib.suppress(OSError, ValueError, http.client.HTTPException):
            while chunk := self.reply.read1(65536):
                self.received += len(chunk)
                self.started.set()

    @property
    def open(self) -> bool:
        return self.thread.is_alive()

    def close(self) -> None:
        # The socket shut ends the reader's read; the connection is closed once it is done
        # with it (closing it under the reader races it).
        if self.conn.sock is not None:
            with contextlib.suppress(OSError):
                self.conn.sock.shutdown(socket.SHUT_RDWR)
        self.thread.join(WAIT)
        self.conn.close()


def _open_streams(address: str, paths: list[str], cookie: str) -> list[OpenStream]:
    """Every stream open, each past its first event."""
    opened: list[OpenStream] = []
    try:
        for path in paths:
            opened.append(OpenStream(address, path, cookie))
        for stream in opened:
            if not stream.started.wait(WAIT):
                raise TimeoutError(f"{stream.path}: no first event")
    except BaseException:
        for stream in opened:
            stream.close()
        raise
    return opened


def _until(check: Callable[[], bool], what: str) -> None:
    end = time.monotonic() + WAIT
    while not check():
        if time.monotonic() > end:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.1)


def _record(res: Results, name: str, times: list[float], note: str) -> None:
    p50, p95 = percentile(times, 50), percentile(times, 95)
    res.add(
        name,
        round(p95, 1),
        "ms",
        ("<=", TARGET_MS),
        f"p50 {p50:.1f} ms, max {max(times):.1f} ms, {len(times)} loads; {note}",
    )


def _measure_http(res: Results, web: Http, pages: dict[str, str], loads: int) -> None:
    for name, path in pages.items():
        for kind, accept in (("html", "text/html"), ("json", "application/json")):
            times, size = [], 0
            web.get(path, accept)  # warm: the first load of a page fills no cache but pays
            for _ in range(loads):
                status, body, ms = web.get(path, accept)
                if status != 200:
                    raise RuntimeError(f"GET {path} ({kind}): {status} {body[:200]!r}")
                times.append(ms)
                size = len(body)
            _record(res, f"{name} {kind}: p95 over HTTP", times, f"{size:,} bytes")


def _measure_browser(
    res: Results, root: Path, address: str, pages: dict[str, str], loads: int, token: str
) -> None:
    if browser.MISSING:
        res.details["browser"] = f"not measured: {browser.MISSING}"
        return
    driver = browser.chromium(root / "profile", root / "logs" / "chromedriver.log", WAIT)
    try:
        driver.get(login_url(f"http://{address}", token))  # lands on the fleet, logged in
        if driver.execute_script("return location.pathname") != "/":
            raise RuntimeError("the browser did not log in with the one-time login URL")
        for name, path in pages.items():
            times = []
            for i in range(loads + 1):
                driver.get(f"http://{address}{path}")
                entry = driver.execute_script(
                    "const [n] = performance.getEntriesByType('navigation');"
                    "return n ? n.loadEventEnd - n.startTime : null;"
                )
                if entry is None:
                    raise RuntimeError(f"no navigation timing for {path}")
                if i:  # the first visit warms the browser's cache of the stylesheet and script
                    times.append(float(entry))
            errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
            if errors:
                raise RuntimeError(f"the browser logged errors on {path}: {errors[:3]}")
            _record(res, f"{name}: p95 in the browser", times, "navigation to the load event")
    finally:
        driver.quit()


async def _prepare(cluster: Cluster) -> list[str]:
    async with cluster.client() as client:
        ready = False
        end = time.monotonic() + WAIT
        while not ready:
            workers = await client.list_workers()
            ready = sum(1 for w in workers if w.status == WORKER_STATUS_ALIVE) == 4
            if time.monotonic() > end:
                raise TimeoutError("the four workers never all came alive at flaps")
            await asyncio.sleep(0.1)
        t0 = time.perf_counter()
        running = await _fill(client)
        progress(f"made {MACHINES} machines in {time.perf_counter() - t0:.1f}s")
        return running


def _run(res: Results, root: Path, quick: bool) -> None:
    cluster = Cluster(root)
    try:
        build_demo(root / "images", owners=PUBLIC)
        cluster.start()
        progress("cluster up")
        running = _run_async(_prepare(cluster))
        token = read_token(cluster.security.admin_token)
        cookie = _login(cluster.console, token)
        web = Http(cluster.console, cookie)

        def all_seen() -> bool:
            apps = web.json("/apps")["apps"]
            return sum(a["machines"] for a in apps) == MACHINES

        _until(all_seen, f"the console to see all {MACHINES} machines")
        machine = running[0]
        _until(lambda: bool(web.json(f"/machines/{machine}")["logs"]), "the machine's log")
        pages = {
            "fleet /": "/",
            "apps /apps": "/apps",
            f"app of {BIG} machines": "/apps/big",
            f"app of {(MACHINES - BIG) // APPS} machines": "/apps/app-0",
            "a running machine": f"/machines/{machine}",
            "live events /events": "/events",
        }
        loads = 10 if quick else 40
        paths = [
            "/live/fleet",
            "/live/apps/big?page=1",
            "/live/apps/app-0?page=1",
            f"/live/machines/{machine}",
            f"/live/machines/{machine}/logs",
            "/live/events",
        ]
        held = _open_streams(cluster.console, paths, cookie)
        try:
            load_before = os.getloadavg()[0]
            _measure_http(res, web, pages, loads)
            progress("measured over HTTP")
            _measure_browser(res, root, cluster.console, pages, loads // 2, token)
            ended = [s.path for s in held if not s.open]
            if ended:
                raise RuntimeError(f"streams ended during the timing: {ended}")
            res.details["streams_held_open"] = {s.path: f"{s.received:,} bytes" for s in held}
        finally:
            for stream in held:
                stream.close()
        res.add(
            "host load average (1 min), the higher of before and after",
            round(max(load_before, os.getloadavg()[0]), 1),
            "",
            note=f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after, on "
            f"{os.cpu_count()} cores: the browser's times grow with the host's other work",
        )
        res.details.update(machines=MACHINES, workers=4, loads_per_page=loads)
    finally:
        _run_async(cluster.fleet.close())


def _run_async(work: Awaitable[Any]) -> Any:
    async def bounded() -> Any:
        async with asyncio.timeout(RUN_DEADLINE):
            return await work

    return asyncio.run(bounded())


def run(*, quick: bool = False, out: Path | None = None, strict: bool = False) -> int:
    """Run once, print the table, write JSON to `out` when given. Returns 0, or 1 on an error
    (or, with `strict`, a missed target)."""
    res = Results(f"console: page loads with {MACHINES:,} machines{' (quick)' if quick else ''}")
    root = Path(tempfile.mkdtemp(prefix="nonomad-console-bench-"))
    t0 = time.perf_counter()
    try:
        _run(res, root, quick)
    except Exception as err:
        res.errors.append(f"{type(err).__name__}: {err}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    res.details["total_seconds"] = round(time.perf_counter() - t0, 1)
    return report.finish(res, out, strict)


def main(argv: list[str] | None = None) -> int:
    return report.main(run, "console_bench", __doc__, "10 loads of each page instead of 40", argv)


if __name__ == "__main__":
    sys.exit(main())
