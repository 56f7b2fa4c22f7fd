"""The console's web app in process, without a browser or a cluster: the real Starlette app,
`Pages` and `Live` over fakes of what they read (a replica whose follow feed the test fills,
flaps' calls, flaps' placement decisions). Pages and their JSON twins through httpx's
ASGITransport; the live streams read event by event as the browser would (see `Stream`)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, cast

import grpc
import httpx
import pytest

from flaps.v1 import platform_pb2
from flyd.v1 import machine_pb2 as pb
from flyd.v1 import worker_pb2
from nonomad.client import NotFound
from nonomad.console import model, streams
from nonomad.console.app import build
from nonomad.console.live import Live, Notice
from nonomad.console.pages import Pages
from registry.replica import FOLLOW_RESYNC, Subscription, WorkerView
from registry.v1 import registry_pb2
from registry.view import ALIVE, DEAD
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
    """flaps' calls the console makes for a machine's page, over the replica's rows."""

    def __init__(self, replica: FakeReplica) -> None:
        self.replica = replica
        self.lines: asyncio.Queue[str] = asyncio.Queue(maxsize=16)
        self.following_logs = 0
        """Log calls with follow open now."""

    def _row(self, machine_id: str) -> pb.Machine:
        row = self.replica.machine(machine_id)
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
        self.following_logs += follow
        try:
            yield "booted"
            while follow:
                yield await self.lines.get()
        finally:
            self.following_logs -= follow


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


class Console:
    """The console's app over the fakes, with its `Live` running."""

    def __init__(self) -> None:
        self.replica = FakeReplica()
        self.replica.add_worker("w1", free_cpu=3800)
        self.replica.add_worker("w2")
        for i, worker in enumerate(("w1", "w1", "w2")):
            m = machine(f"w{i}-web", "web", worker)
            self.replica.rows[m.id] = m
        self.flaps = FakeFlaps(self.replica)
        self.placements = Placements()
        replica, flaps = cast(Any, self.replica), cast(Any, self.flaps)
        self.live = Live(replica, self.placements)
        self.pages = Pages(replica, flaps, None, self.live, clock=self.replica.clock.now)
        self.closing = asyncio.Event()
        self.app = build(self.pages, self.live, self.closing)
        self.http = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=self.app), base_url="http://console.test"
        )

    async def get(self, path: str, *, as_json: bool = False) -> httpx.Response:
        accept = "application/json" if as_json else "text/html,application/xhtml+xml"
        return await self.http.get(path, headers={"Accept": accept}, timeout=T)

    async def json(self, path: str) -> Any:
        reply = await self.get(path, as_json=True)
        assert reply.status_code == 200, reply.text
        assert reply.headers["content-type"] == "application/json"
        return reply.json()


@pytest.fixture
async def console(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Console]:
    monkeypatch.setattr(streams, "COALESCE", 0.0)  # no wait for the rest of a burst
    c = Console()
    shutdown = asyncio.Event()
    running = asyncio.create_task(c.live.run(shutdown))
    async with asyncio.timeout(T):
        await c.replica.following.wait()
        await c.live.placements_watched.wait()
    try:
        yield c
    finally:
        c.closing.set()
        shutdown.set()
        await asyncio.wait_for(running, T)
        await c.http.aclose()


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
async def stream(c: Console, path: str) -> AsyncIterator[Stream]:
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
        "headers": [(b"accept", b"text/event-stream")],
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


# -- routing -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "status", "reason"),
    [
        ("/apps/nothing-here", 404, "no machine of app nothing-here is known"),
        ("/apps/web?page=0", 400, "page: must be a page number, 1 or more"),
        ("/apps/web?page=two", 400, "page: must be a page number, 1 or more"),
        ("/apps/web?page=2", 404, "page: app web has 1 pages"),
        ("/apps/Not_An_App", 400, "app: "),
        ("/machines/w9-nothing", 404, "machine w9-nothing not found"),
        ("/machines/BAD.ID", 400, "machine_id: "),
        ("/events?app=Bad_App", 400, "app: "),
        ("/live/apps/web?page=-1", 400, "page: must be a page number, 1 or more"),
        ("/live/fleet?after=soon", 400, "after: must be a feed item number"),
        ("/live/machines/w9-nothing/logs", 404, "machine w9-nothing not found"),
        ("/nowhere", 404, "Not Found"),
    ],
)
async def test_bad_input_is_a_400_and_the_unknown_a_404_each_with_its_reason(
    console: Console, path: str, status: int, reason: str
) -> None:
    reply = await console.get(path, as_json=True)
    assert reply.status_code == status
    assert reply.json()["status"] == status
    assert reply.json()["reason"].startswith(reason)
    # A browser gets the same as a page.
    page = await console.get(path)
    assert page.status_code == status
    if not path.startswith("/live/"):
        assert page.headers["content-type"].startswith("text/html")
        assert f"<h1>{status}</h1>" in page.text


