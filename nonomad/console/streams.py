"""The live parts of each page, as server-sent events.

An open page holds one stream (`serve`): first the feed items it has not shown (those after the
`after` it was rendered with, or the browser's Last-Event-ID on a reconnect), then its live
parts rendered afresh (whatever changed between the page's render and the stream's start is
in them), then, as notices arrive from `Live` (gathered for `COALESCE` seconds, so a burst is
one update), the fragments that changed: `patch` {element id: HTML}, `feed` (an item's HTML),
`append` (a row for a table). Nothing is sent for a notice that changes nothing on the page.

What only the proxy knows (health, load, traffic) is not on any stream: an app's page asks
the proxy again every `TICK` seconds while it is open.

A stream carries only what its session may see (feed items through `Scope.item`, the views'
data through their scoped `Pages`), and ends when the session does (`stops`). A log stream
sends each line cut to `LINE_MAX` characters: the page keeps its last 500.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Sequence
from typing import TypeVar

from nonomad.client import ApiError, Client
from nonomad.console import model
from nonomad.console.access import Scope
from nonomad.console.live import RESYNC, Live, Notice
from nonomad.console.pages import LOG_TAIL, RPC_TIMEOUT, Pages
from nonomad.console.render import KEEPALIVE, part, sse
from registry.replica import SubscriptionClosed

__all__ = [
    "AppView",
    "EventsView",
    "FleetView",
    "LiveView",
    "MachineView",
    "logs",
    "serve",
    "until",
]

COALESCE = 0.2
KEEPALIVE_AFTER = 15.0
TICK = 5.0
LINE_MAX = 8192

T = TypeVar("T")
Patches = dict[str, str]


class LiveView:
    """One open page's live parts: what it shows afresh, what a notice makes stale."""

    tick: float | None = None
    """Seconds between `on_tick` calls; None: none."""

    def wants(self, item: model.Data) -> bool:
        """Whether the page's feed shows this item."""
        return True

    async def full(self) -> Patches:
        return {}

    def note(self, notice: Notice) -> None:
        """Take a notice in; `patches` then renders what it made stale."""

    async def patches(self) -> Patches:
        return {}

    def appends(self) -> list[model.Data]:
        """Rows to add to tables ({"target": element id, "html": ...}) since the last call."""
        return []

    async def on_tick(self) -> Patches:
        return {}


class EventsView(LiveView):
    """The events page: its feed (of one app, or all), nothing else."""

    def __init__(self, app: str = "") -> None:
        self.app = app

    def wants(self, item: model.Data) -> bool:
        return not self.app or item["app"] == self.app


class FleetView(LiveView):
    """Regions and workers: a worker's row when its heartbeat or status changes; everything
    when a worker joins or leaves."""

    def __init__(self, pages: Pages) -> None:
        self.pages = pages
        self.known: set[str] = set()
        self.dirty: set[str] = set()
        self.everything = False

    async def full(self) -> Patches:
        data = self.pages.fleet()
        self.known = {w["id"] for w in data["workers"]}
        self.dirty.clear()
        self.everything = False
        return {
            "regions": part("regions", data),
            "workers": part("workers", data),
            "fleet-states": _states(data["machines_by_state"]),
            "apps-list": part("apps", data),
        }

    def note(self, notice: Notice) -> None:
        if notice is RESYNC or (notice.worker_id and notice.worker_id not in self.known):
            self.everything = True
        elif notice.kind in ("capacity", "status", "snapshot"):
            self.dirty.add(notice.worker_id)
        elif notice.kind == "machine":
            self.dirty.add("")  # the apps list

    async def patches(self) -> Patches:
        if self.everything or not (self.dirty or self.known):
            return await self.full()
        data = self.pages.fleet()
        if {w["id"] for w in data["workers"]} != self.known:
            return await self.full()
        out = {
            "regions": part("regions", data),
            "fleet-states": _states(data["machines_by_state"]),
        }
        if "" in self.dirty:
            out["apps-list"] = part("apps", data)
        for w in data["workers"]:
            if w["id"] in self.dirty:
                out[f"worker-{w['id']}"] = part("worker_row", w)
        self.dirty.clear()
        return out


def _states(states: dict[str, int]) -> str:
    return f'<div id="fleet-states" class="muted">{part("by_state", states)}</div>'


