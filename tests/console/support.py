"""What the console's in-process tests stand on: fakes of what the console reads (a replica
whose follow feed the test fills, flaps' calls, flaps' placement decisions), the real app over
them (`Console`), and a live stream read event by event as the browser would (`stream`)."""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, cast

import grpc
import httpx

from flaps.v1 import platform_pb2
from flyd.v1 import machine_pb2 as pb
from flyd.v1 import worker_pb2
from model.tokens import Denied, InvalidToken, Keyring, caveats
from nonomad.client import NotFound, PermissionDenied, Unauthenticated, Unavailable
from nonomad.console.access import TokenCheck
from nonomad.console.app import build
from nonomad.console.guard import Door, Served
from nonomad.console.live import Live
from nonomad.console.pages import Pages
from nonomad.console.sessions import LoginCodes, Sessions
from registry.replica import FOLLOW_RESYNC, Subscription, WorkerView
from registry.v1 import registry_pb2
from registry.view import ALIVE
from runtime.clock import ManualClock

S = pb.MachineState
T = 10.0  # any one wait; never reached when things work


def capacity(free_cpu: int = 4000, by_state: dict[str, int] | None = None) -> pb.Capacity:
    cap = pb.Capacity(
        total=pb.Resources(cpu_millicores=4000, memory_mib=4096, machines=100),
        free=pb.Resources(cpu_millicores=free_cpu, memory_mib=4096, machines=100),
        machines_by_state=by_state or {},
    )
    cap.images.add(ref="web:v1", digest="sha256:ab", size_bytes=1234)
    return cap


def machine(
    machine_id: str, app: str, worker: str = "w1", state: int = S.MACHINE_STATE_STARTED
) -> pb.Machine:
    m = pb.Machine(
        id=machine_id,
        app=app,
        region="ams",
        worker_id=worker,
        state=state,  # type: ignore[arg-type]
        config=pb.MachineConfig(image="web:v1", secrets={"API_KEY": "<redacted>"}),
    )
    m.slot.CopyFrom(pb.SlotState(id=machine_id, primary=machine_id))
    return m