async def test_every_page_answers_html_or_its_json_twin(console: Console) -> None:
    fleet = await console.json("/")
    assert [w["id"] for w in fleet["workers"]] == ["w1", "w2"]
    assert fleet["workers"][0]["cpu"] == {"reserved": 200, "total": 4000, "percent": 5.0}
    assert fleet["apps"] == [{"name": "web", "machines": 3}]
    html = (await console.get("/")).text
    assert 'id="worker-w1" data-status="alive"' in html
    assert 'data-live="/live/fleet"' in html

    assert (await console.json("/apps"))["apps"] == fleet["apps"]
    assert 'href="/apps/web"' in (await console.get("/apps")).text

    app = await console.json("/apps/web")
    assert [m["id"] for m in app["machines"]] == ["w0-web", "w1-web", "w2-web"]
    assert app["proxy_error"] == "no proxy configured"
    assert 'data-live="/live/apps/web?page=1"' in (await console.get("/apps/web")).text

    shown = await console.json("/machines/w0-web")
    assert shown["machine"]["state"] == "started"
    assert shown["config"]["secrets"] == {"API_KEY": "<redacted>"}
    assert shown["placement"]["regions"][0]["candidates"][0]["chosen"] is True
    assert shown["logs"] == ["booted"]
    assert [e["seq"] for e in shown["events"]] == [1, 2]

    events = await console.json("/events")
    assert events == {"events": [], "last_seq": 0, "placements_watched": True}
    assert 'id="feed"' in (await console.get("/events")).text


# -- live streams ------------------------------------------------------------------------------


async def test_the_fleet_stream_patches_a_worker_as_its_heartbeat_and_liveness_change(
    console: Console,
) -> None:
    async with stream(console, "/live/fleet") as s:
        first = await s.patch()
        assert set(first) == {"regions", "workers", "fleet-states", "apps-list"}
        assert 'id="worker-w2" data-status="alive"' in first["workers"]

        # w2's heartbeat: it runs two machines now.
        console.replica.worker_changed("w2", free_cpu=3800, by_state={"started": 2})
        beat = await s.patch()
        assert "worker-w1" not in beat  # only the worker that changed
        assert "<b>200</b> / 4000 m" in beat["worker-w2"]
        assert '<b class="total">2</b>' in beat["worker-w2"]
        assert "<b>400</b> / 8000 m" in beat["regions"]

        # w2 dies: the feed says so, the row turns dead.
        console.replica.worker_changed("w2", status=DEAD)
        kind, item = await s.next()
        assert (kind, 'data-kind="worker_dead"' in item) == ("feed", True)
        dead = await s.patch()
        assert 'data-status="dead"' in dead["worker-w2"]
        assert "<b>1</b> of 2 workers alive" in dead["regions"]


async def test_an_app_stream_follows_its_page_only_and_its_counts_over_every_page(
    console: Console,
) -> None:
    for i in range(150):
        m = machine(f"w1-big-{i:03d}", "big")
        console.replica.rows[m.id] = m
    async with stream(console, "/live/apps/big?page=1") as s:
        first = await s.patch()
        assert first["machines"].count('<tr id="m-') == model.PAGE_ROWS
        assert '<p class="big">150</p>' in first["app-summary"]
        assert "machines 1\N{EN DASH}100 of 150" in first["pager"]

        # A machine on page 2 stops: the counts change, not a row of this page.
        off_page = console.replica.rows["w1-big-120"]
        stopped = pb.Machine()
        stopped.CopyFrom(off_page)
        stopped.state = S.MACHINE_STATE_STOPPED
        console.replica.changed(stopped, 5, S.MACHINE_STATE_STARTED)
        patch = await s.patch()
        assert set(patch) == {"app-summary"}  # (the pager's counts did not change)
        assert "1 stopped" in patch["app-summary"]

        # One on this page stops: its row alone.
        on_page = pb.Machine()
        on_page.CopyFrom(console.replica.rows["w1-big-007"])
        on_page.state = S.MACHINE_STATE_STOPPED
        console.replica.changed(on_page, 6, S.MACHINE_STATE_STARTED, "requested by client")
        kind, item = await s.next()  # (the app's feed items are only the app's own)
        assert kind == "feed"
        assert 'data-machine="w1-big-007"' in item
        assert "requested by client" in item
        patch = await s.patch()
        assert set(patch) == {"m-w1-big-007", "app-summary"}
        assert 'data-state="stopped"' in patch["m-w1-big-007"]

        # A machine of another app changes nothing here.
        other = machine("w1-web", "web")
        console.replica.changed(other, 7, S.MACHINE_STATE_CREATED)
        # ... and a new machine sorted into page 1 redraws the table.
        console.replica.changed(machine("w1-big-000a", "big"), 8, S.MACHINE_STATE_CREATED)
        patch = await s.patch()
        assert "m-w1-web" not in patch
        assert "w1-web" not in patch["machines"]
        assert 'id="m-w1-big-000a"' in patch["machines"]
        assert "machines 1\N{EN DASH}100 of 151" in patch["pager"]