class AppView(LiveView):
    """An app's machines (one page of them): a row when its machine changes or its worker's
    status does; the table when the page's machines come or go; the summary and the pager
    (counts over the whole app) with any machine of the app. Every `TICK` seconds, the proxy's
    view (health, load, traffic) again."""

    tick = TICK

    def __init__(self, pages: Pages, app: str, page: int = 1) -> None:
        self.pages = pages
        self.app = app
        self.page = page
        self.routes: dict[str, object] | None = None
        self.error = ""
        self.traffic: model.Data | None = None
        self.rows: dict[str, model.Data] = {}
        self.dirty: set[str] = set()
        # A machine of the app off this page changed: the counts, and maybe which machines
        # this page holds (one came, went, or moved between pages).
        self.elsewhere = False
        self.everything = False

    def wants(self, item: model.Data) -> bool:
        return bool(item["app"] == self.app)

    async def _ask_proxy(self) -> None:
        (routes, self.error), self.traffic = await asyncio.gather(
            self.pages.routes(self.app), self.pages.traffic(self.app)
        )
        self.routes = routes  # type: ignore[assignment]

    def _data(self) -> model.Data:
        return model.app(
            self.app,
            self.pages.machines(self.app),
            self.pages.statuses(),
            self.routes,  # type: ignore[arg-type]
            self.traffic,
            self.error,
            self.page,
        )

    def _render(self, data: model.Data, rows: set[str] | None) -> Patches:
        """The summary, and the table (`rows` None) or those rows."""
        fresh = {r["id"]: r for r in data["machines"]}
        out = {"app-summary": part("app_summary", data), "pager": part("pager", data)}
        if rows is None or set(fresh) != set(self.rows):
            out["machines"] = part("machines", data)
        else:
            for machine_id in rows & fresh.keys():
                if fresh[machine_id] != self.rows[machine_id]:
                    out[f"m-{machine_id}"] = part("machine_row", fresh[machine_id])
        self.rows = fresh
        self.dirty.clear()
        self.elsewhere = self.everything = False
        return out

    async def full(self) -> Patches:
        await self._ask_proxy()
        return self._render(self._data(), None)

    def note(self, notice: Notice) -> None:
        if notice is RESYNC or notice.kind == "snapshot":
            self.everything = True
        elif notice.kind == "machine" and notice.app == self.app:
            if notice.machine_id in self.rows:
                self.dirty.add(notice.machine_id)
            else:
                self.elsewhere = True
        elif notice.kind == "status":
            self.dirty.update(i for i, r in self.rows.items() if r["worker"] == notice.worker_id)

    async def patches(self) -> Patches:
        if not (self.dirty or self.elsewhere or self.everything):
            return {}
        return self._render(self._data(), None if self.everything else set(self.dirty))

    async def on_tick(self) -> Patches:
        await self._ask_proxy()
        return self._render(self._data(), set(self.rows))


class MachineView(LiveView):
    """A machine: its summary when its row or its worker's status changes, and each new event
    as a row of its history."""

    def __init__(self, pages: Pages, machine_id: str) -> None:
        self.pages = pages
        self.machine_id = machine_id
        self.worker = ""
        self.stale = False
        self.last_seq = 0
        self.new_events: list[model.Data] = []

    def wants(self, item: model.Data) -> bool:
        return False

    def _summary(self) -> Patches:
        self.stale = False
        summary = self.pages.machine_row(self.machine_id)
        if summary is None:
            return {}
        self.worker = summary["worker"]
        return {"machine-summary": part("machine_summary", summary)}

    async def full(self) -> Patches:
        out = self._summary()
        try:
            events = await self.pages.flaps.list_machine_events(
                self.machine_id, timeout=RPC_TIMEOUT
            )
        except Exception:  # the page keeps the history it was rendered with
            return out
        rows = [model.event(e) for e in events]
        self.last_seq = max((e["seq"] for e in rows), default=0)
        out["events"] = part("events", rows)
        return out

    def note(self, notice: Notice) -> None:
        if notice is RESYNC:
            self.stale = True
        elif notice.kind == "machine" and notice.machine_id == self.machine_id:
            self.stale = True
            if notice.event is not None and notice.event.seq > self.last_seq:
                self.last_seq = notice.event.seq
                self.new_events.append(model.event(notice.event))
        elif notice.kind == "status" and notice.worker_id == self.worker:
            self.stale = True

    def appends(self) -> list[model.Data]:
        rows, self.new_events = self.new_events, []
        return [{"target": "events", "html": part("event_row", e)} for e in rows]

    async def patches(self) -> Patches:
        return self._summary() if self.stale else {}