class FakeReplica:
    """What the console reads of its replica, set by the test; `changed` and `worker_changed`
    put on the follow feed what a real replica would after applying the same change."""

    def __init__(self) -> None:
        self.clock = ManualClock(100.0)
        self.views: dict[str, WorkerView] = {}
        self.rows: dict[str, pb.Machine] = {}
        self.feed: Subscription[registry_pb2.FollowResponse] | None = None
        self.following = asyncio.Event()

    def add_worker(self, worker_id: str, status: int = ALIVE, **cap: Any) -> None:
        info = pb.WorkerInfo(id=worker_id, region="ams", address="127.0.0.1:1")
        view = WorkerView(info, status, 99.0, capacity(**cap), 1, True)  # type: ignore[arg-type]
        self.views[worker_id] = view

    # -- the replica's reads -------------------------------------------------------------------

    def follow(self) -> Subscription[registry_pb2.FollowResponse]:
        self.feed = Subscription(256, FOLLOW_RESYNC)
        self.following.set()
        return self.feed

    def workers(self) -> list[WorkerView]:
        return list(self.views.values())

    def worker(self, worker_id: str) -> WorkerView | None:
        return self.views.get(worker_id)

    def machines(self, *, app: str | None = None) -> list[pb.Machine]:
        return [m for m in self.rows.values() if app is None or m.app == app]

    def machine(self, machine_id: str) -> pb.Machine | None:
        return self.rows.get(machine_id)

    def apps(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for m in self.rows.values():
            counts[m.app] = counts.get(m.app, 0) + 1
        return counts

    # -- changes -------------------------------------------------------------------------------

    def changed(self, m: pb.Machine, seq: int, was: int, why: str = "") -> None:
        """`m` (the new row) went from state `was` in its worker's step `seq`."""
        self.rows[m.id] = m
        event = pb.MachineEvent(
            seq=seq, machine_id=m.id, type="stop", from_state=was, to_state=m.state, reason=why
        )  # type: ignore[arg-type]
        event.time.FromSeconds(1_700_000_000 + seq)
        change = worker_pb2.MachineChange(event=event, machine=m)
        item = worker_pb2.WatchEventsResponse(change=change)
        assert self.feed is not None
        self.feed.put(registry_pb2.FollowResponse(worker_id=m.worker_id, item=item))

    def worker_changed(self, worker_id: str, status: int | None = None, **cap: Any) -> None:
        """A worker's liveness (`status`) or, with `cap`, its heartbeat's capacity changed."""
        view = self.views[worker_id]
        assert self.feed is not None
        if status is not None:
            self.views[worker_id] = WorkerView(
                view.info, status, view.last_heartbeat, view.capacity, view.seq, True
            )  # type: ignore[arg-type]
            self.feed.put(registry_pb2.FollowResponse(worker_id=worker_id))
        else:
            beat = worker_pb2.Heartbeat(seq=view.seq, capacity=capacity(**cap))
            self.views[worker_id] = WorkerView(
                view.info, view.status, 100.0, beat.capacity, view.seq, True
            )  # type: ignore[arg-type]
            item = worker_pb2.WatchEventsResponse(heartbeat=beat)
            self.feed.put(registry_pb2.FollowResponse(worker_id=worker_id, item=item))


class FakeFlaps:
    """flaps' calls the console makes, over the replica's rows. As flaps does, each call with a
    token (`with_token`: a session's) verifies it against `keyring` (at `now`, and not among
    `revoked` token ids), then checks its caveats for what the call reads; the console's own
    calls (no token) read everything."""

    def __init__(self, replica: FakeReplica, keyring: Keyring, now: Callable[[], float]) -> None:
        self.replica = replica
        self.keyring = keyring
        self.now = now
        self.token: str | None = None
        self.lines: asyncio.Queue[str] = asyncio.Queue(maxsize=16)
        self.shared = {"following_logs": 0, "token_calls": 0}
        self.revoked: set[str] = set()
        self.down = False
        """When set, every call with a token is UNAVAILABLE."""

    @property
    def following_logs(self) -> int:
        """Log calls with follow open now (of every token)."""
        return self.shared["following_logs"]

    @property
    def token_calls(self) -> int:
        """Calls made with a token so far."""
        return self.shared["token_calls"]

    def with_token(self, token: str) -> FakeFlaps:
        other = copy.copy(self)
        other.token = token
        return other

    def _check(self, ops: tuple[str, ...], app: str | None, machine_id: str | None) -> None:
        if self.token is None:
            return
        self.shared["token_calls"] += 1
        if self.down:
            raise Unavailable(grpc.StatusCode.UNAVAILABLE, "flaps is down")
        try:
            grant = self.keyring.verify(self.token, now=self.now())
        except InvalidToken as err:
            raise Unauthenticated(
                grpc.StatusCode.UNAUTHENTICATED, f"authorization: {err}"
            ) from None
        if grant.token_id in self.revoked:
            raise Unauthenticated(
                grpc.StatusCode.UNAUTHENTICATED, f"token {grant.token_id} is revoked"
            )
        try:
            grant.check(ops, app, machine_id)
        except Denied as err:
            raise PermissionDenied(grpc.StatusCode.PERMISSION_DENIED, str(err)) from None

    async def list_machines(
        self, app: str, *, limit: int | None = None, **_: Any
    ) -> list[pb.Machine]:
        self._check(("read",), app or None, None)
        rows = [m for m in self.replica.rows.values() if not app or m.app == app]
        return rows[:limit]

    def _row(self, machine_id: str) -> pb.Machine:
        row = self.replica.machine(machine_id)
        self._check(("read",), row.app if row is not None else None, machine_id)
        if row is None:
            raise NotFound(grpc.StatusCode.NOT_FOUND, f"machine {machine_id} not found")
        return row

    async def get_machine(self, machine_id: str, *, timeout: float | None = None) -> pb.Machine:
        return self._row(machine_id)

    async def list_machine_events(
        self, machine_id: str, *, timeout: float | None = None
    ) -> list[pb.MachineEvent]:
        row = self._row(machine_id)
        return [
            pb.MachineEvent(seq=1, type="create", to_state=S.MACHINE_STATE_CREATED),
            pb.MachineEvent(seq=2, type="start", to_state=row.state),
        ]

    async def get_placement(
        self, machine_id: str, *, timeout: float | None = None
    ) -> pb.PlacementDecision | None:
        row = self._row(machine_id)
        decision = pb.PlacementDecision(worker_id=row.worker_id, sample_size=2)
        decision.regions.add(region="ams", outcome="placed", examined=2).candidates.add(
            worker_id=row.worker_id, score=0.9, sub_scores={"cpu": 0.8}
        )
        return decision

    async def machine_logs(
        self, machine_id: str, *, tail_lines: int = 100, follow: bool = False, **_: Any
    ) -> AsyncIterator[str]:
        self._row(machine_id)
        self.shared["following_logs"] += follow
        try:
            yield "booted"
            while follow:
                yield await self.lines.get()
        finally:
            self.shared["following_logs"] -= follow


class Placements:
    """flaps' placement decisions as the test hands them over."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[platform_pb2.PlacementEvent] = asyncio.Queue(maxsize=16)

    async def __call__(
        self, subscribed: Any
    ) -> AsyncIterator[platform_pb2.WatchPlacementsResponse]:
        subscribed()
        while True:
            yield platform_pb2.WatchPlacementsResponse(event=await self.queue.get())


HOST = "console.test"
ORIGIN = f"http://{HOST}"


def new_keyring() -> Keyring:
    return Keyring([("k1", b"k" * 32)])


class Console:
    """The console's app over the fakes, with its `Live` running, serving on `HOST`: tokens
    minted with `keyring`, sessions and login codes on `clock`. `http` is a browser-like
    client (it keeps cookies); `login()` logs it in."""

    def __init__(self, keyring: Keyring | None = None) -> None:
        self.replica = FakeReplica()
        self.replica.add_worker("w1", free_cpu=3800)
        self.replica.add_worker("w2")
        for i, worker in enumerate(("w1", "w1", "w2")):
            m = machine(f"w{i}-web", "web", worker)
            self.replica.rows[m.id] = m
        self.clock = ManualClock()
        self.keyring = keyring or new_keyring()
        self.admin = self.keyring.mint(caveats(apps=["*"], ops=["*"]))
        self.flaps = FakeFlaps(self.replica, self.keyring, self.clock.now)
        self.placements = Placements()
        replica, flaps = cast(Any, self.replica), cast(Any, self.flaps)
        self.live = Live(replica, self.placements)
        self.pages = Pages(replica, flaps, None, self.live, clock=self.replica.clock.now)
        self.closing = asyncio.Event()
        self.sessions = Sessions(self.clock.now)
        self.codes = LoginCodes(self.clock.now)
        served = Served.of("127.0.0.1", 80, names=[HOST])
        check = TokenCheck(flaps, self.clock.now)
        self.door = Door(served, self.sessions, self.codes, check, flaps)
        self.app = build(self.pages, self.live, self.closing, self.door)
        self.http = self.client()

    def client(self) -> httpx.AsyncClient:
        """A new client of the console, with no cookies."""
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url=ORIGIN)

    async def login(self, token: str | None = None, http: httpx.AsyncClient | None = None) -> Any:
        """Log `http` (the console's own client by default) in with `token` (the admin's), as
        a program does (`Authorization: Bearer`); the scope the console answers."""
        reply = await (http or self.http).post(
            "/login",
            headers={
                "Authorization": f"Bearer {token or self.admin}",
                "Accept": "application/json",
            },
            timeout=T,
        )
        assert reply.status_code == 200, reply.text
        return reply.json()

    async def get(self, path: str, *, as_json: bool = False) -> httpx.Response:
        accept = "application/json" if as_json else "text/html,application/xhtml+xml"
        return await self.http.get(path, headers={"Accept": accept}, timeout=T)

    async def json(self, path: str) -> Any:
        reply = await self.get(path, as_json=True)
        assert reply.status_code == 200, reply.text
        assert reply.headers["content-type"] == "application/json"
        return reply.json()


class Stream:
    """One live stream of the app, read event by event as it is sent (httpx's ASGITransport
    hands over a body only once it is whole, and a page's stream does not end); leaving it
    disconnects, as a closed tab does."""

    def __init__(self) -> None:
        self.chunks: asyncio.Queue[bytes] = asyncio.Queue(maxsize=256)
        self.started: asyncio.Future[tuple[int, dict[str, str]]] = (
            asyncio.get_running_loop().create_future()
        )
        self.gone = asyncio.Event()
        self.ended = asyncio.Event()
        """Set when the app ended the stream."""
        self.text = ""

    async def next(self, name: str | None = None) -> tuple[str, Any]:
        """The next event (of kind `name`, skipping others), as (kind, its data)."""
        async with asyncio.timeout(T):
            while True:
                while "\n\n" not in self.text:
                    self.text += (await self.chunks.get()).decode()
                block, self.text = self.text.split("\n\n", 1)
                fields = dict(
                    line.split(": ", 1) for line in block.split("\n") if not line.startswith(":")
                )
                if "event" in fields and name in (None, fields["event"]):
                    return fields["event"], json.loads(fields["data"])

    async def patch(self) -> dict[str, str]:
        return cast(dict[str, str], (await self.next("patch"))[1])


@asynccontextmanager
async def stream(
    c: Console, path: str, http: httpx.AsyncClient | None = None
) -> AsyncIterator[Stream]:
    """The stream at `path`, opened with the cookies of `http` (the console's client)."""
    http = http or c.http
    s = Stream()
    target, _, query = path.partition("?")
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": target,
        "raw_path": target.encode(),
        "query_string": query.encode(),
        "headers": [
            (b"host", HOST.encode()),
            (b"accept", b"text/event-stream"),
            (b"cookie", "; ".join(f"{k}={v}" for k, v in http.cookies.items()).encode()),
        ],
        "server": ("console.test", 80),
        "client": ("127.0.0.1", 1),
        "root_path": "",
    }
    asked = False

    async def receive() -> dict[str, Any]:
        nonlocal asked
        if not asked:
            asked = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await s.gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            headers = {k.decode(): v.decode() for k, v in message["headers"]}
            s.started.set_result((message["status"], headers))
        elif message.get("body"):
            await s.chunks.put(message["body"])
        if message["type"] == "http.response.body" and not message.get("more_body"):
            s.ended.set()

    task = asyncio.create_task(c.app(scope, receive, send))  # type: ignore[arg-type]
    try:
        status, headers = await asyncio.wait_for(s.started, T)
        assert (status, headers["content-type"]) == (200, "text/event-stream; charset=utf-8")
        yield s
    finally:
        s.gone.set()
        await asyncio.wait_for(task, T)