async def test_a_machine_stream_appends_its_events_and_patches_its_summary(
    console: Console,
) -> None:
    async with stream(console, "/live/machines/w0-web") as s:
        first = await s.patch()
        assert 'data-state="started"' in first["machine-summary"]
        assert first["events"].count("<tr data-seq=") == 2

        stopped = pb.Machine()
        stopped.CopyFrom(console.replica.rows["w0-web"])
        stopped.state = S.MACHINE_STATE_STOPPED
        console.replica.changed(stopped, 3, S.MACHINE_STATE_STARTED, "requested by client")
        _, row = await s.next("append")
        assert row["target"] == "events"
        assert '<tr data-seq="3">' in row["html"]
        assert "requested by client" in row["html"]
        patch = await s.patch()
        assert 'data-state="stopped"' in patch["machine-summary"]


async def test_the_events_stream_carries_placements_refusals_and_deaths(console: Console) -> None:
    async with stream(console, "/live/events") as s, stream(console, "/live/events?app=web") as web:
        await console.placements.queue.put(
            platform_pb2.PlacementEvent(
                app="web", region="ams", outcome="placed", machine_id="w1-new", worker_id="w1",
                score=0.75, candidates=2,
            )
        )  # fmt: skip
        await console.placements.queue.put(
            platform_pb2.PlacementEvent(
                app="huge", region="ams", outcome="exhausted",
                rejections_by_reason={"insufficient_memory": 2},
            )
        )  # fmt: skip
        console.replica.worker_changed("w1", status=DEAD)
        said = [(await s.next("feed"))[1] for _ in range(3)]
        assert 'data-kind="placed"' in said[0]
        assert "placed on w1 (score 0.750" in said[0]
        assert 'data-kind="refused"' in said[1]
        assert "2 insufficient_memory" in said[1]
        assert 'data-kind="worker_dead"' in said[2]
        # The app's stream has the app's item only.
        _, only = await web.next("feed")
        assert 'data-machine="w1-new"' in only
    assert [i["kind"] for i in (await console.json("/events"))["events"]] == [
        "worker_dead",
        "refused",
        "placed",
    ]
    assert [i["kind"] for i in (await console.json("/events?app=web"))["events"]] == ["placed"]
    # A page rendered after item 2 asks for the rest only, also after a reconnect.
    async with stream(console, "/live/events?after=2") as s:
        _, item = await s.next("feed")
        assert 'data-seq="3"' in item


async def test_a_machine_log_stream_sends_its_tail_then_each_line(console: Console) -> None:
    async with stream(console, "/live/machines/w0-web/logs") as s:
        assert await s.next() == ("tail", [])
        assert await s.next() == ("line", "booted")
        await console.flaps.lines.put("GET / 200")
        assert await s.next() == ("line", "GET / 200")
        # The console closes: the stream ends (its log call with it), the page is still open.
        console.closing.set()
        await asyncio.wait_for(s.ended.wait(), T)
        assert console.flaps.following_logs == 0
    # A page that goes away ends its stream too (the log call is closed, not left running).
    console.closing.clear()
    async with stream(console, "/live/machines/w0-web/logs") as s:
        assert await s.next() == ("tail", [])
        assert await s.next() == ("line", "booted")
        assert console.flaps.following_logs == 1
    assert console.flaps.following_logs == 0


async def test_an_app_view_renders_only_the_rows_of_its_page() -> None:
    """A change to a machine on another page re-counts, and renders no row of it (the view
    once looked it up among its own rows, and the stream died of the KeyError)."""
    replica = FakeReplica()
    replica.add_worker("w1")
    for i in range(150):
        m = machine(f"w1-big-{i:03d}", "big")
        replica.rows[m.id] = m
    pages = Pages(cast(Any, replica), cast(Any, None), None, cast(Any, None))
    view = streams.AppView(pages, "big", page=1)
    await view.full()
    on_page2 = pb.Machine()
    on_page2.CopyFrom(replica.rows["w1-big-140"])
    on_page2.state = S.MACHINE_STATE_STOPPED
    replica.rows[on_page2.id] = on_page2
    view.note(Notice("machine", "w1", on_page2.id, "big", row=on_page2))
    assert not view.dirty
    out = await view.patches()
    assert set(out) == {"app-summary", "pager"}
    assert '<p class="big">150</p>' in out["app-summary"]
    assert "1 stopped" in out["app-summary"]
    assert await view.patches() == {}  # nothing more changed