async def serve(view: LiveView, live: Live, after: int, scope: Scope) -> AsyncIterator[str]:
    """The page's stream (see the module docstring), its feed items those `scope` sees; ends
    when `live` closes."""
    sub = live.subscribe()
    loop = asyncio.get_running_loop()
    last_item = after

    def feed(items: list[model.Data]) -> list[str]:
        nonlocal last_item
        out = []
        for item in items:
            last_item = max(last_item, item["seq"])
            if scope.item(item) and view.wants(item):
                out.append(sse("feed", part("feed_item", item), item["seq"]))
        return out

    try:
        sent: Patches = {}
        first = await view.full()
        sent.update(first)
        yield "".join([*feed(live.items(after)), sse("patch", first)])
        next_tick = loop.time() + view.tick if view.tick else math.inf
        quiet_since = loop.time()
        while True:
            wait = min(next_tick, quiet_since + KEEPALIVE_AFTER) - loop.time()
            try:
                notice: Notice | None = await asyncio.wait_for(sub.get(), max(0.0, wait))
            except TimeoutError:
                notice = None
            out: list[str] = []
            if notice is None:
                patches: Patches = {}
                if loop.time() >= next_tick:
                    patches = await view.on_tick()
                    next_tick = loop.time() + (view.tick or math.inf)
            else:
                await asyncio.sleep(COALESCE)  # the rest of a burst comes with it
                batch = [notice]
                while (more := sub.get_nowait()) is not None:
                    batch.append(more)
                for n in batch:
                    view.note(n)
                    if n is RESYNC:
                        out += feed(live.items(last_item))
                    elif n.item is not None and n.item["seq"] > last_item:
                        out += feed([n.item])
                out += [sse("append", a) for a in view.appends()]
                patches = await view.patches()
            changed = {k: v for k, v in patches.items() if sent.get(k) != v}
            if changed:
                sent.update(changed)
                out.append(sse("patch", changed))
            if out:
                yield "".join(out)
                quiet_since = loop.time()
            elif loop.time() - quiet_since >= KEEPALIVE_AFTER:
                yield KEEPALIVE
                quiet_since = loop.time()
    except SubscriptionClosed:
        return
    finally:
        sub.close()


def _cut(line: str) -> str:
    if len(line) <= LINE_MAX:
        return line
    return f"{line[:LINE_MAX]} [console: {len(line) - LINE_MAX} more characters not shown]"


async def logs(
    flaps: Client, machine_id: str, stops: Sequence[asyncio.Event]
) -> AsyncIterator[str]:
    """A machine's log: `tail` (its last lines, replacing what the page shows), then each new
    `line` (cut to LINE_MAX); ends with the machine's stream, or when one of `stops` is set
    (the console closes, the session ends)."""
    yield sse("tail", [])
    lines = flaps.machine_logs(machine_id, tail_lines=LOG_TAIL, follow=True)
    try:
        async for line in until(stops, lines):
            yield sse("line", _cut(line))
    except ApiError as err:
        yield sse("line", f"[console: the log stream ended: {err.message}]")


async def until(stops: Sequence[asyncio.Event], items: AsyncIterator[T]) -> AsyncIterator[T]:
    """`items` until they end or one of `stops` is set (then the iterator is closed)."""
    stop = asyncio.ensure_future(_any(stops))
    end = object()
    step: asyncio.Future[object] | None = None
    try:
        while True:
            step = asyncio.ensure_future(anext(items, end))
            await asyncio.wait({step, stop}, return_when=asyncio.FIRST_COMPLETED)
            if not step.done():
                return
            item, step = step.result(), None
            if item is end:
                return
            yield item  # type: ignore[misc]
    finally:
        stop.cancel()
        if step is not None and not step.done():
            # `items` is suspended inside that step (closing, or the page went away): it must
            # end there, cancelled, before it can be closed ("already running" otherwise).
            step.cancel()
            await asyncio.wait({step})
        aclose = getattr(items, "aclose", None)
        if aclose is not None:
            await aclose()


async def _any(events: Sequence[asyncio.Event]) -> None:
    """Return once any of `events` is set."""
    waits = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
