"""The console's web app in process, without a browser or a cluster: the real Starlette app,
`Pages` and `Live` over fakes of what they read (a replica whose follow feed the test fills,
flaps' calls, flaps' placement decisions). Pages and their JSON twins through httpx's
ASGITransport; the live streams read event by event as the browser would
(`tests.console.support.stream`)."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest

from flaps.v1 import platform_pb2
from flyd.v1 import machine_pb2 as pb
from nonomad.console import model, streams
from nonomad.console.access import EVERYTHING
from nonomad.console.live import Notice
from nonomad.console.pages import Pages
from registry.view import DEAD
from tests.console.support import Console, FakeReplica, S, T, machine, stream

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
    pages = Pages(cast(Any, replica), cast(Any, None), None, cast(Any, None), scope=EVERYTHING)
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
